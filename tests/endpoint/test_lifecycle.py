"""Starting and stopping an endpoint: structured form on every backend, init/finalize on asyncio."""

from __future__ import annotations

import anyio
import pytest
from helpers import cm_options

import llmdd_async as dd
from llmdd_async.testing import options_of

pytestmark = pytest.mark.anyio


async def test_running_yields_an_initialised_endpoint() -> None:
    d = dd.LLMDataDist(dd.LLMRole.DECODER, 7)
    assert not d.is_initialized()
    async with d.running(cm_options()) as same:
        assert same is d and d.is_initialized()
        assert d.cluster_id == 7 and d.role == dd.LLMRole.DECODER
        assert isinstance(d.cache_manager, dd.CacheManager)
        assert d.cache_manager is d.cache_manager
    assert not d.is_initialized()


async def test_running_accepts_an_llmconfig() -> None:
    cfg = dd.LLMConfig()
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 2500
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(cfg) as d:
        assert options_of(d).sync_kv_timeout_ms == 2500


async def test_running_twice_at_once_is_refused() -> None:
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    async with d.running(cm_options()):
        with pytest.raises(RuntimeError, match="already"):
            async with d.running(cm_options()):
                pass


async def test_exit_on_error_still_stops_the_engine() -> None:
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    with pytest.raises(ZeroDivisionError):
        async with d.running(cm_options()):
            cache = d.cache_manager.allocate_cache(dd.CacheDesc(1, [4], dd.DataType.DT_FLOAT))
            1 / 0
    assert not d.is_initialized() and not cache.valid
    with pytest.raises(RuntimeError):
        _ = d.cache_manager


@pytest.mark.parametrize(
    ("options", "exc", "code"),
    [
        ({"llm.EnableCacheManager": 1}, TypeError, None),
        ("llm.EnableCacheManager=1", TypeError, None),
        (
            {"llm.EnableCacheManager": "1", "llm.Transport": "udp"},
            dd.LLMException,
            dd.LLMStatusCode.LLM_PARAM_INVALID,
        ),
        (
            {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": "{"},
            dd.LLMException,
            dd.LLMStatusCode.LLM_PARAM_INVALID,
        ),
        (
            {"llm.EnableCacheManager": "1", "llm.DeviceAdapter": "npu-magic"},
            dd.LLMException,
            dd.LLMStatusCode.LLM_PARAM_INVALID,
        ),
    ],
)
async def test_bad_options_fail_before_starting(options, exc, code) -> None:
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    with pytest.raises(exc) as err:
        async with d.running(options):
            pytest.fail("must not start")
    if code is not None:
        assert err.value.status_code == code
    assert not d.is_initialized()


async def test_legacy_mode_is_the_default_like_upstream() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 1).running({}) as d:
        with pytest.raises(dd.LLMException) as err:
            _ = d.cache_manager
        assert err.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(cm_options()) as d:
        with pytest.raises(dd.LLMException) as err:
            _ = d.kv_cache_manager
        assert err.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID


async def test_local_comm_res_turns_on_cache_manager_and_remote_access() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running({"llm.LocalCommRes": ""}) as d:
        assert options_of(d).cache_manager and options_of(d).remote_accessible
        assert isinstance(d.cache_manager, dd.CacheManager)


async def test_several_endpoints_in_one_process() -> None:
    async with anyio.create_task_group() as tg:
        seen = []

        async def run(cid: int) -> None:
            async with dd.LLMDataDist(dd.LLMRole.MIX, cid).running(cm_options()) as d:
                seen.append(
                    d.cache_manager.allocate_cache(
                        dd.CacheDesc(1, [8], dd.DataType.DT_UINT8)
                    ).cache_id
                )
                await anyio.sleep(0.01)

        for cid in range(4):
            tg.start_soon(run, cid)
    assert seen == [1, 1, 1, 1]


# init()/finalize() run the engine as an asyncio background task: asyncio loops only.
asyncio_only = pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)


@asyncio_only
async def test_init_and_finalize_on_asyncio() -> None:
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 3)
    await d.finalize()  # not initialised: quiet no-op
    await d.init(cm_options())
    await d.init(cm_options())  # already initialised: no-op
    cache = d.cache_manager.allocate_cache(dd.CacheDesc(1, [2, 16], dd.DataType.DT_UINT8))
    cache.tensors[0][0] = 5
    await d.cache_manager.copy_cache(cache, cache, dst_batch_index=1, size=8)
    assert cache.tensors[0][1].tolist() == [5] * 8 + [0] * 8
    await d.finalize()
    await d.finalize()
    assert not d.is_initialized() and not cache.valid
    with pytest.raises(RuntimeError):
        _ = d.cache_manager
    await d.init(cm_options())  # finalize then init on the same object (Omni-Infer relies on it)
    assert d.cache_manager.allocate_cache(dd.CacheDesc(1, [16], dd.DataType.DT_UINT8)).cache_id == 1
    await d.finalize()


@asyncio_only
async def test_init_reports_bad_options() -> None:
    d = dd.LLMDataDist(dd.LLMRole.PROMPT, 3)
    with pytest.raises(dd.LLMException):
        await d.init({"llm.EnableCacheManager": "1", "llm.Transport": "pigeon"})
    assert not d.is_initialized()


@pytest.mark.parametrize("anyio_backend", [pytest.param(("trio", {}), id="trio")])
async def test_init_on_trio_says_to_use_running() -> None:
    with pytest.raises(RuntimeError, match="running"):
        await dd.LLMDataDist(dd.LLMRole.PROMPT, 1).init(cm_options())


def test_constructor_checks() -> None:
    with pytest.raises(TypeError):
        dd.LLMDataDist(1, 1)
    with pytest.raises(ValueError):
        dd.LLMDataDist(dd.LLMRole.PROMPT, -1)
    with pytest.raises(TypeError):
        dd.LLMDataDist(dd.LLMRole.PROMPT, "1")
