"""Give freed memory back to the kernel before a rank is dumped.

CRIU dumps every present page of the process, and the time a migration
stands still grows with the image (dump and restore each run near the
machine's first-touch write speed: docs/benchmarks.md). Memory the
training loop has freed but its allocators still hold (glibc's heap below
the mmap threshold, PyTorch's CUDA caching allocator) would be copied,
moved and restored for nothing. A held rank (about to be dumped) releases
both at the pause; ranks that stay in place do not, so they resume with
their caches warm.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim() -> None:
    # The process's own symbols (libc among them), not ctypes.util.find_library, which runs
    # ldconfig in a child process. glibc only (musl has no malloc_trim): a missing symbol is
    # not an error.
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


def _empty_cuda_cache() -> None:
    # Only where the process already uses CUDA: importing or initializing it here would
    # create a context in a CPU-only rank (and torch is imported only if the job did).
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def release_allocator_caches() -> dict:
    """Empty PyTorch's CUDA cache (if CUDA is in use) and trim glibc's heap.

    Returns ``{"release_s", "released_mb"}``: the time it took and the resident
    memory it gave back (host memory; the CUDA cache's share shows in the GPU image).
    """
    t0 = time.monotonic()
    before = _resident_bytes()
    _empty_cuda_cache()
    _malloc_trim()
    released = max(0, before - _resident_bytes())
    return {"release_s": round(time.monotonic() - t0, 4), "released_mb": round(released / 1e6, 1)}


__all__ = ["release_allocator_caches"]
