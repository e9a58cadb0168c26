"""The CacheManager's local half: registry, pools, keys, deferred frees and local copies."""

from __future__ import annotations

import gc
import threading

import anyio
import numpy as np
import pytest
from helpers import cm_options, pool_json

import llmdd_async as dd
from llmdd_async._devices import _host
from llmdd_async.testing import populated

pytestmark = pytest.mark.anyio

PARAM = dd.LLMStatusCode.LLM_PARAM_INVALID


def desc(n=4, shape=(2, 256), dtype=dd.DataType.DT_FLOAT, placement=dd.Placement.DEVICE):
    return dd.CacheDesc(n, list(shape), dtype, placement)


def big_desc(n=4):
    """Big enough (1 MiB per tensor) that copies go to worker threads, not inline."""
    return desc(n, (2, 1 << 17))


def code_of(excinfo: pytest.ExceptionInfo) -> dd.LLMStatusCode:
    return excinfo.value.status_code


async def test_cache_ids_start_at_one_and_are_shared(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    a = cm.allocate_cache(desc())
    b = cm.register_cache(desc(2), [np.zeros(2048, np.uint8), np.zeros(2048, np.uint8)])
    c = cm.allocate_blocks_cache(desc())
    assert [a.cache_id, b.cache_id, c.cache_id] == [1, 2, 3]
    assert not a.is_blocks_cache and c.is_blocks_cache
    assert b.is_registered and not a.is_registered


async def test_ids_restart_in_a_new_engine_and_do_not_leak_between_endpoints() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(cm_options()) as one:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(cm_options()) as two:
            assert one.cache_manager.allocate_cache(desc()).cache_id == 1
            assert two.cache_manager.allocate_cache(desc()).cache_id == 1
            assert one.cache_manager.allocate_cache(desc()).cache_id == 2


async def test_views_read_and_write_cache_memory(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    cache = cm.allocate_cache(desc(2, (3, 5), dd.DataType.DT_INT32))
    t = cache.tensors
    assert t[0].shape == (3, 5) and t[0].dtype == np.int32
    t[1][2, 4] = 42
    assert cache.tensors[1][2, 4] == 42
    assert cache.tensors[0].sum() == 0


async def test_registered_objects_stay_alive(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    arrays = [np.full((4, 8), i, np.float32) for i in range(2)]
    cache = cm.register_blocks_cache(dd.CacheDesc(2, [4, 8], dd.DataType.DT_FLOAT), arrays)
    addr = arrays[1].ctypes.data
    del arrays
    gc.collect()
    np.zeros((1000, 1000))  # churn the allocator
    assert cache.tensor_addrs[1] == addr
    assert float(cache.tensors[1].sum()) == 32.0


async def test_register_from_raw_addresses(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    buf = np.arange(64, dtype=np.float32)
    d = dd.CacheDesc(1, [4, 16], dd.DataType.DT_FLOAT, dd.Placement.HOST)
    cache = cm.register_cache(d, [buf.ctypes.data])
    assert cache.tensor_addrs == [buf.ctypes.data]
    assert np.array_equal(cache.tensors[0].ravel(), buf)


@pytest.mark.parametrize(
    ("call", "exc", "code"),
    [
        (lambda cm, a: cm.register_cache(desc(2), []), dd.LLMException, PARAM),
        (lambda cm, a: cm.register_cache(desc(2), [a[0]]), dd.LLMException, PARAM),
        (lambda cm, a: cm.register_cache(desc(2), [a[0], 0]), dd.LLMException, PARAM),
        (lambda cm, a: cm.register_cache(desc(2), [a[0], a[0]]), dd.LLMException, PARAM),
        (
            lambda cm, a: cm.register_cache(desc(2), a, [dd.CacheKey(1, 1)] * 2),
            dd.LLMException,
            PARAM,
        ),
        (
            lambda cm, a: cm.register_cache(desc(2), a, [dd.CacheKey(1, i) for i in range(3)]),
            dd.LLMException,
            PARAM,
        ),
        (lambda cm, a: cm.register_cache(desc(2), a, remote_accessible=1), TypeError, None),
        (lambda cm, a: cm.register_cache("desc", a), TypeError, None),
        (lambda cm, a: cm.register_cache(desc(2), a, [1]), TypeError, None),
        (lambda cm, a: cm.register_cache(desc(2, (0, 4)), a), dd.LLMException, PARAM),
        (lambda cm, a: cm.register_cache(desc(2, [1] * 33), a), dd.LLMException, PARAM),
        (
            lambda cm, a: cm.register_cache(desc(2, dtype=dd.DataType.DT_STRING), a),
            dd.LLMException,
            PARAM,
        ),
        (lambda cm, a: cm.register_blocks_cache(desc(2), a, dd.CacheKey(1, 1)), TypeError, None),
        (lambda cm, a: cm.unregister_cache("1"), TypeError, None),
        (
            lambda cm, a: cm.allocate_cache(desc(), [dd.CacheKey(1, 1), dd.CacheKey(1, 1)]),
            dd.LLMException,
            PARAM,
        ),
        (
            lambda cm, a: cm.allocate_cache(desc(), [dd.CacheKey(1, i) for i in range(3)]),
            dd.LLMException,
            PARAM,
        ),
        (
            lambda cm, a: cm.allocate_cache(desc(shape=(1 << 30, 1))),
            dd.LLMException,
            dd.LLMStatusCode.LLM_OUT_OF_MEMORY,
        ),
        (
            lambda cm, a: cm.deallocate_cache(cm.allocate_blocks_cache(desc())),
            dd.LLMException,
            PARAM,
        ),
        (
            lambda cm, a: cm.deallocate_blocks_cache(cm.allocate_cache(desc())),
            dd.LLMException,
            PARAM,
        ),
        (lambda cm, a: cm.remove_cache_key(dd.BlocksCacheKey(1)), TypeError, None),
        (
            lambda cm, a: cm.remap_registered_memory(dd.MemInfo(dd.Memtype.MEM_TYPE_HOST, 1, 1)),
            dd.LLMException,
            PARAM,
        ),
    ],
)
async def test_local_bookkeeping_rules(datadist, call, exc, code) -> None:
    cm = datadist.cache_manager
    arrays = [np.zeros(2048, np.uint8), np.zeros(2048, np.uint8)]
    before = sorted(cm.engine.registry.entries)
    with pytest.raises(exc) as err:
        call(cm, arrays)
    if code is not None:
        assert code_of(err) == code
    # A failed call leaves nothing behind (the deallocate rows create their cache first).
    leftover = [i for i in cm.engine.registry.entries if i not in before]
    assert len(leftover) <= 1


async def test_a_key_bound_elsewhere_is_rejected(datadist: dd.LLMDataDist) -> None:
    cm = datadist.cache_manager
    cm.allocate_cache(desc(), [dd.CacheKey(1, 7)])
    with pytest.raises(dd.LLMException) as err:
        cm.allocate_cache(desc(), [dd.CacheKey(1, 7)])
    assert code_of(err) == PARAM


async def test_pool_presence_rules() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running({"llm.EnableCacheManager": "1"}) as d:
        with pytest.raises(dd.LLMException) as err:
            d.cache_manager.allocate_cache(desc())
        assert code_of(err) == dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        {"llm.EnableCacheManager": "1", "llm.HostMemPoolConfig": pool_json(1 << 20)}
    ) as d:
        with pytest.raises(dd.LLMException) as err:
            d.cache_manager.allocate_cache(desc())  # DEVICE placement, only a host pool
        assert code_of(err) == PARAM
        assert d.cache_manager.allocate_cache(desc(placement=dd.Placement.HOST)).cache_id == 1


async def test_memory_returns_to_the_pool_and_frees_are_deferred_by_keys() -> None:
    opts = cm_options(**{"llm.MemPoolConfig": pool_json(4 << 20)})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as d:
        cm = d.cache_manager
        pool = cm.engine.pools[dd.Placement.DEVICE]
        big = dd.CacheDesc(4, [1, 1 << 20], dd.DataType.DT_UINT8)  # exactly the whole pool
        key = dd.CacheKey(1, 5)
        cache = cm.allocate_cache(big, [key])
        with pytest.raises(dd.LLMException) as err:
            cm.allocate_cache(big)
        assert code_of(err) == dd.LLMStatusCode.LLM_OUT_OF_MEMORY
        cm.deallocate_cache(cache)
        assert not cache.valid
        assert pool.free_bytes == 0  # the bound key still holds the memory
        cm.remove_cache_key(key)
        assert pool.free_bytes == pool.nbytes
        again = cm.allocate_cache(big)  # and it can be taken again
        cm.deallocate_cache(again)
        cm.deallocate_cache(again)  # already freed: no-op
        assert pool.free_bytes == pool.nbytes
        blocks = cm.allocate_blocks_cache(dd.CacheDesc(4, [1, 1 << 20], dd.DataType.DT_UINT8))
        cm.deallocate_blocks_cache(blocks)
        assert pool.free_bytes == pool.nbytes


async def test_remove_cache_key_ignores_registered_caches_and_unknown_keys(datadist) -> None:
    cm = datadist.cache_manager
    key = dd.CacheKey(1, 3)
    cache = cm.register_cache(
        desc(2), [np.zeros(2048, np.uint8)] * 1 + [np.zeros(2048, np.uint8)], [key]
    )
    cm.remove_cache_key(key)
    cm.remove_cache_key(dd.CacheKey(1, 99))
    entry = cm.engine.registry.entries[cache.cache_id]
    assert entry.slot_keys == {0: ("req", 3, 0)}
    cm.unregister_cache(cache.cache_id)
    cm.unregister_cache(cache.cache_id)  # unknown now: no-op
    cm.unregister_cache(12345)
    assert cache.cache_id not in cm.engine.registry.entries


async def test_unregister_of_an_allocated_cache_is_refused(datadist) -> None:
    cm = datadist.cache_manager
    cache = cm.allocate_cache(desc())
    with pytest.raises(dd.LLMException) as err:
        cm.unregister_cache(cache.cache_id)
    assert code_of(err) == PARAM


async def test_remote_accessible_defaults(datadist) -> None:
    cm = datadist.cache_manager
    reg = cm.engine.registry
    dev = cm.register_cache(desc(1), [np.zeros(2048, np.uint8)])
    host = cm.register_cache(desc(1, placement=dd.Placement.HOST), [np.zeros(2048, np.uint8)])
    forced = cm.register_cache(
        desc(1, placement=dd.Placement.HOST), [np.zeros(2048, np.uint8)], remote_accessible=True
    )
    assert reg.entries[dev.cache_id].remote_accessible
    assert not reg.entries[host.cache_id].remote_accessible
    assert reg.entries[forced.cache_id].remote_accessible


async def test_register_blocks_cache_marks_the_desc(datadist) -> None:
    d = desc(1)
    datadist.cache_manager.register_blocks_cache(d, [np.zeros(2048, np.uint8)])
    assert d._is_blocks


# ------------------------------------------------------------------ local movement
def fill(cache: dd.Cache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        t[...] = rng.integers(0, 1 << 20, t.shape).astype(t.dtype)


async def test_copy_cache_is_byte_exact(datadist) -> None:
    cm = datadist.cache_manager
    src, dst = cm.allocate_cache(desc()), cm.allocate_cache(desc())
    fill(src, 1)
    before = [t.copy() for t in dst.tensors]
    task = cm.copy_cache(dst, src, dst_batch_index=1, src_batch_index=0, offset=64, size=128)
    assert isinstance(task, dd.CacheTask)
    await task
    assert task.done() and await task.synchronize() == dd.LLMStatusCode.LLM_SUCCESS
    for s, d, b in zip(src.tensors, dst.tensors, before, strict=True):
        sb, db, bb = s.view(np.uint8), d.view(np.uint8), b.view(np.uint8)
        assert np.array_equal(db[1, 64:192], sb[0, 64:192])
        assert np.array_equal(db[1, :64], bb[1, :64]) and np.array_equal(db[1, 192:], bb[1, 192:])
        assert np.array_equal(db[0], bb[0])
    stats = task.statistics()
    assert stats.bytes == 4 * 128 and stats.descriptors == 4 and stats.seconds > 0


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"dst_batch_index": 2}, PARAM),
        ({"src_batch_index": 2}, PARAM),
        ({"offset": 1024}, PARAM),
        ({"offset": 1000, "size": 100}, PARAM),
        ({"size": 0}, PARAM),
    ],
)
async def test_copy_cache_rules(datadist, kwargs, code) -> None:
    cm = datadist.cache_manager
    src, dst = cm.allocate_cache(desc()), cm.allocate_cache(desc())
    with pytest.raises(dd.LLMException) as err:
        cm.copy_cache(dst, src, **kwargs)
    assert code_of(err) == code


async def test_copy_cache_refuses_blocks_and_mismatched_caches(datadist) -> None:
    cm = datadist.cache_manager
    a, b = cm.allocate_cache(desc()), cm.allocate_blocks_cache(desc())
    c = cm.allocate_cache(desc(2))
    for dst, src in ((a, b), (b, a), (a, c)):
        with pytest.raises(dd.LLMException) as err:
            cm.copy_cache(dst, src)
        assert code_of(err) == PARAM
    with pytest.raises(ValueError):
        cm.copy_cache(a, a, dst_batch_index=-1)
    with pytest.raises(TypeError):
        cm.copy_cache(a, a, size="all")


async def test_copy_blocks_is_byte_exact(datadist) -> None:
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(desc(3, (8, 32)))
    fill(cache, 2)
    before = [t.copy() for t in cache.tensors]
    await cm.copy_blocks(cache, {0: [5, 6], 3: [7]})
    for t, b in zip(cache.tensors, before, strict=True):
        assert np.array_equal(t[5], b[0]) and np.array_equal(t[6], b[0])
        assert np.array_equal(t[7], b[3])
        assert np.array_equal(t[:5], b[:5])
    for bad in ({0: [8]}, {8: [0]}, {0: [1], 1: [2]}, {0: [1], 2: [1]}):
        with pytest.raises(dd.LLMException) as err:
            cm.copy_blocks(cache, bad)
        assert code_of(err) == PARAM
    with pytest.raises(dd.LLMException):
        cm.copy_blocks(cm.allocate_cache(desc()), {0: [1]})


async def test_swap_blocks_both_ways(datadist) -> None:
    cm = datadist.cache_manager
    device = cm.allocate_blocks_cache(desc(2, (6, 64)))
    fill(device, 3)
    host_arrays = [np.zeros((6, 64), np.float32) for _ in range(2)]
    cpu = dd.Cache.create_cpu_cache(
        dd.CacheDesc(2, [6, 64], dd.DataType.DT_FLOAT, dd.Placement.HOST),
        [a.ctypes.data for a in host_arrays],
    )
    await cm.swap_blocks(device, cpu, {0: 1, 4: 5})  # swap-out
    for t, h in zip(device.tensors, host_arrays, strict=True):
        assert np.array_equal(h[1], t[0]) and np.array_equal(h[5], t[4]) and not h[0].any()
    host_arrays[0][2] = 9.0
    await cm.swap_blocks(cpu, device, {2: 3})  # swap-in
    assert np.all(device.tensors[0][3] == 9.0)
    other = cm.allocate_blocks_cache(desc(2, (6, 64)))
    with pytest.raises(dd.LLMException) as err:
        cm.swap_blocks(device, other, {0: 0})  # DEVICE -> DEVICE
    assert code_of(err) == PARAM
    with pytest.raises(dd.LLMException):
        cm.swap_blocks(device, cpu, {6: 0})


async def test_copies_run_off_the_event_loop(datadist, monkeypatch) -> None:
    """The copy waits for an event that only the event loop sets: on the loop it would hang."""
    cm = datadist.cache_manager
    src, dst = cm.allocate_cache(big_desc()), cm.allocate_cache(big_desc())
    started, release = threading.Event(), threading.Event()
    real = _host.copy_ranges

    def gated(*args):
        started.set()
        assert release.wait(30), "the loop never got to run while the copy was in flight"
        return real(*args)

    monkeypatch.setattr(_host, "copy_ranges", gated)
    task = cm.copy_cache(dst, src)
    while not started.is_set():
        await anyio.sleep(0.001)
    release.set()  # runs on the loop while the worker thread waits
    await task


async def test_cancel_fences_the_worker(datadist, monkeypatch) -> None:
    cm = datadist.cache_manager
    src, dst = cm.allocate_cache(big_desc()), cm.allocate_cache(big_desc())
    started, exited = threading.Event(), threading.Event()

    def slow(src_a, dst_a, n, token):
        started.set()
        while not token.cancelled:
            threading.Event().wait(0.001)
        exited.set()
        raise _host_cancelled()

    from llmdd_async._errors import CopyCancelled as _host_cancelled

    monkeypatch.setattr(_host, "copy_ranges", slow)
    task = cm.copy_cache(dst, src)
    while not started.is_set():
        await anyio.sleep(0.001)
    assert not task.done()
    task.cancel()
    with pytest.raises(dd.TransferCancelled):
        await task
    assert exited.is_set()  # the worker had stopped before the await returned
    assert task.done() and await task.synchronize() == dd.LLMStatusCode.LLM_FAILED


async def test_cancelling_the_awaiting_scope_cancels_and_fences(datadist, monkeypatch) -> None:
    cm = datadist.cache_manager
    src, dst = cm.allocate_cache(big_desc()), cm.allocate_cache(big_desc())
    exited = threading.Event()

    def slow(src_a, dst_a, n, token):
        while not token.cancelled:
            threading.Event().wait(0.001)
        exited.set()
        from llmdd_async._errors import CopyCancelled

        raise CopyCancelled

    monkeypatch.setattr(_host, "copy_ranges", slow)
    task = cm.copy_cache(dst, src)
    with anyio.move_on_after(0.05) as scope:
        await task
    assert scope.cancelled_caught
    assert exited.is_set() and task.done()
    assert await task.get_results() == [dd.LLMStatusCode.LLM_FAILED]


async def test_synchronize_timeout_does_not_cancel(datadist, monkeypatch) -> None:
    cm = datadist.cache_manager
    src, dst = cm.allocate_cache(big_desc()), cm.allocate_cache(big_desc())
    release = threading.Event()
    real = _host.copy_ranges

    def gated(*args):
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(_host, "copy_ranges", gated)
    task = cm.copy_cache(dst, src)
    assert await task.synchronize(10) == dd.LLMStatusCode.LLM_TIMEOUT
    assert await task.get_results(10) == [dd.LLMStatusCode.LLM_TIMEOUT]
    assert not task.done()
    release.set()
    assert await task.synchronize() == dd.LLMStatusCode.LLM_SUCCESS
    assert await task.get_results() == [dd.LLMStatusCode.LLM_SUCCESS]
    with pytest.raises(ValueError):
        await task.synchronize(-1)


async def test_deallocate_during_a_copy_defers_the_free(datadist, monkeypatch) -> None:
    cm = datadist.cache_manager
    pool = cm.engine.pools[dd.Placement.DEVICE]
    src, dst = cm.allocate_blocks_cache(big_desc()), cm.allocate_blocks_cache(big_desc())
    release = threading.Event()
    real = _host.copy_ranges

    def gated(*args):
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(_host, "copy_ranges", gated)
    free_before = pool.free_bytes
    task = cm.copy_blocks(src, {0: [1]})
    cm.deallocate_blocks_cache(src)
    assert pool.free_bytes == free_before  # pinned by the running copy
    release.set()
    await task
    assert pool.free_bytes > free_before
    cm.deallocate_blocks_cache(dst)


async def test_calls_after_the_engine_stopped_raise_runtime_error() -> None:
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = d.cache_manager
    async with d.running(cm_options()):
        cm = d.cache_manager
    with pytest.raises(RuntimeError, match="not initialized"):
        cm.allocate_cache(desc())
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = d.cache_manager


async def test_calls_from_another_thread_are_refused(datadist) -> None:
    cm = datadist.cache_manager
    with pytest.raises(RuntimeError, match="event loop thread"):
        await anyio.to_thread.run_sync(cm.allocate_cache, desc())


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


@pytest.mark.anyio
async def test_registration_faults_pages_in_off_the_loop_without_changing_them(
    datadist: dd.LLMDataDist,
) -> None:
    """As an RDMA engine pins at registration: the first transfer into fresh memory must not
    pay its page faults. The pages come in from a worker thread; no byte changes."""
    import mmap

    size = 32 << 20
    fresh = [np.frombuffer(mmap.mmap(-1, size), np.uint8) for _ in range(2)]  # untouched
    filled = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)
    filled[:] = np.arange(1 << 20) % 251
    before = _rss()
    cm = datadist.cache_manager
    c = cm.register_cache(dd.CacheDesc(2, [1, size], dd.DataType.DT_UINT8), fresh)
    k = cm.register_cache(dd.CacheDesc(1, [1, 1 << 20], dd.DataType.DT_UINT8), [filled])
    await populated(datadist, c.cache_id)
    await populated(datadist, k.cache_id)
    assert _rss() - before >= size  # at least one of the two arrays' pages are resident...
    assert (filled == np.arange(1 << 20) % 251).all()  # ...and nothing was overwritten
    assert not fresh[0].any() and not fresh[1].any()
