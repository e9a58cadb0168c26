"""A layer-wise push is one request: the initiator sends each layer's ranges of the grant once
that layer is ready, so it must find them (:func:`layer_spans`) and refuse a grant that is not
in layer order (it would send a layer before it is computed)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import blocks_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdd_async._messages import Address, By, Op, Shape
from llmdd_async._net.grant_checks import layer_spans
from llmdd_async._net.grants import TransferRequest, plan_selection
from llmdd_async._planner import Layout
from llmdd_async._registry import CacheEntry

_U64 = np.uint64


def _entry(addrs: list[int], blocks: int, block_bytes: int) -> CacheEntry:
    return blocks_entry(addrs, blocks, block_bytes)


def _layer_push(
    e: CacheEntry,
    layers: range,
    tnpl: int,
    src_blocks: np.ndarray | None = None,
    dst_blocks: np.ndarray | None = None,
) -> TransferRequest:
    """A layer-wise push of ``layers`` of ``e`` to the same layers of the peer's cache 7."""
    return TransferRequest(
        Op.PUSH,
        Address(By.CACHE_ID, 7),
        Shape.BLOCKS,
        e,
        src_range=layers,
        dst_range=layers,
        tensor_num_per_layer=tnpl,
        src_blocks=src_blocks,
        dst_blocks=dst_blocks,
    )


@st.composite
def _pushes(draw: st.DrawFn) -> tuple[TransferRequest, np.ndarray, np.ndarray]:
    """An honest grant of a layer-wise push: the target's plan of the request."""
    tnpl = draw(st.integers(1, 3))
    layers = draw(st.integers(1, 6))
    blocks = draw(st.integers(1, 8))
    block = draw(st.sampled_from([64, 256, 4096]))
    tensors = tnpl * layers
    size = blocks * block
    if draw(st.booleans()):  # a pool: tensors back to back, in a shuffled order
        slots = draw(st.permutations(range(tensors)))
        addrs = [(1 << 30) + s * size for s in slots]
    else:  # user arrays, apart, in a shuffled order
        gaps = draw(st.lists(st.integers(1, 9), min_size=tensors, max_size=tensors))
        ends = np.cumsum([size + 4096 * g for g in gaps]).tolist()
        addrs = [(1 << 32) + ends[s] for s in draw(st.permutations(range(tensors)))]
    e = _entry(addrs, blocks, block)
    first = draw(st.integers(0, layers - 1))
    run = range(first, draw(st.integers(first + 1, layers)))
    picked = draw(st.lists(st.integers(0, blocks - 1), min_size=1, max_size=blocks, unique=True))
    src_b = np.array(picked, dtype=np.int64)
    dst_b = np.array(draw(st.permutations(range(len(picked)))), dtype=np.int64)
    tgt = Layout.of([(1 << 40) + i * size for i in range(tensors)], size, blocks, True)
    spec = _layer_push(e, run, tnpl, src_blocks=src_b, dst_blocks=dst_b)
    plan, _, _ = plan_selection(
        Op.PUSH,
        Shape.BLOCKS,
        e.layout,
        tgt,
        0,
        local_slot=0,
        src_range=run,
        dst_range=run,
        tnpl=tnpl,
        size=-1,
        src_offset=0,
        dst_offset=0,
        src_blocks=src_b,
        dst_blocks=dst_b,
        dst_block_bytes=None,
    )
    return spec, plan.src, plan.nbytes


def _layer_of(spec: TransferRequest, addr: int) -> int:
    e = spec.local
    for t, a in enumerate(e.addrs.tolist()):
        if a <= addr < a + e.tensor_bytes:
            return t // spec.tensor_num_per_layer
    raise AssertionError("outside every tensor")


@settings(max_examples=150, deadline=None)
@given(_pushes())
def test_an_honest_grant_splits_into_its_layers(push) -> None:
    spec, local, nbytes = push
    spans = layer_spans(spec, local, nbytes)
    assert spans is not None
    run = spec.src_range
    assert run is not None
    assert len(spans) == len(run) + 1 and spans[0] == 0 and spans[-1] == len(nbytes)
    per = int(nbytes.sum()) // len(run)
    for j, layer in enumerate(run):
        a, b = spans[j], spans[j + 1]
        assert int(nbytes[a:b].sum()) == per
        assert {_layer_of(spec, int(x)) for x in local[a:b]} == {layer}


@settings(max_examples=150, deadline=None)
@given(_pushes(), st.data())
def test_a_grant_out_of_layer_order_is_refused(push, data) -> None:
    spec, local, nbytes = push
    run = spec.src_range
    assert run is not None
    spans = layer_spans(spec, local, nbytes)
    assert spans is not None
    if len(run) < 2:
        return
    # Two layers' ranges swapped: each range is still inside the selection.
    j = data.draw(st.integers(0, len(run) - 2))
    a, b, c = spans[j], spans[j + 1], spans[j + 2]
    order = np.r_[0:a, b:c, a:b, c : len(nbytes)]
    assert layer_spans(spec, local[order], nbytes[order]) is None


def test_a_grant_whose_layers_differ_in_size_or_cross_a_tensor_is_refused() -> None:
    e = _entry([1 << 30, (1 << 30) + 1024, (1 << 30) + 2048, (1 << 30) + 3072], 4, 256)
    spec = _layer_push(e, range(0, 2), 2)
    base = 1 << 30
    whole = np.array([base, base + 1024, base + 2048, base + 3072], dtype=_U64)
    assert layer_spans(spec, whole, np.full(4, 1024, dtype=_U64)) == [0, 2, 4]
    # one range over two tensors (pool tensors touch): not inside one tensor
    assert layer_spans(spec, whole[[0, 2]], np.full(2, 2048, dtype=_U64)) is None
    # layer 0 sends less than layer 1
    uneven = np.array([512, 1024, 1024, 1024], dtype=_U64)
    assert layer_spans(spec, whole, uneven) is None
    # a range of layer 1 where layer 0's bytes are due
    assert layer_spans(spec, whole[[0, 2, 1, 3]], np.full(4, 1024, dtype=_U64)) is None


@pytest.mark.parametrize("bad", ["no range", "zero bytes"])
def test_a_grant_without_layers_is_refused(bad: str) -> None:
    e = _entry([1 << 30, (1 << 30) + 1024], 4, 256)
    spec = TransferRequest(
        Op.PUSH,
        Address(By.CACHE_ID, 7),
        Shape.BLOCKS,
        e,
        src_range=None if bad == "no range" else range(0, 1),
        tensor_num_per_layer=2,
    )
    local = np.array([1 << 30, (1 << 30) + 1024], dtype=_U64)
    nbytes = np.array([1024, 0 if bad == "zero bytes" else 1024], dtype=_U64)
    assert layer_spans(spec, local, nbytes) is None


@settings(max_examples=200, deadline=None)
@given(_pushes(), st.data())
def test_few_ranges_are_split_in_python_as_numpy_splits_them(push, data) -> None:
    """A grant of a few ranges is split in Python ints, a larger one with numpy: on honest
    grants and on grants a hostile peer bent (ranges moved, resized, swapped) both agree."""
    from llmdd_async._net import grant_checks

    spec, local, nbytes = push
    local, nbytes = local.copy(), nbytes.copy()
    if len(local) and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(local) - 1))
        how = data.draw(st.sampled_from(["move", "resize", "swap"]))
        if how == "move":
            local[i] = _U64(int(local[i]) + data.draw(st.sampled_from([-4096, -1, 1, 64, 1 << 20])))
        elif how == "resize":
            nbytes[i] = _U64(data.draw(st.sampled_from([0, 1, int(nbytes[i]) + 64])))
        else:
            j = data.draw(st.integers(0, len(local) - 1))
            local[[i, j]], nbytes[[i, j]] = local[[j, i]], nbytes[[j, i]]
    run, tnpl = spec.src_range, spec.tensor_num_per_layer
    assert run is not None
    small = grant_checks._layer_spans_small(spec.local, run, tnpl, local.tolist(), nbytes.tolist())
    assert small == grant_checks._layer_spans_numpy(spec.local, run, tnpl, local, nbytes)


@pytest.mark.parametrize("ranges", [8, 40])
def test_a_range_far_past_its_tensor_is_refused_not_wrapped(ranges: int) -> None:
    """An address 2**63 bytes past a tensor's start: an offset taken as int64 wraps negative
    and would pass the bound check (the numpy path, for more than 32 ranges, did); both
    paths refuse it, as the selection check does."""
    from llmdd_async._net import grant_checks
    from llmdd_async._planner import check_within

    base, size = 1 << 20, 64 * ranges
    e = _entry([base], ranges, 64)
    spec = _layer_push(e, range(0, 1), 1)
    local = np.array([base + 64 * i for i in range(ranges)], dtype=_U64)
    nbytes = np.full(ranges, 64, dtype=_U64)
    assert layer_spans(spec, local, nbytes) == [0, ranges]
    local[5] = _U64(base + (1 << 63) + 320)
    assert not check_within(local, nbytes, *e.regions)
    assert layer_spans(spec, local, nbytes) is None
    assert grant_checks._layer_spans_numpy(e, range(0, 1), 1, local, nbytes) is None
    nbytes[5] = _U64(size + 64)  # longer than the tensor
    local[5] = _U64(base)
    assert grant_checks._layer_spans_numpy(e, range(0, 1), 1, local, nbytes) is None
