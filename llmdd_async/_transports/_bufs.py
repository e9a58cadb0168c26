"""The buffers of one syscall over a list of 1-D byte views, and where the next one starts
once the kernel moved some bytes: shared by the loop's sends and receives and the workers'.
Pure: no I/O.
"""

from __future__ import annotations

import bisect
import itertools

__all__ = ["FEW_VIEWS", "IOV_MAX", "Chunk", "advance", "batch", "moved"]

IOV_MAX = 1024
#: bytes per sendmsg/recvmsg call: measured here, 4 MiB calls stream loopback at 3-4.5 GB/s
#: where 32 MiB calls stay near 2 GB/s (frames stay big; only the syscalls are cut)
_SYSCALL_BYTES = 4 << 20

#: what :func:`batch` returns: a syscall's buffers, and their bytes where none is cut
Chunk = tuple[list[memoryview], int]


def batch(bufs: list[memoryview], idx: int) -> Chunk:
    """The buffers for one syscall: from ``idx``, at most IOV_MAX of them and about
    ``_SYSCALL_BYTES`` (a larger first buffer is cut); and their bytes where none is cut (-1
    otherwise), so that a call that moved them all goes past them with no look at each
    (:func:`moved`). ``bufs`` are 1-D byte views, so ``len`` is their size (C speed over the
    many views of a many-tensor plan)."""
    out = bufs[idx : idx + IOV_MAX]
    size = sum(map(len, out))
    if size <= _SYSCALL_BYTES:  # (most calls: no buffer is cut)
        return out, size
    # (running sizes and a bisection: C speed over a call's thousand views of a many-tensor
    # plan, where a Python loop cost about a tenth of the bytes' time)
    ends = list(itertools.accumulate(map(len, out)))
    k = bisect.bisect_right(ends, _SYSCALL_BYTES)  # buffers that fit whole
    total = ends[k - 1] if k else 0
    if total == _SYSCALL_BYTES:
        return out[:k], total
    out = out[: k + 1]  # (the sum is over the bound: buffer k crosses it, and is cut)
    out[k] = out[k][: _SYSCALL_BYTES - total]
    return out, -1


def moved(bufs: list[memoryview], idx: int, n: int, chunk: Chunk) -> int:
    """:func:`advance` past ``n`` bytes moved by one call of ``chunk`` (:func:`batch`'s)."""
    return idx + len(chunk[0]) if n == chunk[1] else advance(bufs, idx, n)


#: past this many buffers, :func:`advance` finds where ``n`` bytes end by bisecting their
#: running sizes (C speed); below it a Python loop costs less
FEW_VIEWS = 16


def advance(bufs: list[memoryview], idx: int, n: int) -> int:
    """Past ``n`` bytes moved from ``bufs[idx:]`` (1-D byte views): the index of the first
    buffer not fully moved, that buffer trimmed in place to what is left of it."""
    if len(bufs) - idx > FEW_VIEWS and n > 0:
        ends = list(itertools.accumulate(map(len, bufs[idx : idx + IOV_MAX])))
        k = bisect.bisect_right(ends, n)
        if k == len(ends):  # (a call moves at most a batch: IOV_MAX buffers)
            return idx + k if n == ends[-1] else advance(bufs, idx + k, n - ends[-1])
        rest = n - ends[k - 1] if k else n
        idx += k
        if rest:
            bufs[idx] = bufs[idx][rest:]
        return idx
    while n > 0:
        first = bufs[idx]
        if n >= first.nbytes:
            n -= first.nbytes
            idx += 1
        else:
            bufs[idx] = first[n:]
            n = 0
    return idx
