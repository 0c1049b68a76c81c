"""Module hooks on a CPU model (PyTorch from Debian's python3-torch or PyPI): the scopes
they open attribute allocations made inside a module's forward, inside its backward, and
inside checkpoint recomputation. The CPU model's own tensors do not come from vramscope,
so each layer allocates through the C API where PyTorch's CUDA allocator would."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

MODEL = """
import json, torch, vramscope
from torch import nn
vramscope.init("sim", "")
MiB = 1 << 20
live = []

class Allocating(torch.autograd.Function):
    # Stands for a CUDA kernel: a block in forward (kept), and a block in backward.
    @staticmethod
    def forward(ctx, x, size):
        live.append(vramscope.malloc(size))
        ctx.size = size
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        live.append(vramscope.malloc(ctx.size + MiB))
        return grad * 2, None

class Layer(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.size = size
        self.scale = nn.Parameter(torch.ones(1))
        self.act = nn.ReLU(inplace=True)  # in-place modules keep working under the hooks

    def forward(self, x):
        return self.act(Allocating.apply(x * self.scale, self.size))

def owners():
    path = "snap.json"
    vramscope.snapshot_json(path)
    doc = json.load(open(path))
    return sorted((b["module"], b["phase"], b["requested_size"] // MiB)
                  for seg in doc["segments"] for b in seg["blocks"]
                  if b["state"] == "active_allocated")
"""


def test_forward_and_backward_allocations_carry_module_and_phase(run_fresh):
    out = run_fresh(MODEL + """
model = nn.Sequential(Layer(2 * MiB), nn.Sequential(Layer(3 * MiB)))
tracker = vramscope.track_modules(model)
x = torch.ones(4, requires_grad=True)
model(x).sum().backward()
print(json.dumps(owners()))
tracker.remove()
from vramscope._native import library
print(library().vramscope_scope_depth())
""")
    result, depth = out.splitlines()
    assert json.loads(result) == [["0", "backward", 3], ["0", "forward", 2],
                                  ["1.0", "backward", 4], ["1.0", "forward", 3]]
    assert depth == "0"


def test_no_scope_stays_open_across_steps(run_fresh):
    out = run_fresh(MODEL + """
model = nn.Sequential(Layer(2 * MiB), Layer(3 * MiB))
tracker = vramscope.track_modules(model)
from vramscope._native import library
depths = []
for step in range(3):
    model(torch.ones(4)).sum().backward()  # the input needs no gradient
    depths.append(library().vramscope_scope_depth())
print(depths)
""")
    assert out.strip() == "[0, 0, 0]"  # every scope closed after each step


def test_checkpoint_recomputation_is_its_own_phase(run_fresh):
    out = run_fresh(MODEL + """
from torch.utils.checkpoint import checkpoint
inner = Layer(2 * MiB)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = inner
    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)
model = Net()
tracker = vramscope.track_modules(model)
x = torch.ones(4, requires_grad=True)
model(x).sum().backward()
print(json.dumps(owners()))
""")
    phases = {(m, p) for m, p, _ in json.loads(out)}
    assert ("block", "forward") in phases
    assert ("block", "recompute") in phases
    assert ("block", "backward") in phases


def test_a_forward_that_raises_leaves_nothing_behind(run_fresh):
    out = run_fresh(MODEL + """
class Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.fail = True
    def forward(self, x):
        if self.fail:
            self.fail = False
            raise MemoryError("out of memory, try a smaller batch")
        return x
model = nn.Sequential(Layer(2 * MiB), nn.Sequential(Flaky()), Layer(3 * MiB))
tracker = vramscope.track_modules(model)
from vramscope._native import library
try:
    model(torch.ones(4, requires_grad=True)).sum().backward()
except MemoryError:
    pass
depths, owned = [], []
for step in range(3):
    model(torch.ones(4, requires_grad=True)).sum().backward()
    depths.append(library().vramscope_scope_depth())
    owned.append(len(tracker._state.owner))
print(depths, owned)
""")
    assert out.strip() == "[0, 0, 0] [0, 0, 0]"


def test_ops_between_children_are_the_parents(run_fresh):
    out = run_fresh(MODEL + """
class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Layer(2 * MiB)
        self.b = Layer(3 * MiB)
    def forward(self, x):
        x = self.a(x)
        x = Allocating.apply(x, 7 * MiB) + 1  # the parent's own op, between its children
        return self.b(x)
model = Parent()
tracker = vramscope.track_modules(model)
model(torch.ones(4, requires_grad=True)).sum().backward()
print(json.dumps(owners()))
""")
    owners = {(m, p, size) for m, p, size in json.loads(out)}
    assert ("Parent", "forward", 7) in owners
    assert ("Parent", "backward", 8) in owners, owners
    assert ("a", "backward", 3) in owners and ("b", "backward", 4) in owners, owners
