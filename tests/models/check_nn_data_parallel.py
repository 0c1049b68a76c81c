#!/usr/bin/env python3
"""check_nn_data_parallel.py VRAMSCOPE: nn.DataParallel's gradient reduction, grouped as today's
PyTorch groups it, against `vramscope trace --parallel dp:2 --buffers`.

nn.DataParallel needs CUDA devices to run, so its step cannot run here; what runs on the CPU
is the helper its backward cuts the gradients with: comm.reduce_add_coalesced calls
torch._utils._take_tensors(grads, 10485760) and flattens each group into one buffer (a copy
when it holds several tensors), reducing it into a new buffer on GPU 0 whose views become the
.grad. For torchvision's resnet18 and vit_b_16 (the zoo's, built alike) the groups of their
parameters' gradients, in order, must equal vramscope's: GPU 0's reduced buffers, their bytes,
and the flattened copies made where a group holds several gradients.

The broadcast at each forward cuts the parameters with C++'s utils::take_tensors, which Python
does not expose; its rule is cited in runtime/src/parallel/nn_data_parallel.hpp and pinned by
tests/runtime/nn_data_parallel_test.cpp.

Exit 77 (skipped) without torch and torchvision, unless VRAMSCOPE_REQUIRE_STACK=1 (CI).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from stack_python import reexec_on_stack

BUFFER_SIZE = 10485760  # comm.reduce_add_coalesced's default


def theirs(name):
    import torch
    import torchvision
    from torch._utils import _take_tensors
    model = getattr(torchvision.models, name)()
    grads = [torch.empty_like(p) for p in model.parameters()]
    groups = [sum(t.numel() * t.element_size() for t in chunk) for chunk in _take_tensors(grads, BUFFER_SIZE)]
    flats = [sum(t.numel() * t.element_size() for t in chunk)
             for chunk in _take_tensors(grads, BUFFER_SIZE) if len(chunk) > 1]
    return groups, flats


def ours(exe, name, tmp):
    out = Path(tmp) / f"{name}.json"
    subprocess.run([exe, "trace", "--model", name, "--batch", "2", "--dtype", "f32", "--device", "sim:h100-80g",
                    "--steps", "1", "--parallel", "dp:2", "--buffers", str(out)], check=True, capture_output=True,
                   text=True)
    log = json.loads(out.read_text())
    groups = [r["bytes"] for r in log if r["buffer"].startswith("reduced gradients")]
    flats = [r["bytes"] for r in log if r["buffer"] == "gradients flattened for the reduce"]
    return groups, flats


def main() -> int:
    reexec_on_stack("check_nn_data_parallel")
    import torch
    exe = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("resnet18", "vit_b_16"):
            a, b = theirs(name), ours(exe, name, tmp)
            same = a == b
            print(f"  {name}: {len(a[0])} groups ({len(a[1])} flattened) in PyTorch, {len(b[0])} ({len(b[1])}) in "
                  f"vramscope: {'equal' if same else 'DIFFER'}")
            if not same:
                print(f"    PyTorch {a}\n    vramscope {b}")
                failures.append(name)
    print(f"check_nn_data_parallel: torch {torch.__version__}: "
          f"{'every group equal' if not failures else 'differ: ' + ', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
