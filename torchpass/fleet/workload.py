"""The audit's compute workload and its expected checksum: the standard library only.

C <- (C @ P) * SCALE mod MOD, with C a fixed pseudo-random integer matrix and P a fixed
permutation matrix: the probe (probe.py) runs it as dense float64 matmuls, and its result has a
closed form computed here in O(n^2 + n * iters) (0.24 s for n=256 on the development VM). Every
value stays an integer below 2**53, so float64 is exact whatever order the sums run in.
"""

from __future__ import annotations

MOD = 65521
SCALE = 3


def _lcg(seed: int):
    x = seed
    while True:
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        yield x >> 33


def workload(n: int, seed: int = 1) -> tuple[list[list[int]], list[int]]:
    """(C0 as rows of ints below MOD, the permutation: column j of C @ P is column perm[j] of C)."""
    g = _lcg(seed)
    c0 = [[next(g) % MOD for _ in range(n)] for _ in range(n)]
    perm = list(range(n))
    for i in range(n - 1, 0, -1):  # Fisher-Yates with the same generator
        j = next(g) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return c0, perm


def expected_checksum(n: int, iters: int, seed: int = 1) -> int:
    """sum over (i, j) of (i + 2j + 1) * C_iters[i][j] mod 2**61, in pure Python (O(n^2 + n*iters))."""
    c0, perm = workload(n, seed)
    src = list(range(n))  # column j of C_k is column src[j] of C0
    for _ in range(iters):
        src = [src[perm[j]] for j in range(n)]
    factor = pow(SCALE, iters, MOD)
    total = 0
    for i in range(n):
        row = c0[i]
        for j in range(n):
            total += (i + 2 * j + 1) * (row[src[j]] * factor % MOD)
    return total % (1 << 61)


