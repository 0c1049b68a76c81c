"""_planner.py: libvramscope_planner.so, the planner's sweep, max batch, plan and trace as a library
(bindings/include/vramscope/planner_api.h), through ctypes: options in, the JSON document out.

Found as libvramscope.so is (_native.py): $VRAMSCOPE_PLANNER_LIBRARY, else beside the package
(a wheel), else beside the loaded allocator library ($VRAMSCOPE_LIBRARY: a build tree).
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ._native import VramscopeError, load_first

API_VERSION = 3
# void (*)(size_t done, size_t total, const char* item, void* user): planner_api.h's progress
_PROGRESS = ctypes.CFUNCTYPE(None, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p)
_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()


class UsageError(VramscopeError, ValueError):
    """The options were refused, as the command refuses them with exit 2: the message says which
    and why."""


class RunFailed(VramscopeError):
    """The run failed, as the command does with exit 1 (a file it could not write, no plan to
    write code for)."""


def _candidates() -> List[Path]:
    env = os.environ.get("VRAMSCOPE_PLANNER_LIBRARY")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    paths = sorted(here.glob("libvramscope_planner.so*"))
    allocator = os.environ.get("VRAMSCOPE_LIBRARY")
    if allocator:
        paths += sorted(Path(allocator).resolve().parent.glob("libvramscope_planner.so*"))
    return paths


def _declare(lib: ctypes.CDLL) -> None:
    lib.vramscope_planner_api_version.restype = ctypes.c_int
    lib.vramscope_planner_run_progress.restype = ctypes.c_int
    lib.vramscope_planner_run_progress.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), _PROGRESS,
                                                   ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.vramscope_planner_free.argtypes = [ctypes.c_void_p]


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib, _ = load_first(_candidates(), _declare, lambda lib: lib.vramscope_planner_api_version(), API_VERSION,
                             "libvramscope_planner.so (planner API)",
                             "Install vramscope with `pip install .`, or set VRAMSCOPE_PLANNER_LIBRARY to "
                             "build/release/bindings/libvramscope_planner.so")
    return _lib


def run(args: Sequence[str], progress: Optional[Callable[[int, int, str], None]] = None) -> dict:
    """`vramscope ARGS...` (sweep, plan or trace) in this process: its JSON document. `progress(done,
    total, item)` is called as the runs go (total 0: not known ahead)."""
    if not args:
        raise UsageError("give sweep, plan or trace and its options")
    lib = library()
    encoded = [os.fsencode(a) for a in args]
    argv = (ctypes.c_char_p * len(encoded))(*encoded)
    out = ctypes.c_void_p()
    told = _PROGRESS(lambda done, total, item, _user: progress(done, total, item.decode(errors="replace"))) \
        if progress is not None else _PROGRESS()
    with _lock:
        status = lib.vramscope_planner_run_progress(len(encoded), argv, told, None, ctypes.byref(out))
    try:
        text = ctypes.string_at(out.value).decode(errors="replace") if out.value else ""
    finally:
        lib.vramscope_planner_free(out)
    if status == 0:
        return json.loads(text)
    raise (UsageError if status == 2 else RunFailed)(text or f"vramscope {args[0]}: status {status}")
