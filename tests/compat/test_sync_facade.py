"""The blocking facade ``llmdd_async.sync``: upstream names, lifecycle rules, threads, tasks.

These tests are synchronous, like the clients of the facade. Peers run in child processes.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import (
    blocking_peer,
    cluster,
    endpoint_options,
    expected_tensor,
    library_logs_enabled,
)

import llmdd_async.sync as s
from llmdd_async.testing import encode_key

UPSTREAM_NAMES = [
    "LLMDataDist",
    "LLMConfig",
    "LlmConfig",
    "LLMRole",
    "LLMClusterInfo",
    "LLMStatusCode",
    "LLMException",
    "Status",
    "DataType",
    "CacheDesc",
    "Cache",
    "KvCache",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "Placement",
    "RegisterMemStatus",
    "LayerSynchronizer",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "CacheTask",
    "Memtype",
    "MemInfo",
    "KvCacheManager",
    "Tensor",
    "TensorDesc",
]


@pytest.fixture
def facade_dd() -> Iterator[s.LLMDataDist]:
    d = s.LLMDataDist(s.LLMRole.DECODER, 2)
    yield d
    d.finalize()


def test_every_upstream_name_is_exported() -> None:
    for name in UPSTREAM_NAMES:
        assert hasattr(s, name), name
    assert s.LlmConfig is s.LLMConfig


def test_calls_before_init_and_after_finalize_raise_runtime_error(facade_dd) -> None:
    d = facade_dd
    calls = [
        lambda: d.link_clusters([cluster(1, ("127.0.0.1", 1))]),
        lambda: d.unlink_clusters([cluster(1)]),
        lambda: d.switch_role(s.LLMRole.PROMPT),
        lambda: d.link("c", {1: 0, 2: 1}, "{}"),
        lambda: d.unlink(1),
        lambda: d.query_register_mem_status(1),
        lambda: d.check_link_status(1),
        lambda: d.cache_manager,
        lambda: d.kv_cache_manager,
    ]
    for round_ in range(2):
        for call in calls:
            with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
                call()
        if round_ == 0:
            d.init(endpoint_options())
            d.finalize()


def test_one_initialised_instance_per_process(facade_dd) -> None:
    d = facade_dd
    d.init(endpoint_options())
    d.init(endpoint_options())  # the same object again: nothing happens
    other = s.LLMDataDist(s.LLMRole.PROMPT, 3)
    with pytest.raises(s.LLMException) as err:
        other.init(endpoint_options())
    assert err.value.status_code == s.LLMStatusCode.LLM_FAILED
    d.finalize()
    d.finalize()
    d.init(endpoint_options())  # finalize then init on the same object (Omni-Infer)
    cm = d.cache_manager
    cache = cm.allocate_cache(s.CacheDesc(1, [2, 16], s.DataType.DT_UINT8))
    assert cache.cache_id == 1
    d.finalize()
    other.init(endpoint_options())  # now another one may
    other.finalize()


def test_blocking_pulls_from_many_threads(facade_dd) -> None:
    with blocking_peer(s.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as (p, portal):
        portal.call(
            lambda: p.request(
                "alloc",
                kind="blocks",
                num_tensors=2,
                shape=[32, 1024],
                blocks_key=encode_key(s.BlocksCacheKey(1, 0)),
                seed=95,
            )
        )
        d = facade_dd
        d.init(endpoint_options())
        assert d.link_clusters([cluster(1, p.listen)], 5000) == (
            s.LLMStatusCode.LLM_SUCCESS,
            [s.LLMStatusCode.LLM_SUCCESS],
        )
        cm = d.cache_manager
        arrays = [np.zeros((32, 1024), np.uint8) for _ in range(2)]
        cache = cm.register_blocks_cache(
            s.CacheDesc(2, [32, 1024], s.DataType.DT_UINT8), [a.ctypes.data for a in arrays]
        )
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                for b in range(i, 32, 8):
                    cm.pull_blocks(s.BlocksCacheKey(1, 0), cache, [31 - b], [b])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for t in range(2):
            assert np.array_equal(arrays[t], expected_tensor(95, t, (32, 1024))[::-1])
        with pytest.raises(s.LLMException) as err:
            cm.pull_blocks(s.BlocksCacheKey(1, 7), cache, [0], [0])
        assert err.value.status_code == s.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        with pytest.raises(TypeError):
            cm.pull_blocks(s.BlocksCacheKey(1, 0), cache, ["a"], [0])


class Gate(s.LayerSynchronizer):
    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize_layer(self, layer_index, timeout_in_millis):
        return self.open.wait(30)


def test_cache_task_blocks_and_its_timeouts_do_not_cancel(facade_dd) -> None:
    with blocking_peer(s.LLMRole.DECODER, 3, endpoint_options(listen=True, ra=True)) as (p, portal):
        dst = portal.call(
            lambda: p.request(
                "register",
                kind="blocks",
                num_tensors=2,
                shape=[4, 256],
                blocks_key=encode_key(s.BlocksCacheKey(3, 0)),
            )
        )
        d = s.LLMDataDist(s.LLMRole.PROMPT, 4)
        try:
            d.init(endpoint_options(ra=True))
            d.link_clusters([cluster(3, p.listen)])
            cm = d.cache_manager
            src = cm.allocate_blocks_cache(s.CacheDesc(2, [4, 256], s.DataType.DT_UINT8))
            src.tensors[1][2] = 7
            gate = Gate()
            cfg = s.TransferWithCacheKeyConfig(s.BlocksCacheKey(3, 0), range(0, 1), range(0, 1))
            task = cm.transfer_cache_async(src, gate, [cfg], [2], [1])
            assert isinstance(task, s.CacheTask)
            assert task.synchronize(50) == s.LLMStatusCode.LLM_TIMEOUT
            assert task.get_results(50) == [s.LLMStatusCode.LLM_TIMEOUT]
            assert not task.done()
            gate.open.set()
            assert task.synchronize() == s.LLMStatusCode.LLM_SUCCESS
            assert task.get_results() == [s.LLMStatusCode.LLM_SUCCESS]
            got = portal.call(lambda: p.request("read", cache_id=dst, tensor=1))
            import base64

            assert set(np.frombuffer(base64.b64decode(got), np.uint8)[256:512]) == {7}
            # cancel() returns once the task is fenced
            never = Gate()
            task = cm.transfer_cache_async(src, never, [cfg], [2], [1])
            task.cancel()
            assert task.done()
            assert task.synchronize() == s.LLMStatusCode.LLM_FAILED
            never.open.set()
        finally:
            d.finalize()


def test_the_facade_refuses_calls_from_its_own_loop_thread(facade_dd) -> None:
    d = facade_dd
    d.init(endpoint_options())
    cm = d.cache_manager

    from llmdd_async._sync_loop import LoopThread

    def inside() -> None:
        cm.allocate_cache(s.CacheDesc(1, [2, 16], s.DataType.DT_UINT8))

    with pytest.raises(RuntimeError, match="own event loop thread"):
        LoopThread.get().call(inside)


def test_atexit_finalizes_a_forgotten_endpoint(caplog, monkeypatch) -> None:
    library_logs_enabled(monkeypatch)
    child = textwrap.dedent(
        """
        import sys
        from llmdd_async.sync import LLMDataDist, LLMRole
        d = LLMDataDist(LLMRole.PROMPT, 5)
        d.init({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:0"})
        print(d.listen_address[1], flush=True)
        sys.stdin.readline()
        # exits without finalize(): the atexit hook must do it
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        d = s.LLMDataDist(s.LLMRole.DECODER, 6)
        d.init(endpoint_options())
        try:
            assert d.link_clusters([cluster(5, ("127.0.0.1", port))])[0] == (
                s.LLMStatusCode.LLM_SUCCESS
            )
            with caplog.at_level(logging.INFO, logger="llmdd_async.link"):
                proc.stdin.write("\n")
                proc.stdin.flush()
                assert proc.wait(30) == 0
                import time

                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not any(
                    "finalized" in str(getattr(r, "reason", "")) for r in caplog.records
                ):
                    time.sleep(0.02)
            assert any("finalized" in str(getattr(r, "reason", "")) for r in caplog.records)
        finally:
            d.finalize()
    finally:
        proc.kill()
