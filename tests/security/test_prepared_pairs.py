"""A target plans a peer's request of blocks from the pair of caches prepared by the
first such request (``prepared.plan_on_loop``). Whatever the peer sends (layouts, layer
ranges, block sizes, block indices in and out of range, repeated), the prepared plan is the
full planner's, to the byte, and so is every refusal; and a cache keeps a bounded number of
pairs however many layouts a peer names."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import numpy as np
import pytest
from helpers import blocks_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdd_async._errors import LLMException, ProtocolError
from llmdd_async._messages import (
    Address,
    By,
    CacheInfo,
    Op,
    Request,
    Shape,
    TableSnapshot,
    regions_of,
)
from llmdd_async._net import prepared
from llmdd_async._net.grants import Resolved, TransferRequest, plan_checked, plan_selection
from llmdd_async._net.prepared import _KEPT_PAIRS, plan_on_loop, plan_prepared
from llmdd_async._planner import BlockPair, Layout, check_within
from llmdd_async._registry import CacheEntry


def _entry(ntensors: int, count: int, block: int) -> CacheEntry:
    # Tensors out of address order, with gaps between them.
    tb = count * block
    addrs = [(7 - 2 * i) % 8 * (tb + 64) + 4096 for i in range(ntensors)]
    return blocks_entry(addrs, count, block, cache_id=3, dtype=4)


@st.composite
def requests(draw: st.DrawFn) -> tuple[CacheEntry, Request]:
    block = draw(st.sampled_from([16, 32, 64]))
    entry = _entry(draw(st.integers(1, 6)), draw(st.integers(1, 8)), block)
    n = draw(st.integers(1, 6))  # the peer's tensors
    count = draw(st.integers(1, 8))
    their_block = draw(st.sampled_from([block, block, block // 2, block * 2]))
    is_blocks = draw(st.booleans()) or draw(st.booleans())
    addrs = np.array([1 << 40 | i * (count * their_block + 8) for i in range(n)], np.uint64)
    layers = st.one_of(st.none(), st.builds(range, st.integers(0, 3), st.integers(1, 5)))
    k = draw(st.integers(1, 12) | st.integers(13, 48))  # (past 64 ranges: planned in numpy)
    index = st.integers(0, 9) | st.sampled_from([2**63, 2**64 - 1])
    src_b = np.array(draw(st.lists(index, min_size=k, max_size=k)), np.uint64)
    dst_b = np.array(draw(st.lists(index, min_size=k, max_size=k)), np.uint64)
    req = Request(
        req_id=1,
        op=draw(st.sampled_from([Op.PULL, Op.PUSH])),
        target=Address(By.CACHE_ID, cache_id=entry.cache_id),
        shape=Shape.BLOCKS,
        layout=(count * their_block, count, is_blocks),
        local_addrs=addrs,
        local_slot=draw(st.integers(0, 2)),
        src_range=draw(layers),
        dst_range=draw(layers),
        tensor_num_per_layer=draw(st.integers(1, 3)),
        dst_block_bytes=draw(st.none() | st.sampled_from([block // 2, block, block * 2, 0])),
        src_blocks=src_b,
        dst_blocks=dst_b,
    )
    return entry, req


def _resolved(entry: CacheEntry, req: Request) -> Resolved:
    tb, count, is_blocks = req.layout
    return Resolved(
        req.op,
        By.CACHE_ID,
        entry,
        0,
        Layout(req.local_addrs, tb, count, is_blocks),
        entry.layout,
        entry.num_tensors * entry.tensor_bytes,
        None,
        len(req.local_addrs) * (0 if req.src_blocks is None else len(req.src_blocks)),
        1,
    )


def _outcome(plan: Any, req: Request, entry: CacheEntry) -> Any:
    try:
        p, slot, idx, ids = plan(req, _resolved(entry, req))
    except (LLMException, ProtocolError, ZeroDivisionError) as exc:
        return type(exc), str(exc), getattr(exc, "status_code", None)
    return p.src.tolist(), p.dst.tolist(), p.nbytes.tolist(), slot, idx.tolist(), ids


@settings(max_examples=500, deadline=None)
@given(requests(), st.data())
def test_a_prepared_plan_is_the_full_planners_plan_or_refusal(case: Any, data: Any) -> None:
    entry, req = case
    want = _outcome(plan_checked, req, entry)
    assert _outcome(plan_on_loop, req, entry) == want  # prepares the pair (if it may)
    assert _outcome(plan_on_loop, req, entry) == want  # and plans from it
    # Other blocks through the same pair: still the full planner's answer.
    k = len(req.src_blocks)
    other = st.lists(st.integers(0, 9), min_size=k, max_size=k)
    for _ in range(3):
        req.src_blocks = np.array(data.draw(other), np.uint64)
        req.dst_blocks = np.array(data.draw(other), np.uint64)
        assert _outcome(plan_on_loop, req, entry) == _outcome(plan_checked, req, entry)


@pytest.mark.parametrize("tensors", [2, prepared._KEYED_TENSORS])
def test_a_cache_keeps_a_bounded_number_of_pairs(tensors: int) -> None:
    """A peer naming a new layout in each request fills the cache's pairs up to a bound, and
    each holds its tensors' addresses once (arrays; Python ints only for a few tensors)."""
    import tracemalloc

    entry = blocks_entry(
        [4096 + t * (8 * 32 + 64) for t in range(tensors)], 8, 32, cache_id=3, dtype=4
    )
    _ = entry.regions
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3 * _KEPT_PAIRS):
            local = [1 << 40 | i << 20 | t << 12 for t in range(tensors)]
            req = Request(
                req_id=i,
                op=Op.PULL,
                target=Address(By.CACHE_ID, cache_id=entry.cache_id),
                shape=Shape.BLOCKS,
                layout=(8 * 32, 8, True),
                local_addrs=np.array(local, np.uint64),
                src_blocks=np.array([i % 8], np.uint64),
                dst_blocks=np.array([7 - i % 8], np.uint64),
            )
            plan, _, _, _ = plan_on_loop(req, _resolved(entry, req))
            assert plan.dst.tolist() == [a + (7 - i % 8) * 32 for a in local]
            assert 0 < len(entry.pairs) <= _KEPT_PAIRS
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Each pair of 256 tensors: ours and the peer's addresses (2 KiB each), its key (2 KiB).
    assert held < _KEPT_PAIRS * 10 * 1024, held


@pytest.mark.parametrize("op", [Op.PULL, Op.PUSH])
@pytest.mark.parametrize("tensors", [2, 160])  # (160 x 2 blocks: planned in numpy)
def test_a_pair_is_prepared_once_for_the_requests_that_pair_the_same_caches(
    op: Op, tensors: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[BlockPair] = []

    class Counted(BlockPair):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(prepared, "BlockPair", Counted)
    entry = blocks_entry(
        [4096 + t * (8 * 32 + 64) for t in range(tensors)], 8, 32, cache_id=3, dtype=4
    )
    for i in range(10):
        req = Request(
            req_id=i,
            op=op,
            target=Address(By.CACHE_ID, cache_id=entry.cache_id),
            shape=Shape.BLOCKS,
            layout=(8 * 32, 8, True),
            local_addrs=np.array([1 << 40 | t << 12 for t in range(tensors)], np.uint64),
            src_blocks=np.array([i % 8, (i + 3) % 8], np.uint64),
            dst_blocks=np.array([(i + 5) % 8, i % 8], np.uint64),
        )
        plan, _, _, _ = plan_on_loop(req, _resolved(entry, req))
        want, _, _, _ = plan_checked(req, _resolved(entry, req))
        assert plan.src.tolist() == want.src.tolist() and plan.dst.tolist() == want.dst.tolist()
    assert len(made) == 1


@pytest.mark.parametrize("op", [Op.PULL, Op.PUSH])
@pytest.mark.parametrize("block", [1, 99], ids=["planned", "refused"])
def test_a_kept_pair_holds_nothing_of_the_request(op: Op, block: int) -> None:
    """The peer's addresses arrive as a view of its request frame: a pair kept after the
    request (planned or refused) must not hold them, or a peer padding its frames with
    unused arrays would make every cache of ours keep 64 of those frames."""
    entry = _entry(2, 8, 32)
    frame = np.zeros(1 << 20, np.uint8)  # the request's bytes, as the decoder holds them
    gone = weakref.ref(frame)
    addrs = frame[:16].view(np.uint64)
    addrs[:] = [1 << 40, 1 << 41]
    req = Request(
        req_id=1,
        op=op,
        target=Address(By.CACHE_ID, cache_id=entry.cache_id),
        shape=Shape.BLOCKS,
        layout=(8 * 32, 8, True),
        local_addrs=addrs,
        src_blocks=np.array([block], np.uint64),
        dst_blocks=np.array([2], np.uint64),
    )
    with contextlib.suppress(LLMException):
        plan_on_loop(req, _resolved(entry, req))
    assert entry.pairs
    del frame, addrs, req
    gc.collect()
    assert gone() is None, [type(v) for v in entry.pairs.values()]


def test_a_peer_layout_of_many_tensors_is_planned_in_full_and_not_kept() -> None:
    # A kept key holds the peer's addresses: 8 bytes a tensor, so a layout of up to
    # _KEYED_TENSORS only (a peer naming 65536 tensors would make each key 512 KiB).
    entry = _entry(2, 8, 32)
    n = prepared._KEYED_TENSORS + 1
    req = Request(
        req_id=1,
        op=Op.PULL,
        target=Address(By.CACHE_ID, cache_id=entry.cache_id),
        shape=Shape.BLOCKS,
        layout=(8 * 32, 8, True),
        local_addrs=np.arange(n, dtype=np.uint64) * 4096 + (1 << 40),
        src_range=range(0, 1),
        dst_range=range(0, 1),
        tensor_num_per_layer=1,
        src_blocks=np.array([1], np.uint64),
        dst_blocks=np.array([2], np.uint64),
    )
    assert _outcome(plan_on_loop, req, entry) == _outcome(plan_checked, req, entry)
    assert not entry.pairs


@st.composite
def published(draw: st.DrawFn) -> tuple[Layout, tuple[np.ndarray, np.ndarray], TransferRequest]:
    """The cache a one-sided pull reads, as the peer's table publishes it, beside other caches
    the table lists over, under or across its tensors (a hostile table may overlap them)."""
    block = draw(st.sampled_from([16, 32]))
    count, n = draw(st.integers(2, 8)), draw(st.integers(1, 4))
    base = 1 << 30
    tgt = Layout(
        np.array([base + i * (count * block + 64) for i in range(n)], np.uint64),
        count * block,
        count,
        True,
    )
    caches = [CacheInfo(7, tuple(tgt.addrs.tolist()), count * block, count, True, 0, True)]
    span = n * (count * block + 64)
    for k in range(draw(st.integers(0, 4))):
        start = base + draw(st.integers(-64, span))
        size = draw(st.integers(1, span))
        caches.append(CacheInfo(8 + k, (start,), size, 1, False, 0, True))
    local = blocks_entry([1 << 40, 1 << 41, 1 << 42, 1 << 43][:n], count, block, cache_id=1)
    k = draw(st.integers(1, 4) | st.integers(17, 40))  # (past 64 ranges: planned in numpy)
    idx = st.lists(st.integers(0, count - 1), min_size=k, max_size=k)
    spec = _pull_of_cache_7(local, np.array(draw(idx), np.uint64), np.array(draw(idx), np.uint64))
    return tgt, regions_of(caches), spec


def _pull_of_cache_7(
    local: CacheEntry, src: np.ndarray, dst: np.ndarray, dst_block_bytes: int | None = None
) -> TransferRequest:
    """A pull of blocks of the peer's cache 7 into ``local``, every tensor."""
    return TransferRequest(
        Op.PULL,
        Address(By.CACHE_ID, cache_id=7),
        Shape.BLOCKS,
        local,
        tensor_num_per_layer=1,
        src_blocks=src,
        dst_blocks=dst,
        dst_block_bytes=dst_block_bytes,
    )


@settings(max_examples=300, deadline=None)
@given(published())
def test_a_prepared_pull_reads_only_what_the_full_check_allows(case: Any) -> None:
    """An initiator's prepared one-sided pull serves only what the full plan and its range
    check serve, whatever other caches the peer's table lists across the cache's tensors."""
    tgt, regions, spec = case
    got = plan_prepared({}, spec, tgt, regions)
    want, _, _ = plan_selection(
        Op.PULL, Shape.BLOCKS, spec.local.layout, tgt, 0, local_slot=0, src_range=None,
        dst_range=None, tnpl=1, size=-1, src_offset=0, dst_offset=0,
        src_blocks=spec.src_blocks, dst_blocks=spec.dst_blocks, dst_block_bytes=None,
    )  # fmt: skip
    allowed = check_within(want.src, want.nbytes, *regions)
    if got is not None:
        assert allowed, (regions, want.src.tolist(), want.nbytes.tolist())
        assert got.src.tolist() == want.src.tolist() and got.dst.tolist() == want.dst.tolist()
    # (The cache's own tensors are published: a request inside them is always allowed.)
    assert allowed


def test_a_peers_published_regions_are_disjoint_however_its_caches_overlap() -> None:
    caches = [
        CacheInfo(1, (1000, 5000), 100, 1, False, 0, True),
        CacheInfo(2, (1050,), 10, 1, False, 0, True),  # inside the first tensor
        CacheInfo(3, (1090, 4990), 20, 1, False, 0, True),  # across an end, across a start
        CacheInfo(4, (2000,), 100, 1, False, 0, False),  # not reachable: not a region
    ]
    starts, ends = regions_of(caches)
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == [(1000, 1110), (4990, 5100)]
    # the same from a table as it arrives (as a link snapshots it)
    table = {"caches": [c.encode() for c in caches]}
    starts, ends = TableSnapshot(table).regions
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == [(1000, 1110), (4990, 5100)]
    assert check_within(np.array([1055], np.uint64), np.array([40], np.uint64), starts, ends)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 2**64 - 2), st.integers(1, 2**20)).filter(
            lambda r: r[0] + r[1] < 2**64
        ),
        max_size=40,
    ),
    st.integers(0, 40),
)
def test_published_regions_are_the_union_of_the_tensors_merged_as_a_scan_does(
    ranges: list[tuple[int, int]], near: int
) -> None:
    """The regions (vectorised: a Python sort of a hostile table's 100k tensors held the
    interpreter 120 ms in one call) equal a sorted scan's: each tensor in exactly one region,
    regions sorted and apart (touching ones stay two, as the scan leaves them)."""
    # (ranges bunched near one another too, so that many overlap or touch)
    ranges = ranges + [(s % 4096 + 1, n % 64 + 1) for s, n in ranges[:near]]
    caches = [CacheInfo(i, (a,), n, 1, False, 0, True) for i, (a, n) in enumerate(ranges)]
    starts, ends = regions_of(caches)
    want_s: list[int] = []
    want_e: list[int] = []
    for a, e in sorted((a, a + n) for a, n in ranges):
        if want_e and a < want_e[-1]:
            want_e[-1] = max(want_e[-1], e)
        else:
            want_s.append(a)
            want_e.append(e)
    assert starts.tolist() == want_s and ends.tolist() == want_e
    assert starts.dtype == ends.dtype == np.uint64


def test_an_initiator_plans_no_small_request_whose_selection_is_too_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer's table may say its blocks are a byte (or none): what this side selects of its
    own cache bounds a request sent with its bytes planned (.eager) before anything is
    planned, so such a table never makes it plan thousands of ranges on the loop."""
    import types

    from llmdd_async._net import eager

    planned: list[Any] = []
    monkeypatch.setattr(eager, "plan_prepared", lambda *a: planned.append(a))
    local = blocks_entry([(1 << 40) + t * (4096 * 16384) for t in range(160)], 4096, 16384)
    addrs = tuple((1 << 30) + t * 64 for t in range(160))
    table = [CacheInfo(7, addrs, 1, 1 << 20, True, 0, True)]  # (blocks of no byte at all)
    view = types.SimpleNamespace(
        layout=lambda _: Layout.of(addrs, 1, 1 << 20, True),
        device_memory=lambda _: False,
        dtype=lambda _: local.dtype,
        regions=regions_of(table),
        pairs={},
    )
    engine = types.SimpleNamespace(
        options=types.SimpleNamespace(remote_accessible=True), host_reachable=lambda _: True
    )
    blocks = np.arange(4096, dtype=np.uint64)
    spec = _pull_of_cache_7(local, blocks, blocks, dst_block_bytes=16384)
    link = types.SimpleNamespace(view=view)
    assert eager.eager_pull_plan(engine, link, spec) is None  # type: ignore[arg-type]
    assert not planned
