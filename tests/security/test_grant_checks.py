"""The initiator's check of a grant against what it asked for: the few-descriptor path (plain
Python, on the hot path) and the vectorised path agree on every input."""

from __future__ import annotations

import numpy as np
from helpers import blocks_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdd_async._messages import Address, By
from llmdd_async._net.grant_checks import grant_within_selection
from llmdd_async._net.grants import TransferRequest
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
