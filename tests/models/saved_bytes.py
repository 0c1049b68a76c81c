"""saved_bytes.py: what a forward saves for backward, per module, on PyTorch and as
`vramscope trace --saved` writes it: the two sides of check_export.py's and
check_transformers.py's comparisons."""
import contextlib
import csv
from pathlib import Path


@contextlib.contextmanager
def torch_saved_per_module(model, names=None, owner=lambda path: path, device_scalars=False):
    """Within it, every tensor PyTorch saves for backward is counted, each storage once, in
    the dict it yields, under owner(the innermost module running when it is first saved);
    parameters, buffers and 0-dim tensors (wrapped Python numbers: host scalars on CUDA) are
    left out. `names`: module -> path (default: model.named_modules()). `device_scalars`: on
    the meta device, where a host scalar is a CPU tensor, 0-dim meta tensors count (nll_loss's
    total_weight is a device tensor on CUDA)."""
    import torch
    names = names or {m: n for n, m in model.named_modules()}

    def key_of(t):
        # The storage itself, not its address: on the meta device every address is 0. Saved
        # storages stay alive (the pack hook returns the tensor), so no key is reused.
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()  # 1.13: storage()
        return getattr(storage, "_cdata", None) or storage.data_ptr()

    owned = {key_of(p) for p in model.parameters()} | {key_of(b) for b in model.buffers()}
    # Every saved tensor stays referenced here: a node that nothing reads dies in the forward
    # with its saved tensors, and a later storage could take the freed address.
    stack, saved, seen, hooks, kept = [], {}, set(), [], []

    def enter(m, _):
        stack.append(names[m])

    def leave(m, _i, _o):
        stack.pop()

    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave))

    def pack(t):
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()  # 1.13: storage()
        ptr = key_of(t)
        # On CUDA the fused attention kernels' philox seed and offset (0-dim int64) are host
        # tensors (attention.cu); on meta they are meta tensors like any other.
        kept.append(t)
        # Flash's philox seed and offset are uint64 tensors in its meta kernel; the runtime keeps
        # them on the host as the efficient kernel's (ops_attention.cpp): not counted either.
        philox = (t.dim() == 0 and t.dtype == torch.int64) or t.dtype == getattr(torch, "uint64", None)
        counted = (t.device.type != "cpu" and not philox) if device_scalars else t.dim() > 0
        if counted and ptr not in owned and ptr not in seen:
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
