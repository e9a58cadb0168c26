"""The planner against a naive per-byte reference, with hypothesis-generated layouts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import llmdd_async as dd
from llmdd_async._planner import (
    Layout,
    Plan,
    check_within,
    coalesce,
    plan_block_copies,
    plan_blocks,
    plan_slot_to_blocks,
    plan_slots,
    tensor_windows,
)

BASE = 4096
PARAM = dd.LLMStatusCode.LLM_PARAM_INVALID


class Space:
    """A simulated address space: byte ``addr`` lives at ``mem[addr - BASE]``."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.mem = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)

    def get(self, addr: int, n: int) -> np.ndarray:
        return self.mem[addr - BASE : addr - BASE + n]


@st.composite
def layouts(draw: st.DrawFn, is_blocks: bool, num_tensors: int | None = None) -> Layout:
    """Tensors placed in order with random gaps (zero gaps exercise cross-tensor merges)."""
    n = num_tensors if num_tensors is not None else draw(st.integers(1, 6))
    count = draw(st.integers(1, 10))
    stride = draw(st.integers(1, 12))
    tensor_bytes = count * stride
    addrs, cur = [], BASE
    for _ in range(n):
        cur += draw(st.sampled_from([0, 0, 1, 7]))
        addrs.append(cur)
        cur += tensor_bytes
    return Layout.of(addrs, tensor_bytes, count, is_blocks)


def space_for(layout: Layout, seed: int) -> Space:
    end = int(layout.addrs.max()) + layout.tensor_bytes
    return Space(end - BASE + 16, seed)


def run_plan(plan: Plan, src: Space, dst: Space) -> None:
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.nbytes.tolist(), strict=True):
        dst.get(d, n)[:] = src.get(s, n)


def _tensor_of(layout: Layout, addrs: np.ndarray) -> np.ndarray:
    order = np.argsort(layout.addrs)
    starts = layout.addrs[order]
    return order[np.searchsorted(starts, addrs, side="right") - 1]


def assert_maximally_merged(
    plan: Plan, src: Layout | None = None, dst: Layout | None = None
) -> None:
    """No two consecutive descriptors could merge; with layouts: every descriptor lies inside
    one tensor on each side (tensors that touch in memory are never merged across), and
    consecutive descriptors merge whenever they are in the same tensors."""
    same = np.ones(max(0, len(plan) - 1), dtype=bool)
    for layout, addrs in ((src, plan.src), (dst, plan.dst)):
        if layout is None or not len(plan):
            continue
        t = _tensor_of(layout, addrs)
        end = addrs - layout.addrs[t] + plan.nbytes
        assert np.all(end <= np.uint64(layout.tensor_bytes)), "a descriptor spans two tensors"
        same &= t[1:] == t[:-1]
    if len(plan) > 1:
        ends_s = plan.src[:-1] + plan.nbytes[:-1]
        ends_d = plan.dst[:-1] + plan.nbytes[:-1]
        assert not np.any((plan.src[1:] == ends_s) & (plan.dst[1:] == ends_d) & same)
    assert np.all(plan.nbytes > 0)


# ------------------------------------------------------------------ naive references
def naive_blocks(src, dst, s_idx, d_idx, s_blocks, d_blocks, src_sp, dst_sp) -> None:
    bb = src.stride
    for ts, td in zip(s_idx, d_idx, strict=True):
        for bs, bd in zip(s_blocks, d_blocks, strict=True):
            for k in range(bb):  # per element, on purpose
                dst_sp.mem[int(dst.addrs[td]) + bd * bb + k - BASE] = src_sp.mem[
                    int(src.addrs[ts]) + bs * bb + k - BASE
                ]


def naive_slots(src, dst, s_idx, d_idx, s_slot, d_slot, size, s_off, d_off, src_sp, dst_sp):
    for ts, td in zip(s_idx, d_idx, strict=True):
        for k in range(size):
            dst_sp.mem[int(dst.addrs[td]) + d_slot * dst.stride + d_off + k - BASE] = src_sp.mem[
                int(src.addrs[ts]) + s_slot * src.stride + s_off + k - BASE
            ]


def naive_slot_to_blocks(src, dst, s_idx, d_idx, s_slot, d_blocks, src_sp, dst_sp) -> None:
    bb = dst.stride
    for ts, td in zip(s_idx, d_idx, strict=True):
        for k in range(src.stride):
            piece, within = divmod(k, bb)
            dst_sp.mem[int(dst.addrs[td]) + d_blocks[piece] * bb + within - BASE] = src_sp.mem[
                int(src.addrs[ts]) + s_slot * src.stride + k - BASE
            ]


# ------------------------------------------------------------------ properties
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_blocks_to_blocks_matches_naive(data: st.DataObject) -> None:
    src = data.draw(layouts(True))
    n_dst = data.draw(st.integers(src.num_tensors, src.num_tensors + 2))
    dst_count = data.draw(st.integers(1, 10))
    gaps = data.draw(st.lists(st.sampled_from([0, 3]), min_size=n_dst, max_size=n_dst))
    addrs, cur = [], BASE
    for g in gaps:
        cur += g
        addrs.append(cur)
        cur += dst_count * src.stride
    dst = Layout.of(addrs, dst_count * src.stride, dst_count, True)
    k = data.draw(st.integers(1, 12))
    s_blocks = np.array(data.draw(st.lists(st.integers(0, src.count - 1), min_size=k, max_size=k)))
    d_blocks = np.array(data.draw(st.lists(st.integers(0, dst_count - 1), min_size=k, max_size=k)))
    t0 = data.draw(st.integers(0, n_dst - src.num_tensors))
    s_idx = np.arange(src.num_tensors)
    d_idx = np.arange(t0, t0 + src.num_tensors)
    plan = plan_blocks(src, dst, s_idx, d_idx, s_blocks, d_blocks)
    assert_maximally_merged(plan, src, dst)
    src_sp = space_for(src, 1)
    got, want = space_for(dst, 2), space_for(dst, 2)
    run_plan(plan, src_sp, got)
    naive_blocks(src, dst, s_idx, d_idx, s_blocks.tolist(), d_blocks.tolist(), src_sp, want)
    assert np.array_equal(got.mem, want.mem)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_slot_to_slot_matches_naive(data: st.DataObject) -> None:
    src = data.draw(layouts(False))
    dst = data.draw(layouts(False, num_tensors=src.num_tensors))
    s_slot = data.draw(st.integers(0, src.count - 1))
    d_slot = data.draw(st.integers(0, dst.count - 1))
    s_off = data.draw(st.integers(0, src.stride - 1))
    d_off = data.draw(st.integers(0, dst.stride - 1))
    room = min(src.stride - s_off, dst.stride - d_off)
    size = data.draw(st.one_of(st.just(-1), st.integers(1, room)))
    idx = np.arange(src.num_tensors)
    if size == -1 and dst.stride - d_off > src.stride - s_off:
        with pytest.raises(dd.LLMException) as err:
            plan_slots(src, dst, idx, idx, s_slot, d_slot, size, s_off, d_off)
        assert err.value.status_code == PARAM
        return
    plan = plan_slots(src, dst, idx, idx, s_slot, d_slot, size, s_off, d_off)
    eff = dst.stride - d_off if size == -1 else size
    assert plan.total_bytes == eff * src.num_tensors
    assert_maximally_merged(plan, src, dst)
    src_sp = space_for(src, 3)
    got, want = space_for(dst, 4), space_for(dst, 4)
    run_plan(plan, src_sp, got)
    naive_slots(src, dst, idx, idx, s_slot, d_slot, eff, s_off, d_off, src_sp, want)
    assert np.array_equal(got.mem, want.mem)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_slot_to_blocks_matches_naive(data: st.DataObject) -> None:
    dst = data.draw(layouts(True))
    src_stride = data.draw(st.integers(1, dst.stride * 4))
    src_count = data.draw(st.integers(1, 4))
    src = Layout.of(
        [BASE + i * (src_count * src_stride + 5) for i in range(dst.num_tensors)],
        src_count * src_stride,
        src_count,
        False,
    )
    pieces = -(-src_stride // dst.stride)
    assume(pieces <= dst.count)
    d_blocks = np.array(data.draw(st.permutations(range(dst.count)))[:pieces])
    s_slot = data.draw(st.integers(0, src_count - 1))
    idx = np.arange(dst.num_tensors)
    plan = plan_slot_to_blocks(src, dst, idx, idx, s_slot, d_blocks)
    assert_maximally_merged(plan, src, dst)
    assert plan.total_bytes == src_stride * dst.num_tensors
    src_sp = space_for(src, 5)
    got, want = space_for(dst, 6), space_for(dst, 6)
    run_plan(plan, src_sp, got)
    naive_slot_to_blocks(src, dst, idx, idx, s_slot, d_blocks.tolist(), src_sp, want)
    assert np.array_equal(got.mem, want.mem)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(1, 6)),
        min_size=0,
        max_size=30,
    )
)
def test_coalesce_keeps_every_byte_mapping(descs: list[tuple[int, int, int]]) -> None:
    src = np.array([BASE + d[0] for d in descs], dtype=np.uint64)
    dst = np.array([BASE + d[1] for d in descs], dtype=np.uint64)
    n = np.array([d[2] for d in descs], dtype=np.uint64)
    plan = coalesce(src, dst, n)
    assert_maximally_merged(plan)

    def byte_pairs(s: np.ndarray, d: np.ndarray, nb: np.ndarray) -> list[tuple[int, int]]:
        return [
            (int(a) + k, int(b) + k)
            for a, b, m in zip(s.tolist(), d.tolist(), nb.tolist(), strict=True)
            for k in range(m)
        ]

    assert byte_pairs(plan.src, plan.dst, plan.nbytes) == byte_pairs(src, dst, n)


@settings(max_examples=200, deadline=None)
@given(
    src_layers=st.integers(1, 6),
    dst_layers=st.integers(1, 6),
    n=st.integers(1, 3),
    src_r=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(1, 4))),
    dst_r=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(1, 4))),
)
def test_tensor_windows_rules(src_layers, dst_layers, n, src_r, dst_r) -> None:
    src_count, dst_count = src_layers * n, dst_layers * n
    sr = None if src_r is None else range(src_r[0], src_r[0] + src_r[1])
    dr = None if dst_r is None else range(dst_r[0], dst_r[0] + dst_r[1])
    want_s = list(range(src_count)) if sr is None else list(range(sr.start * n, sr.stop * n))
    want_d = list(range(dst_count)) if dr is None else list(range(dr.start * n, dr.stop * n))
    ok = (
        (sr is None or sr.stop <= src_layers)
        and (dr is None or dr.stop <= dst_layers)
        and len(want_s) == len(want_d)
    )
    if not ok:
        with pytest.raises(dd.LLMException) as err:
            tensor_windows(src_count, dst_count, sr, dr, n)
        assert err.value.status_code == PARAM
        return
    s, d = tensor_windows(src_count, dst_count, sr, dr, n)
    assert s.tolist() == want_s
    assert d.tolist() == want_d


def test_tensor_num_per_layer_must_divide_counts() -> None:
    with pytest.raises(dd.LLMException) as err:
        tensor_windows(6, 6, range(0, 1), None, 4)
    assert err.value.status_code == PARAM
    with pytest.raises(dd.LLMException):
        tensor_windows(4, 4, None, None, 0)
    s, d = tensor_windows(6, 6, None, None, 4)  # no range: N does not matter
    assert len(s) == len(d) == 6


@settings(max_examples=200, deadline=None)
@given(
    regions=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), min_size=0, max_size=6),
    probes=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 10)), min_size=1, max_size=8),
)
def test_check_within_matches_naive(regions, probes) -> None:
    starts, ends, cur = [], [], BASE
    for gap, size in regions:
        cur += gap
        starts.append(cur)
        ends.append(cur + size)
        cur += size
    a = np.array([BASE + p[0] for p in probes], dtype=np.uint64)
    n = np.array([p[1] for p in probes], dtype=np.uint64)
    want = all(
        any(s <= int(x) and int(x) + int(m) <= e for s, e in zip(starts, ends, strict=True))
        for x, m in zip(a, n, strict=True)
    )
    got = check_within(a, n, np.array(starts, dtype=np.uint64), np.array(ends, dtype=np.uint64))
    assert got == want


# ------------------------------------------------------------------ rules and shapes
def blocks_layout(n_tensors: int, n_blocks: int, bb: int, gap: int = 0) -> Layout:
    tb = n_blocks * bb
    return Layout.of([BASE + i * (tb + gap) for i in range(n_tensors)], tb, n_blocks, True)


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "why"),
    [
        ([0, 1], [0], "unequal lengths"),
        ([], [], "empty dst"),
        ([8], [0], "src index out of range"),
        ([0], [4], "dst index out of range"),
    ],
)
def test_blocks_rules(src_blocks, dst_blocks, why) -> None:
    src, dst = blocks_layout(2, 8, 16), blocks_layout(2, 4, 16)
    idx = np.arange(2)
    with pytest.raises(dd.LLMException) as err:
        plan_blocks(src, dst, idx, idx, np.array(src_blocks), np.array(dst_blocks))
    assert err.value.status_code == PARAM, why


def test_block_sizes_must_match() -> None:
    idx = np.arange(1)
    with pytest.raises(dd.LLMException):
        plan_blocks(blocks_layout(1, 4, 16), blocks_layout(1, 4, 32), idx, idx, [0], [0])


def test_slot_out_of_range_is_not_exist_on_source_param_on_destination() -> None:
    src = Layout.of([BASE], 64, 4, False)
    dst = Layout.of([BASE + 100], 64, 4, False)
    idx = np.arange(1)
    with pytest.raises(dd.LLMException) as err:
        plan_slots(src, dst, idx, idx, 4, 0)
    assert err.value.status_code == dd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(dd.LLMException) as err:
        plan_slots(src, dst, idx, idx, 0, 4)
    assert err.value.status_code == PARAM
    with pytest.raises(dd.LLMException) as err:
        plan_slots(src, dst, idx, idx, 0, 0, size=17)
    assert err.value.status_code == PARAM


def test_slot_to_blocks_needs_exactly_the_pieces() -> None:
    src = Layout.of([BASE], 100, 1, False)
    dst = blocks_layout(1, 8, 32, gap=0)
    idx = np.arange(1)
    plan = plan_slot_to_blocks(src, dst, idx, idx, 0, np.array([3, 4, 5, 6]))
    assert plan.nbytes.tolist() == [100]  # 3 full blocks + a partial one, merged
    with pytest.raises(dd.LLMException):
        plan_slot_to_blocks(src, dst, idx, idx, 0, np.array([3, 4, 5]))


def test_big_request_coalesces_contiguous_runs_and_tensors() -> None:
    n_tensors, n_blocks = 80, 4096
    src = blocks_layout(n_tensors, n_blocks, 64)
    dst = blocks_layout(n_tensors, n_blocks, 64)
    idx = np.arange(n_tensors)
    blocks = np.arange(n_blocks)
    plan = plan_blocks(src, dst, idx, idx, blocks, blocks)
    # All tensors lie back to back on both sides, but a descriptor never spans two tensors
    # (both ends check ranges per tensor): one descriptor per tensor.
    assert len(plan) == n_tensors
    assert plan.total_bytes == n_tensors * n_blocks * 64
    shuffled = np.random.default_rng(0).permutation(n_blocks)
    plan = plan_blocks(src, dst, idx, idx, shuffled, blocks)
    assert plan.total_bytes == n_tensors * n_blocks * 64
    assert len(plan) > n_tensors * n_blocks * 0.99


def test_block_copies_within_one_cache() -> None:
    layout = blocks_layout(3, 6, 8, gap=5)
    sp = space_for(layout, 9)
    want = sp.mem.copy()
    plan = plan_block_copies(layout, layout, np.array([0, 0, 2]), np.array([3, 4, 5]))
    run_plan(plan, sp, sp)
    for t in range(3):
        base = int(layout.addrs[t]) - BASE
        for s, d in ((0, 3), (0, 4), (2, 5)):
            want[base + d * 8 : base + d * 8 + 8] = want[base + s * 8 : base + s * 8 + 8]
    assert np.array_equal(sp.mem, want)


@given(
    bases=st.lists(
        st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)), min_size=1, max_size=8
    ),
    pieces=st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(1, 100)),
        min_size=1,
        max_size=8,
    ),
)
def test_small_plans_built_in_python_equal_the_numpy_ones(bases, pieces) -> None:  # type: ignore[no-untyped-def]
    """The few-descriptor planner (Python ints) gives the numpy planner's exact descriptors,
    merges and uint64 wrap-around included."""
    from llmdd_async import _planner

    u = np.uint64
    sb, db = (np.array([b[i] for b in bases], dtype=u) for i in (0, 1))
    so, do, nb = (np.array([p[i] for p in pieces], dtype=u) for i in (0, 1, 2))
    small = _planner._outer_lists(*(a.tolist() for a in (sb, db, so, do, nb)))
    with np.errstate(over="ignore"):
        s = (sb[:, None] + so[None, :]).ravel()
        d = (db[:, None] + do[None, :]).ravel()
        big = _planner.coalesce(s, d, np.tile(nb, len(sb)), row=len(nb))
    for a, b in zip(
        (small.src, small.dst, small.nbytes), (big.src, big.dst, big.nbytes), strict=True
    ):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@given(
    regions=st.lists(st.tuples(st.integers(0, 2**64 - 2), st.integers(1, 500)), max_size=6),
    ranges=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 600)), max_size=10),
    near=st.booleans(),
)
def test_check_within_small_inputs_agree_with_numpy(regions, ranges, near) -> None:  # type: ignore[no-untyped-def]
    """The Python path for a few ranges answers exactly as the vectorised one."""
    from llmdd_async import _planner

    regions = sorted({s: n for s, n in regions}.items())
    kept: list[tuple[int, int]] = []
    for s, n in regions:  # non-overlapping, as the registry guarantees
        if (not kept or s >= kept[-1][0] + kept[-1][1]) and s + n < 2**64:
            kept.append((s, n))
    starts = np.array([s for s, _ in kept], dtype=np.uint64)
    ends = np.array([s + n for s, n in kept], dtype=np.uint64)
    if near and kept:  # ranges around the regions' edges, where the answers change
        ranges = [(kept[i % len(kept)][0] + (a % 700) - 100, n) for i, (a, n) in enumerate(ranges)]
        ranges = [(min(max(0, a), 2**64 - 1), n) for a, n in ranges]
    a = np.array([r[0] for r in ranges], dtype=np.uint64)
    n = np.array([r[1] for r in ranges], dtype=np.uint64)
    fast = _planner.check_within(a, n, starts, ends)
    # Past the small-input cut, the same ranges take the numpy path.
    reps = _planner._SMALL // max(1, len(ranges)) + 1
    with np.errstate(over="ignore"):
        slow = _planner.check_within(np.tile(a, reps), np.tile(n, reps), starts, ends)
    assert fast == slow
