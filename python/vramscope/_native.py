"""_native.py: loads libvramscope.so and declares its C API (vramscope/c_api.h) for ctypes.

The library is looked up in this order: $VRAMSCOPE_LIBRARY; a copy inside this package;
the dynamic loader's search path (ctypes.util.find_library); <sys.prefix>/lib and
/usr/local/lib, where `cmake --install` puts it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path
from typing import Optional, Tuple

API_VERSION = 1  # VRAMSCOPE_C_API_VERSION this package was written against

OK, ERROR_INVALID, ERROR_OUT_OF_MEMORY, ERROR_IO, ERROR_INTERNAL = range(5)

STAT_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
STAT_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free")
POOLS = ("all", "small_pool", "large_pool")
STAT_FIELDS = ("current", "peak", "allocated", "freed")


class Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in STAT_FIELDS]


class Stats(ctypes.Structure):
    """vramscope_stats, field for field."""
    _fields_ = ([(name, Stat * 3) for name in STAT_ARRAYS]
                + [(name, ctypes.c_int64) for name in STAT_COUNTERS]
                + [("oversize_allocations", Stat), ("oversize_segments", Stat),
                   ("max_split_size", ctypes.c_int64), ("device_used_bytes", Stat),
                   ("device_total_bytes", ctypes.c_int64), ("context_bytes", ctypes.c_int64),
                   ("driver_time_us", ctypes.c_double)])


class VramscopeError(RuntimeError):
    """A vramscope call failed (misuse, a bad setting, an unwritable file)."""


class OutOfMemoryError(VramscopeError, MemoryError):
    """The device could not supply the request even after the cache was freed."""


def _candidates() -> list[Path]:
    paths: list[Path] = []
    env = os.environ.get("VRAMSCOPE_LIBRARY")
    if env:
        return [Path(env)]  # explicit: no fallback that could load another copy
    here = Path(__file__).resolve().parent
    paths += sorted(here.glob("libvramscope.so*"))
    for prefix in (Path(sys.prefix), Path("/usr/local")):
        paths += [prefix / "lib" / "libvramscope.so", prefix / "lib64" / "libvramscope.so"]
    found = ctypes.util.find_library("vramscope")  # a soname: the loader resolves it
    if found:
        paths.append(Path(found))
    return paths


def _loaded_path(name: str) -> Path:
    """The file the loader mapped for `name` (a soname has no directory of its own)."""
    if os.sep in name:
        return Path(name).absolute()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and Path(fields[-1]).name.startswith("libvramscope.so"):
                    return Path(fields[-1])
    except OSError:
        pass
    return Path(name)


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    sigs = {
        "vramscope_api_version": (c.c_int, []),
        "vramscope_init": (c.c_int, [c.c_char_p, c.c_char_p]),
        "vramscope_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_uint64]),
        "vramscope_free": (c.c_int, [c.c_void_p]),
        "vramscope_record_stream": (c.c_int, [c.c_void_p, c.c_uint64]),
        "vramscope_stream_create": (c.c_int, [c.c_int, c.POINTER(c.c_uint64)]),
        "vramscope_stream_destroy": (c.c_int, [c.c_int, c.c_uint64]),
        "vramscope_empty_cache": (c.c_int, [c.c_int]),
        "vramscope_set_memory_fraction": (c.c_int, [c.c_int, c.c_double]),
        "vramscope_get_stats": (c.c_int, [c.c_int, c.POINTER(Stats), c.c_size_t]),
        "vramscope_reset_peak_stats": (c.c_int, [c.c_int]),
        "vramscope_reset_accumulated_stats": (c.c_int, [c.c_int]),
        "vramscope_record_history": (c.c_int, [c.c_int, c.c_size_t]),
        "vramscope_snapshot_pickle": (c.c_int, [c.c_int, c.c_char_p]),
        "vramscope_snapshot_json": (c.c_int, [c.c_int, c.c_char_p]),
        "vramscope_memory_summary": (c.c_size_t, [c.c_int, c.c_char_p, c.c_size_t]),
        "vramscope_scope_push": (c.c_int, [c.c_char_p, c.c_char_p]),
        "vramscope_scope_pop": (c.c_int, []),
        "vramscope_scope_depth": (c.c_size_t, []),
        "vramscope_last_error": (c.c_char_p, []),
        "vramscope_last_error_code": (c.c_int, []),
        "vramscope_torch_malloc": (c.c_void_p, [c.c_ssize_t, c.c_int, c.c_void_p]),
        "vramscope_torch_free": (None, [c.c_void_p, c.c_ssize_t, c.c_int, c.c_void_p]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


_lib: Optional[ctypes.CDLL] = None
_path: Optional[Path] = None


def load_first(candidates, declare, version, need: int, what: str, hint: str) -> Tuple[ctypes.CDLL, str]:
    """The first of `candidates` (paths, or sonames the loader resolves) that loads, its functions
    declared by `declare`; `version(lib)` must be at least `need`. Raises VramscopeError naming
    every path tried and `hint` (how to get the library)."""
    tried = []
    for path in candidates:
        if os.sep in str(path) and not Path(path).exists():
            tried.append(f"{path} (missing)")
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        declare(lib)
        if version(lib) < need:
            raise VramscopeError(f"{path} has {what} version {version(lib)}; this package needs {need} or newer: "
                                 "rebuild and reinstall vramscope")
        return lib, str(path)
    raise VramscopeError(f"{what} not found; tried: " + ("; ".join(tried) or "nothing") +
                         ". " + hint)


def library() -> ctypes.CDLL:
    """The loaded library (loaded and checked on first use)."""
    global _lib, _path
    if _lib is not None:
        return _lib
    lib, path = load_first(_candidates(), _declare, lambda lib: lib.vramscope_api_version(), API_VERSION,
                           "libvramscope.so (C API)",
                           "Build vramscope and set VRAMSCOPE_LIBRARY to the library's path "
                           "(build/release/bindings/libvramscope.so) or run cmake --install.")
    _lib, _path = lib, _loaded_path(path)  # PyTorch must dlopen this same file
    return lib


def library_path() -> Path:
    """The path of the loaded library: the one PyTorch must load too."""
    library()
    assert _path is not None
    return _path


def check(status: int) -> None:
    """Raises the error of a failed call, with the library's message."""
    if status == OK:
        return
    message = library().vramscope_last_error().decode(errors="replace")
    if status == ERROR_OUT_OF_MEMORY:
        raise OutOfMemoryError(message)
    raise VramscopeError(message)


def check_last(lib: ctypes.CDLL) -> None:
    """Raises the calling thread's last failure, for the functions that report one by their
    return value (NULL, 0) rather than a status."""
    check(lib.vramscope_last_error_code() or ERROR_INTERNAL)


def encode(text: Optional[str]) -> Optional[bytes]:
    return None if text is None else text.encode()
