"""Host memory: the shareable pool allocator, memory objects, views and the copy loop."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmdd_async as dd
from llmdd_async._errors import CopyCancelled
from llmdd_async._memory import (
    CancelToken,
    MemoryPool,
    PoolConfig,
    copy_inline,
    copy_lists,
    copy_ranges,
    host_view,
    memory_view,
    resolve_host_memory,
)
from llmdd_async._transports.tcp import StreamPlan


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 5 * 4096)), max_size=40))
def test_pool_allocations_never_overlap_and_all_memory_returns(ops) -> None:
    pool = MemoryPool(PoolConfig(64 * 4096, 12), "test")
    try:
        live = []
        for is_alloc, size in ops:
            if is_alloc or not live:
                try:
                    a = pool.allocate(size)
                except dd.LLMException as exc:
                    assert exc.status_code == dd.LLMStatusCode.LLM_OUT_OF_MEMORY
                    continue
                assert a.nbytes >= size and a.nbytes % 4096 == 0
                assert a.addr == pool.base + a.offset
                for b in live:
                    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
                live.append(a)
            else:
                pool.free(live.pop(size % len(live)))
        for a in live:
            pool.free(a)
        assert pool.free_bytes == pool.nbytes
        whole = pool.allocate(pool.nbytes)  # everything merged back into one run
        assert whole.offset == 0
    finally:
        pool.close()


def test_pool_exhaustion_is_out_of_memory() -> None:
    pool = MemoryPool(PoolConfig(1 << 20, 16), "test")
    pool.allocate(1 << 20)
    with pytest.raises(dd.LLMException) as err:
        pool.allocate(1)
    assert err.value.status_code == dd.LLMStatusCode.LLM_OUT_OF_MEMORY
    pool.close()


def test_pool_pages_are_visible_to_another_process() -> None:
    """The property same-host transfers rely on: a peer maps the same pages by /proc path."""
    pool = MemoryPool(PoolConfig(1 << 20, 16), "test")
    a = pool.allocate(4096)
    pool.view(a, 0, 5)[:] = np.frombuffer(b"hello", np.uint8)
    code = textwrap.dedent(
        f"""
        import mmap, os
        fd = os.open("/proc/{os.getpid()}/fd/{pool.fd}", os.O_RDWR)
        m = mmap.mmap(fd, {pool.nbytes})
        assert m[{a.offset}:{a.offset + 5}] == b"hello", m[{a.offset}:{a.offset + 5}]
        m[{a.offset + 5}:{a.offset + 6}] = b"!"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert bytes(pool.view(a, 0, 6)) == b"hello!"
    pool.close()


def test_pool_close_with_live_views_keeps_them_valid() -> None:
    pool = MemoryPool(PoolConfig(1 << 20, 16), "test")
    view = pool.view(pool.allocate(100), 0, 100)
    view[:] = 7
    pool.close()
    assert int(view.sum()) == 700


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(64, np.uint8),
        lambda: bytearray(64),
        lambda: mmap.mmap(-1, 64),
        lambda: memoryview(bytearray(64)),
    ],
    ids=["numpy", "bytearray", "mmap", "memoryview"],
)
def test_resolve_objects_keeps_them_alive(make) -> None:
    obj = make()
    addr, keep = resolve_host_memory(obj, 64, "addrs[0]")
    assert keep is not None and keep[0] is obj
    host_view(addr, 64)[:] = 9
    assert bytes(memoryview(obj)[:64]) == b"\x09" * 64


@pytest.mark.parametrize(
    ("obj", "nbytes", "exc"),
    [
        (0, 8, dd.LLMException),
        (np.zeros(4, np.uint8), 8, dd.LLMException),  # too small
        (np.zeros((4, 4), np.uint8)[:, 0], 4, dd.LLMException),  # not contiguous
        (np.zeros(8, np.uint8).copy().view(), 8, None),
        (bytes(8), 8, dd.LLMException),  # read-only
        ("text", 8, TypeError),
        (3.5, 8, TypeError),
    ],
)
def test_resolve_rejects_bad_memory(obj, nbytes, exc) -> None:
    if exc is None:
        assert resolve_host_memory(obj, nbytes, "x")[0] == obj.ctypes.data
        return
    with pytest.raises(exc) as err:
        resolve_host_memory(obj, nbytes, "x")
    if exc is dd.LLMException:
        assert err.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID


def test_copy_ranges_copies_in_order_and_stops_when_cancelled() -> None:
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, np.uint8)
    s0, d0 = src.ctypes.data, dst.ctypes.data
    descs = np.array([[s0 + i * 2, d0 + 255 - i, 1] for i in range(100)], dtype=np.uint64)
    n = copy_ranges(descs[:, 0], descs[:, 1], descs[:, 2])
    assert n == 100
    assert dst[255 - 99 :].tolist() == [src[(255 - j) * 2] for j in range(255 - 99, 256)]
    token = CancelToken()
    token.cancel()
    dst[:] = 0
    with pytest.raises(CopyCancelled):
        copy_ranges(descs[:, 0], descs[:, 1], descs[:, 2], token)
    assert not dst.any()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 240), st.integers(0, 240), st.integers(0, 16)), max_size=40)
)
def test_an_inline_copy_moves_what_memmove_would(descs: list[tuple[int, int, int]]) -> None:
    """Slices of views over the spans (many ranges) or a memmove each (a few): the same bytes
    in the end, whatever the ranges (overlapping, empty, out of order, in one buffer)."""
    for same in (False, True):
        bufs = [np.arange(256, dtype=np.uint8) for _ in range(4)]
        srcs = [bufs[0], bufs[2]]
        dsts = [bufs[0], bufs[2]] if same else [bufs[1], bufs[3]]
        lists = []
        for sbuf, dbuf in zip(srcs, dsts, strict=True):
            s0, d0 = sbuf.ctypes.data, dbuf.ctypes.data
            lists.append(([s0 + a for a, _, _ in descs], [d0 + b for _, b, _ in descs]))
        nbytes = [n for _, _, n in descs]
        assert copy_inline(*lists[0], nbytes) == sum(nbytes)
        assert copy_lists(*lists[1], nbytes) == sum(nbytes)
        assert dsts[0].tolist() == dsts[1].tolist()


def test_a_cancelled_inline_copy_copies_nothing() -> None:
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
    token = CancelToken()
    token.cancel()
    for ranges in (2, 20):  # (a memmove each, slices)
        with pytest.raises(CopyCancelled):
            copy_inline(
                [src.ctypes.data + 4 * i for i in range(ranges)],
                [dst.ctypes.data + 4 * i for i in range(ranges)],
                [4] * ranges,
                token,
            )
    assert not dst.any()


@pytest.mark.anyio
async def test_a_copy_cut_across_threads_fails_with_one_exception() -> None:
    """Parts of one copy run on several threads; their failure is one exception that says
    what happened (a cancel wins), never an ExceptionGroup that status mapping cannot read."""
    from llmdd_async._memory import run_parts

    def ok() -> int:
        return 5

    def cancelled() -> int:
        raise CopyCancelled

    def fault() -> int:
        raise OSError(14, "Bad address")

    assert await run_parts([ok, ok, ok], None) == 15
    with pytest.raises(CopyCancelled):
        await run_parts([fault, cancelled, ok], None)
    with pytest.raises(OSError, match="Bad address"):
        await run_parts([ok, fault, fault], None)


_ARRAY_TYPE = type(ctypes.c_ubyte * 1)


def _ctypes_array_types() -> int:
    return sum(isinstance(o, _ARRAY_TYPE) for o in gc.get_objects())


def test_views_of_raw_memory_read_and_write_its_bytes_and_make_no_type_per_size() -> None:
    # A ctypes array type per size cost 16 us on each side of a request of shuffled blocks
    # (every span a new size), and left the types for the collector.
    buf = np.zeros(1 << 18, np.uint8)
    base = buf.ctypes.data
    gc.collect()
    gc.disable()
    try:
        before = _ctypes_array_types()
        for n in range(1, 200):
            view = memory_view(base + n, n)
            assert view.nbytes == n and not view.readonly and view.format == "B"
            view[-1] = n
            assert buf[2 * n - 1] == n
            host_view(base, 300 + n)[0] = n
            plan = StreamPlan(
                np.array([base + 1000 * n, base + 7, base + 600 + n], np.uint64),
                np.array([8, 16, n], np.uint64),
            )
            views = plan.views(0, plan.total)
            assert [v.nbytes for v in views] == [8, 16, n]
            views[0][:] = b"\x01" * 8
        assert _ctypes_array_types() == before
    finally:
        gc.enable()
    assert buf[0] == 199 and bytes(buf[199000:199008]) == b"\x01" * 8
    assert memory_view(base, 0).nbytes == 0
    with pytest.raises(ValueError, match="-1 bytes"):
        memory_view(base, -1)
