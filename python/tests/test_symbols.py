"""libvramscope.so exports exactly the functions c_api.h declares: nothing of the static
libraries inside it (fmt, nlohmann, the C++ API) that could clash with PyTorch's."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(os.environ.get("VRAMSCOPE_SOURCE_DIR", Path(__file__).resolve().parents[2]))


def declared() -> set[str]:
    header = (SOURCE / "bindings/include/vramscope/c_api.h").read_text()
    return set(re.findall(r"VRAMSCOPE_C_EXPORT[^;(]*?\b(vramscope_\w+)\s*\(", header))


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_exports_are_the_headers_functions():
    lib = os.environ.get("VRAMSCOPE_LIBRARY")
    if not lib:
        pytest.skip("VRAMSCOPE_LIBRARY is not set (CTest sets it)")
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                         check=True).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.split()[1] in "TtWiDBRV"]
    # Every export carries the symbol version of exports.map (name@@VRAMSCOPE_1).
    assert all(sym.endswith("@@VRAMSCOPE_1") for sym in symbols if sym.startswith("vramscope_"))
    exported = {sym.split("@")[0] for sym in symbols}
    # The symbols every shared object defines for the loader.
    exported -= {"_init", "_fini", "_edata", "_end", "__bss_start"}
    names = declared()
    assert {"vramscope_torch_malloc", "vramscope_torch_free", "vramscope_malloc"} <= names
    assert exported == names, (f"exported but not declared: {sorted(exported - names)}; "
                               f"declared but not exported: {sorted(names - exported)}")
