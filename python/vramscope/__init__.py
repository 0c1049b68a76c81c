"""vramscope: the caching allocator under PyTorch, with the statistics and snapshots that
PyTorch cannot give under a pluggable allocator.

    import vramscope, torch
    vramscope.enable()                       # before the first CUDA tensor
    model = torchvision.models.resnet50().cuda()
    hooks = vramscope.track_modules(model)   # per-module, per-phase attribution
    loss = model(x).sum(); loss.backward()
    print(vramscope.max_memory_allocated())  # as torch.cuda.max_memory_allocated()
    vramscope.snapshot("step.pickle")        # drag into pytorch.org/memory_viz

Without PyTorch the same functions serve the allocator through the C API
(`malloc`, `free`), on a real GPU or a simulated one (`init("sim:a100-80g")`).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Optional, Union

from ._native import (POOLS, STAT_ARRAYS, STAT_COUNTERS, STAT_FIELDS, OutOfMemoryError, Stats,
                      VramscopeError, check, check_last, encode, library, library_path)
from ._estimate import estimate, max_batch, plan, sweep
from ._hub import find_hf_config
from ._training_args import from_training_args
from ._stack import installed_stack
from ._torch import ModuleTracker, enable, track_modules

__all__ = [
    "OutOfMemoryError", "VramscopeError", "ModuleTracker", "device_memory", "empty_cache",
    "enable", "estimate", "find_hf_config", "free", "from_training_args", "init", "installed_stack", "library_path", "malloc", "max_memory_allocated",
    "max_batch", "max_memory_reserved", "memory_allocated", "memory_reserved", "memory_stats",
    "memory_summary", "plan", "record_memory_history", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "scope", "set_per_process_memory_fraction", "snapshot",
    "snapshot_json", "sweep", "track_modules",
]

PathLike = Union[str, Path]


def init(device: Optional[str] = None, alloc_conf: Optional[str] = None) -> None:
    """Chooses the device ("auto", "cuda", "sim:a100-80g", ...) and the allocator settings
    (PYTORCH_CUDA_ALLOC_CONF syntax) before the first allocation. None keeps the current
    value (at first $VRAMSCOPE_DEVICE and $VRAMSCOPE_ALLOC_CONF)."""
    check(library().vramscope_init(encode(device), encode(alloc_conf)))


def malloc(size: int, device: int = 0, stream: int = 0) -> int:
    """A block of at least `size` bytes; its address as an int."""
    lib = library()
    ptr = lib.vramscope_malloc(size, device, stream)
    if not ptr:
        check_last(lib)
    return ptr


def free(ptr: int) -> None:
    check(library().vramscope_free(ptr))


def _stats(device: int) -> Stats:
    out = Stats()
    check(library().vramscope_get_stats(device, ctypes.byref(out), ctypes.sizeof(out)))
    return out


def memory_stats(device: int = 0) -> "OrderedDict[str, int]":
    """torch.cuda.memory_stats(): the same keys, sorted as PyTorch sorts them."""
    s = _stats(device)
    flat = {}
    for name in STAT_ARRAYS:
        array = getattr(s, name)
        for i, pool in enumerate(POOLS):
            for field in STAT_FIELDS:
                flat[f"{name}.{pool}.{field}"] = getattr(array[i], field)
    for name in STAT_COUNTERS:
        flat[name] = getattr(s, name)
    for name in ("oversize_allocations", "oversize_segments"):
        for field in STAT_FIELDS:
            flat[f"{name}.{field}"] = getattr(getattr(s, name), field)
    flat["max_split_size"] = s.max_split_size
    return OrderedDict(sorted(flat.items()))


def device_memory(device: int = 0) -> dict:
    """What PyTorch's statistics leave out: the process as nvidia-smi shows it (the CUDA
    context plus every segment at the driver's granularity), its peak, the context alone,
    the device's capacity, and the time spent in cudaMalloc / cudaFree."""
    s = _stats(device)
    return {"total_bytes": s.device_total_bytes, "used_bytes": s.device_used_bytes.current,
            "peak_used_bytes": s.device_used_bytes.peak, "context_bytes": s.context_bytes,
            "driver_time_us": s.driver_time_us}


def memory_allocated(device: int = 0) -> int:
    return _stats(device).allocated_bytes[0].current


def max_memory_allocated(device: int = 0) -> int:
    return _stats(device).allocated_bytes[0].peak


def memory_reserved(device: int = 0) -> int:
    return _stats(device).reserved_bytes[0].current


def max_memory_reserved(device: int = 0) -> int:
    return _stats(device).reserved_bytes[0].peak


def reset_peak_memory_stats(device: int = 0) -> None:
    check(library().vramscope_reset_peak_stats(device))


def reset_accumulated_memory_stats(device: int = 0) -> None:
    check(library().vramscope_reset_accumulated_stats(device))


def empty_cache(device: int = 0) -> None:
    """Returns every unsplit cached segment to the device (torch.cuda.empty_cache())."""
    check(library().vramscope_empty_cache(device))


def set_per_process_memory_fraction(fraction: float, device: int = 0) -> None:
    check(library().vramscope_set_memory_fraction(device, fraction))


def record_memory_history(max_entries: Optional[int] = 100_000, device: int = 0) -> None:
    """Records allocator events for the snapshots' trace (None or 0 stops), as
    torch.cuda.memory._record_memory_history(max_entries=...)."""
    check(library().vramscope_record_history(device, max_entries or 0))


def snapshot(path: PathLike, device: int = 0) -> None:
    """Writes PyTorch's memory-snapshot pickle (pytorch.org/memory_viz): segments, blocks
    with their module and phase, and the recorded history."""
    check(library().vramscope_snapshot_pickle(device, str(path).encode()))


def snapshot_json(path: PathLike, device: int = 0) -> None:
    check(library().vramscope_snapshot_json(device, str(path).encode()))


def memory_summary(device: int = 0) -> str:
    """torch.cuda.memory_summary()'s table, plus the nvidia-smi view and fragmentation."""
    lib = library()
    length = lib.vramscope_memory_summary(device, None, 0)
    if length == 0:
        check_last(lib)
    buf = ctypes.create_string_buffer(length + 1)
    lib.vramscope_memory_summary(device, buf, length + 1)
    return buf.value.decode()


@contextlib.contextmanager
def scope(path: str, phase: str = "forward") -> Iterator[None]:
    """Allocations on this thread inside the block belong to module `path` in `phase`."""
    lib = library()
    check(lib.vramscope_scope_push(path.encode(), phase.encode()))
    try:
        yield
    finally:
        check(lib.vramscope_scope_pop())
