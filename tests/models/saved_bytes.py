"""saved_bytes.py: what a forward saves for backward, per module, on PyTorch and as
`vramscope trace --saved` writes it: the two sides of check_export.py's and
check_transformers.py's comparisons."""
import contextlib
import csv
from pathlib import Path


@contextlib.contextmanager
def torch_saved_per_module(model, names=None, owner=lambda path: path):
    """Within it, every tensor PyTorch saves for backward is counted, each storage once, in
    the dict it yields, under owner(the innermost module running when it is first saved);
    parameters, buffers and 0-dim tensors (wrapped Python numbers: host scalars on CUDA) are
    left out. `names`: module -> path (default: model.named_modules())."""
    import torch
    names = names or {m: n for n, m in model.named_modules()}
    owned = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    stack, saved, seen, hooks = [], {}, set(), []

    def enter(m, _):
        stack.append(names[m])

    def leave(m, _i, _o):
        stack.pop()

    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave))

    def pack(t):
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()  # 1.13: storage()
        ptr = storage.data_ptr()
        if t.dim() > 0 and ptr not in owned and ptr not in seen:
            seen.add(ptr)
            key = owner(stack[-1] if stack else "")
            saved[key] = saved.get(key, 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        for h in hooks:
            h.remove()


def vramscope_saved_per_module(csv_path: Path, names: set, skip=("loss",)) -> dict:
    """`trace --saved`'s CSV summed per PyTorch module: a vramscope module that PyTorch does
    not have (code in a forward, such as torch.flatten) counts in the enclosing one; rows of
    the modules in `skip` are left out (the loss runs after the model's forward)."""
    saved = {}
    for row in csv.DictReader(Path(csv_path).open()):
        if row["module"] in skip:
            continue
        parts = row["module"].split(".") if row["module"] else []
        while parts and ".".join(parts) not in names:
            parts.pop()
        key = ".".join(parts)
        saved[key] = saved.get(key, 0) + int(row["bytes"])
    return saved
