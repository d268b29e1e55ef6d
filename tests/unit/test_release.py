"""A held rank gives freed heap memory back before its dump (torchpass/runtime/release.py)."""

from __future__ import annotations

import json
import subprocess
import sys

# Chunks below glibc's mmap threshold live in the heap; freeing them all but the last keeps
# the pages resident (the last one pins the heap's top, so free() alone cannot shrink it).
PROGRAM = r"""
import ctypes, ctypes.util, json, sys
from torchpass.runtime.release import release_allocator_caches, _resident_bytes
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
chunks = [libc.malloc(64 * 1024) for _ in range(int(sys.argv[1]))]
for c in chunks:
    ctypes.memset(c, 1, 64 * 1024)
if sys.argv[2] == "free":
    for c in chunks[:-1]:
        libc.free(c)
before = _resident_bytes()
got = release_allocator_caches()
print(json.dumps({**got, "rss_drop_mb": (before - _resident_bytes()) / 1e6}))
"""


def run(n: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(n), mode], capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout)


def test_freed_heap_pages_leave_the_process_and_are_counted():
    got = run(400, "free")  # 26 MB freed inside the heap
    assert got["rss_drop_mb"] > 20, got
    assert abs(got["released_mb"] - got["rss_drop_mb"]) < 1.0, got
    assert got["release_s"] < 1.0, got


def test_memory_still_in_use_stays():
    got = run(400, "keep")
    assert got["released_mb"] < 1.0, got
