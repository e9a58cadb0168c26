"""Where a one-sided same-host copy finds a peer's ranges in the pools it mapped
(``SameHostAccess._translate``): a range counts only if it lies wholly inside one pool (never
straddling its end, never wrapping past 2**64), in Python ints for a few ranges (a search
each, or one test of them all) and with numpy for many; all give the same answer, also where
one pool ends and the next begins. And ``copy_now``, which copies through them."""

from __future__ import annotations

import fcntl
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdd_async._memory import CancelToken
from llmdd_async._transports import same_host
from llmdd_async._transports.same_host import SameHostAccess

#: (the peer's base, size, our base) of each mapped pool, out of order (a pool's base is
#: below 2**63 - its size: _MappedPool refuses others)
POOLS = [
    (1 << 40, 4096, 7 << 30),
    (1 << 20, 8192, 3 << 30),
    ((1 << 20) + 8192, 4096, 9 << 30),  # (starts where the one before ends)
    (2**63 - 8192, 4096, 5 << 30),
]


def _access() -> SameHostAccess:
    access = object.__new__(SameHostAccess)
    access.pools = [SimpleNamespace(remote_base=b, size=n, local_base=lb) for b, n, lb in POOLS]
    access._index_pools()
    return access


@st.composite
def ranges(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(1, same_host._TRANSLATE_FEW))
    # Often all in one pool, as most requests are (a few ranges, then many: the search per
    # range, then the one test of them all)
    one = draw(st.none() | st.integers(0, len(POOLS) - 1))
    addrs, sizes = [], []
    for _ in range(n):
        base, size, _ = POOLS[draw(st.integers(0, len(POOLS) - 1)) if one is None else one]
        # Mostly near a pool: inside, straddling its end, just before it.
        addrs.append(min(max(base + draw(st.integers(-64, size + 64)), 0), 2**64 - 1))
        # (and now and then a size that wraps the address past 2**64)
        sizes.append(draw(st.one_of(st.integers(0, 2 * size), st.just(2**64 - 1))))
    return np.array(addrs, dtype=np.uint64), np.array(sizes, dtype=np.uint64)


@settings(max_examples=300, deadline=None)
@given(ranges())
def test_many_ranges_are_found_in_the_pools_as_a_few_are(case) -> None:  # type: ignore[no-untyped-def]
    remote, nbytes = case
    access = _access()
    few = access._translate(remote, nbytes)
    reps = same_host._TRANSLATE_FEW // len(remote) + 1
    many = access._translate(np.tile(remote, reps), np.tile(nbytes, reps))
    assert many == (None if few is None else few * reps)
    for a, n, ours in zip(remote.tolist(), nbytes.tolist(), few or [], strict=False):
        # (the pool a range starts in; an empty range may also sit at a pool's very end)
        base, size, local = max((p for p in POOLS if p[0] <= a), key=lambda p: p[0])
        assert a + n <= base + size and ours == local + a - base


@pytest.mark.parametrize("count", [2, 8, 40])  # a search per range; one test of all; numpy
def test_a_range_past_a_pools_end_is_not_found(count: int) -> None:
    access = _access()
    base, size, local = POOLS[1]
    inside = np.array([base] * count, dtype=np.uint64)
    assert access._translate(inside, np.full(count, size, dtype=np.uint64)) == [local] * count
    past = np.full(count, size, dtype=np.uint64)
    past[-1] += 1  # (one byte past the end, in the last range only)
    assert access._translate(inside, past) is None
    below = inside.copy()
    below[-1] -= 1  # (one byte before the pool)
    assert access._translate(below, np.ones(count, dtype=np.uint64)) is None
    wraps = np.full(count, 2**64 - 1, dtype=np.uint64)  # (base + size wraps past 2**64)
    assert access._translate(inside, wraps) is None


@pytest.mark.parametrize("count", [2, 8, 40])
def test_an_empty_range_where_a_pool_meets_the_next_is_the_next_ones(count: int) -> None:
    # However many ranges a request has (each searched; all tested at once; numpy), an
    # address where one pool ends and the next begins is found in the next, as its own
    # search finds it.
    access = _access()
    base, size, local = POOLS[1]
    nxt_base, _, nxt_local = POOLS[2]
    assert nxt_base == base + size
    remote = np.array([base] * (count - 1) + [base + size], dtype=np.uint64)
    nbytes = np.array([16] * (count - 1) + [0], dtype=np.uint64)
    assert access._translate(remote, nbytes) == [local] * (count - 1) + [nxt_local]


@pytest.mark.parametrize("count", [2, 8])
def test_a_copy_through_a_pool_lands_and_empty_ranges_at_its_end_do_not_pass(
    count: int,
) -> None:
    # A copy of ranges inside a mapped pool moves their bytes from our mapping of it; only
    # empty ranges at the pool's very end (or none at all) are not the pool's: with no
    # process_vm_* allowed, they are not copied here (None) but left to the task.
    pool = (np.arange(8192) % 251).astype(np.uint8)
    ours = np.zeros(16 * count, dtype=np.uint8)
    access = object.__new__(SameHostAccess)
    remote_base = 1 << 30
    mapped = SimpleNamespace(remote_base=remote_base, size=pool.nbytes, local_base=pool.ctypes.data)
    access.pools = [mapped]  # type: ignore[list-item]
    access._index_pools()
    access.pvr = False
    token = CancelToken()
    offsets = [100 * i for i in range(count)]
    remote = np.array([remote_base + o for o in offsets], dtype=np.uint64)
    local = np.array([ours.ctypes.data + 16 * i for i in range(count)], dtype=np.uint64)
    sixteen = np.full(count, 16, dtype=np.uint64)
    assert access.copy_now(remote, local, sixteen, token, True) == 16 * count
    assert ours.tobytes() == b"".join(pool[o : o + 16].tobytes() for o in offsets)
    at_end = np.full(count, remote_base + pool.nbytes, dtype=np.uint64)
    assert access.copy_now(at_end, local, np.zeros(count, dtype=np.uint64), token, True) is None
    none = np.zeros(0, dtype=np.uint64)
    assert access.copy_now(none, none, none, token, True) is None


def _memfd(size: int) -> int:
    fd = os.memfd_create("pool", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_pools_over_the_same_addresses_are_refused_but_the_lowest() -> None:
    # A peer names each pool's base: a second pool over addresses one already holds would
    # give them two meanings (two memfds). It is not mapped; the rest are.
    base, size = 1 << 32, 8192
    fds = [_memfd(size) for _ in range(4)]
    claims = [
        (fds[0], base + 4096, size),  # overlaps the next one's end
        (fds[1], base, size),
        (fds[2], base, size),  # the same base as another
        (fds[3], base + size, size),  # starts where the lowest ends: kept
    ]
    access = SameHostAccess(os.getpid(), None, claims, (0, ""), None)  # type: ignore[arg-type]
    try:
        assert [(p.remote_base, p.size) for p in access.pools] == [
            (base, size),
            (base + size, size),
        ]
        assert len(access.refused) == 2
        assert all("another pool" in why for why in access.refused)
        remote = np.array([base + size - 16, base + size], dtype=np.uint64)
        mapped = access._translate(remote, np.full(2, 16, dtype=np.uint64))
        assert mapped == [access.pools[0].local_base + size - 16, access.pools[1].local_base]
    finally:
        access.close()
        for fd in fds:
            os.close(fd)
