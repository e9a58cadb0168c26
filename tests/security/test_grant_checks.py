"""The initiator's check of a grant against what it asked for: the few-descriptor path (plain
Python, on the hot path) and the vectorised path agree on every input; the target's own plan
of any request passes, and one that moves less than the request selected does not."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import blocks_entry
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmdd_async import LLMException
from llmdd_async._messages import Address, By, Op, Shape
from llmdd_async._net.grant_checks import (
    grant_covers_selection,
    grant_fault,
    grant_within_selection,
)
from llmdd_async._net.grants import TransferRequest, plan_selection
from llmdd_async._registry import CacheEntry

BLOCK = 64
COUNT = 8


def _entry(ntensors: int) -> CacheEntry:
    # Tensors laid out out of order, with gaps between them.
    base = [10_000, 1_000, 30_000, 20_000][:ntensors]
    return blocks_entry(base, COUNT, BLOCK, dtype=4, remote_accessible=False)


@st.composite
def cases(draw: st.DrawFn) -> tuple[CacheEntry, list[int], np.ndarray, np.ndarray]:
    e = _entry(draw(st.integers(1, 4)))
    blocks = draw(st.lists(st.integers(0, COUNT - 1), min_size=1, max_size=COUNT))
    n = draw(st.integers(1, 40))
    local, nbytes = [], []
    for _ in range(n):
        t = draw(st.integers(0, e.num_tensors - 1))
        # Mostly ranges near real blocks: inside, straddling, past the end, before the start.
        off = draw(st.integers(-BLOCK, BLOCK * COUNT + BLOCK))
        ln = draw(st.integers(1, 3 * BLOCK))
        local.append(int(e.addrs[t]) + off if int(e.addrs[t]) + off > 0 else 1)
        nbytes.append(ln)
    return e, blocks, np.array(local, dtype=np.uint64), np.array(nbytes, dtype=np.uint64)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_few_descriptor_path_matches_the_vectorised_one(case) -> None:  # type: ignore[no-untyped-def]
    e, blocks, local, nbytes = case
    spec = TransferRequest(
        "pull", Address(By.CACHE_ID), "blocks", e, dst_blocks=np.array(blocks, dtype=np.int64)
    )
    fast = grant_within_selection(spec, local, nbytes)
    # The same descriptors, repeated past the small-input cut, take the vectorised path.
    reps = 40 // len(local) + 1
    slow = grant_within_selection(spec, np.tile(local, reps), np.tile(nbytes, reps))
    assert fast == slow
    # The same blocks named many times over (past the few-blocks cut): the same answers.
    many = TransferRequest(
        "pull",
        Address(By.CACHE_ID),
        "blocks",
        e,
        dst_blocks=np.array(blocks * (64 // len(blocks) + 1), dtype=np.int64),
    )
    assert grant_within_selection(many, local, nbytes) == fast
    assert grant_within_selection(many, np.tile(local, reps), np.tile(nbytes, reps)) == fast


def test_a_range_into_an_unselected_block_is_refused() -> None:
    e = _entry(2)
    spec = TransferRequest(
        "pull", Address(By.CACHE_ID), "blocks", e, dst_blocks=np.array([1, 2], dtype=np.int64)
    )
    a = int(e.addrs[1])
    ok = np.array([a + BLOCK, a + 2 * BLOCK], dtype=np.uint64)
    assert grant_within_selection(spec, ok, np.array([BLOCK, BLOCK], dtype=np.uint64))
    # One block too far: block 3 was not asked for.
    bad = np.array([a + 3 * BLOCK], dtype=np.uint64)
    assert not grant_within_selection(spec, bad, np.array([BLOCK], dtype=np.uint64))
    # Spanning blocks 1-2 in one descriptor is fine; 2-3 is not.
    assert grant_within_selection(spec, ok[:1], np.array([2 * BLOCK], dtype=np.uint64))
    assert not grant_within_selection(spec, ok[1:], np.array([2 * BLOCK], dtype=np.uint64))


# --------------------------------------------------------------- a grant covers the selection
def _cache(tensors: int, count: int, stride: int, blocks: bool, base: int) -> CacheEntry:
    e = blocks_entry([base + i * (count * stride + 4096) for i in range(tensors)], count, stride)
    e.is_blocks = blocks
    return e


@st.composite
def honest(draw: st.DrawFn) -> tuple[TransferRequest, np.ndarray, np.ndarray, bool]:
    """A request of any shape and the target's own plan of it: ``(spec, our side of the plan,
    its sizes, whether our side alone fixes the bytes)``."""
    op = draw(st.sampled_from([Op.PULL, Op.PUSH]))
    shape = draw(st.sampled_from([Shape.BLOCKS, Shape.SLOT, Shape.SLOT_TO_BLOCKS]))
    tnpl, layers = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    tensors = tnpl * layers
    pull = op is Op.PULL
    src_r = dst_r = None
    if draw(st.booleans()):
        first = draw(st.integers(0, layers - 1))
        src_r = range(first, draw(st.integers(first + 1, layers)))
        dst_r = range(src_r.start, src_r.stop)
    unit = draw(st.sampled_from([64, 100, 256]))
    fields: dict[str, object] = {}
    dbb = None
    if shape is Shape.SLOT:
        ours = _cache(tensors, 3, draw(st.sampled_from([256, 300])), False, 1 << 30)
        theirs = _cache(tensors, 3, draw(st.sampled_from([256, 300, 512])), False, 1 << 40)
        size = draw(st.sampled_from([-1, 1, 100, 256]))
        fields = {
            "size": size, "src_offset": draw(st.sampled_from([0, 7])),
            "dst_offset": draw(st.sampled_from([0, 9])),
        }  # fmt: skip
        exact = pull or size >= 0
    elif shape is Shape.BLOCKS:
        count = 6
        if pull and draw(st.booleans()):  # the peer's blocks smaller than the spacing of ours
            dbb = unit
            theirs = _cache(tensors, count, draw(st.integers(1, unit)), True, 1 << 40)
        else:
            theirs = _cache(tensors, count, unit, True, 1 << 40)
        ours = _cache(tensors, count, unit, True, 1 << 30)
        n = draw(st.integers(1, count))
        ours_b = np.array(draw(st.lists(st.integers(0, count - 1), min_size=n, max_size=n)))
        theirs_b = np.array(draw(st.lists(st.integers(0, count - 1), min_size=n, max_size=n)))
        src_b, dst_b = (theirs_b, ours_b) if pull else (ours_b, theirs_b)
        fields = {"src_blocks": src_b, "dst_blocks": dst_b, "dst_block_bytes": dbb}
        exact = dbb is None
    else:
        stride = draw(st.integers(1, 3 * unit))
        pieces = -(-stride // unit)
        contiguous = _cache(tensors, 2, stride, False, 1 << 30)
        blocky = _cache(tensors, 4, unit, True, 1 << 40)
        ours, theirs = (blocky, contiguous) if pull else (contiguous, blocky)
        dst_b = np.array(draw(st.permutations(range(4))))[:pieces]
        fields = {"dst_blocks": dst_b}
        exact = not pull
    spec = TransferRequest(
        op, Address(By.CACHE_ID, 7), shape, ours, src_range=src_r, dst_range=dst_r,
        tensor_num_per_layer=tnpl, **fields,  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        plan, _, _ = plan_selection(
            op, shape, ours.layout, theirs.layout, 0, local_slot=0, src_range=src_r,
            dst_range=dst_r, tnpl=tnpl, size=spec.size, src_offset=spec.src_offset,
            dst_offset=spec.dst_offset, src_blocks=spec.src_blocks, dst_blocks=spec.dst_blocks,
            dst_block_bytes=dbb,
        )  # fmt: skip
    except LLMException:
        assume(False)
    return spec, (plan.dst if pull else plan.src), plan.nbytes, exact


@settings(max_examples=300, deadline=None)
@given(honest())
def test_an_honest_grant_passes_and_one_byte_short_is_refused(case) -> None:  # type: ignore[no-untyped-def]
    spec, local, nbytes, exact = case
    assert grant_fault(spec, local, nbytes) is None
    _refuses_the_first_range_moved_out_of_the_selection(spec, local, nbytes, exact)
    short = nbytes.copy()
    short[-1] -= np.uint64(1)
    if exact:  # our side alone fixes the size: one byte less is refused
        assert grant_covers_selection(spec, local, short) is not None
    if len(nbytes) > 1:  # a range left out
        kept = grant_fault(spec, local[:-1], nbytes[:-1])
        if exact:
            assert kept is not None and "GRANT moves" in kept
        # The first range twice instead of the last (as long): as many bytes, one range never
        # written (where no block of ours is asked for twice: then the target writes it twice).
        ours = spec.dst_blocks if spec.op is Op.PULL else spec.src_blocks
        repeats = ours is not None and spec.shape is not Shape.SLOT and len(set(ours)) < len(ours)
        if nbytes[0] == nbytes[-1] and local[0] != local[-1] and not repeats:
            twice = np.concatenate((local[:-1], local[:1]))
            assert (
                grant_fault(spec, twice, nbytes) == "GRANT names ranges of our cache more than once"
            )


def _refuses_the_first_range_moved_out_of_the_selection(
    spec: TransferRequest, local: np.ndarray, nbytes: np.ndarray, exact: bool
) -> None:
    """The same bytes at the same place of a tensor outside the request's layer window, and a
    slot's range a byte before its offset or (where our side fixes the size) past its end:
    every one refused, on the few-range path and the vectorised one."""
    e, pull = spec.local, spec.op is Op.PULL
    addrs = [int(a) for a in e.addrs]
    t = max(i for i, a in enumerate(addrs) if a <= int(local[0]))
    window = spec.dst_range if pull else spec.src_range
    moved: list[np.ndarray] = []
    if window is not None:
        outside = [u for u in range(e.num_tensors) if u // spec.tensor_num_per_layer not in window]
        moved += [_first_at(local, int(local[0]) - addrs[t] + addrs[u]) for u in outside[:1]]
    if spec.shape is Shape.SLOT:
        if (spec.dst_offset if pull else spec.src_offset) > 0:
            moved.append(_first_at(local, int(local[0]) - 1))
        if exact:
            moved.append(_first_at(local, int(local[0]) + 1))
    for bad in moved:
        assert not grant_within_selection(spec, bad, nbytes)
        assert not grant_within_selection(spec, np.tile(bad, 40), np.tile(nbytes, 40))


def _first_at(local: np.ndarray, addr: int) -> np.ndarray:
    out = local.copy()
    out[0] = addr
    return out


@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
def test_a_range_granted_twice_is_refused_unless_the_block_was_asked_twice(many: bool) -> None:
    e = _entry(2)
    a = [int(x) for x in e.addrs]
    reps = 40 if many else 1  # (past the few-descriptor cut: the vectorised union)

    def fault(blocks: list[int], local: list[int]) -> str | None:
        spec = TransferRequest(
            "pull", Address(By.CACHE_ID), "blocks", e,
            dst_blocks=np.array(blocks * reps, dtype=np.int64),
        )  # fmt: skip
        n = np.full(len(local) * reps, BLOCK, dtype=np.uint64)
        return grant_fault(spec, np.array(local * reps, dtype=np.uint64), n)

    # Blocks 1 and 2 of tensor 0 asked for, block 1 granted twice.
    b1, b2 = a[0] + BLOCK, a[0] + 2 * BLOCK
    assert fault([1, 2], [b1, b2, a[1] + BLOCK, a[1] + 2 * BLOCK]) is None
    twice = fault([1, 2], [b1, b1, a[1] + BLOCK, a[1] + 2 * BLOCK])
    assert twice == "GRANT names ranges of our cache more than once"
    # Block 1 asked for twice: written twice, as the target plans it.
    assert fault([1, 1], [b1, b1, a[1] + BLOCK, a[1] + BLOCK]) is None
    if not many:  # (repeated past the cut, every block is asked for many times)
        assert fault([1, 1, 2], [b1, b1, b1, a[1] + BLOCK] * 1 + [a[1] + BLOCK] * 2) is not None


def test_a_grant_of_one_block_for_two_is_refused() -> None:
    e = _entry(2)
    spec = TransferRequest(
        "pull", Address(By.CACHE_ID), "blocks", e, dst_blocks=np.array([1, 2], dtype=np.int64)
    )
    a = [int(x) for x in e.addrs]
    full = np.array([a[0] + BLOCK, a[1] + BLOCK], dtype=np.uint64)
    assert grant_fault(spec, full, np.array([2 * BLOCK] * 2, dtype=np.uint64)) is None
    # Both tensors' block 1 only: inside the selection, half of its bytes.
    fault = grant_fault(spec, full, np.array([BLOCK] * 2, dtype=np.uint64))
    assert (
        fault == f"GRANT moves {2 * BLOCK} bytes, but the request selected {4 * BLOCK} of our cache"
    )
