"""Range arithmetic shared by the transfer-engine transports (NIXL, Mooncake): what a cache
registers, and how a request's ranges are cut into bounded chunks."""

from __future__ import annotations

import numpy as np

__all__ = ["U64", "cuts", "merged_runs", "tensor_regions"]

U64 = np.uint64


def merged_runs(addrs: np.ndarray, size: int) -> np.ndarray:
    """``(start, len)`` rows of the tensors at ``addrs`` (``size`` bytes each), adjacent ones
    merged: what one cache registers."""
    s = np.sort(np.asarray(addrs, dtype=U64))
    e = s + U64(size)
    brk = np.flatnonzero(s[1:] != e[:-1]) + 1
    lo = s[np.concatenate(([0], brk))]
    hi = e[np.concatenate((brk - 1, [len(s) - 1]))]
    return np.stack([lo, hi - lo], axis=1)


def cuts(nbytes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` descriptor ranges of at most ``limit`` bytes each (a bigger descriptor is
    a range of its own)."""
    csum = np.cumsum(nbytes, dtype=np.int64)
    out = []
    lo, base = 0, 0
    n = len(nbytes)
    while lo < n:
        hi = int(np.searchsorted(csum, base + limit, side="right"))
        hi = max(hi, lo + 1)
        out.append((lo, hi))
        base = int(csum[hi - 1])
        lo = hi
    return out


def tensor_regions(addrs: list[np.ndarray], sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (starts, ends) of tensors (each array of ``addrs`` has its own size)."""
    if not addrs:
        return np.zeros(0, dtype=U64), np.zeros(0, dtype=U64)
    starts = np.concatenate([np.asarray(a, dtype=U64) for a in addrs])
    ends = starts + np.concatenate(
        [np.full(len(a), size, dtype=U64) for a, size in zip(addrs, sizes, strict=True)]
    )
    order = np.argsort(starts, kind="stable")
    return starts[order], ends[order]
