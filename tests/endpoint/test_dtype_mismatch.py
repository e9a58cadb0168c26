"""A transfer between caches of different element types is refused (LLM_PARAM_INVALID naming
both types) before any byte moves; a raw byte cache (DT_UINT8) takes any type, and a peer that
does not say its type (earlier releases) is not checked."""

from __future__ import annotations

import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async._messages import Address, By, CacheInfo, Op, Request, Shape
from llmdd_async.testing import DEFAULT_OPTIONS, linked_pair

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK = 8, 4096  # bytes per block, on both sides
KEY = dd.BlocksCacheKey(1, 0)


def _options(transport: str, remote_accessible: bool) -> dict[str, str]:
    opts = {**DEFAULT_OPTIONS, "llm.Transport": transport}
    opts["llm.EnableRemoteCacheAccessible"] = "1" if remote_accessible else "0"
    return opts


def _desc(dtype: dd.DataType) -> dd.CacheDesc:
    return dd.CacheDesc(1, [BLOCKS, BLOCK // dtype.itemsize], dtype)


def _array(dtype: dd.DataType, fill: int) -> np.ndarray:
    return np.full((BLOCKS, BLOCK), fill, dtype=np.uint8).view(dtype.numpy_dtype)


MODES = [
    pytest.param("tcp", False, id="tcp-default"),
    pytest.param("tcp", True, id="tcp-remote-accessible"),
    pytest.param("same-host", False, id="same-host-default"),
    # one-sided: the decoder plans from the prompt's table, the prompt never sees the pull
    pytest.param("same-host", True, id="same-host-remote-accessible"),
]


@pytest.mark.parametrize(("transport", "remote_accessible"), MODES)
async def test_pulling_fp16_blocks_into_an_fp32_cache_is_refused(
    transport: str, remote_accessible: bool
) -> None:
    async with linked_pair(_options(transport, remote_accessible)) as (prompt, decoder):
        src = _array(dd.DataType.DT_FLOAT16, 7)
        prompt.cache_manager.register_blocks_cache(_desc(dd.DataType.DT_FLOAT16), [src], KEY)
        dst = _array(dd.DataType.DT_FLOAT, 0)
        cache = decoder.cache_manager.register_blocks_cache(_desc(dd.DataType.DT_FLOAT), [dst])
        with pytest.raises(dd.LLMException) as info:
            await decoder.cache_manager.pull_blocks(KEY, cache, [1, 2], [3, 4])
        assert info.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID
        message = str(info.value)
        assert "the source holds DT_FLOAT16, the destination DT_FLOAT " in message
        assert not dst.view(np.uint8).any()  # nothing landed
        # The link is fine: a raw byte cache takes the same blocks.
        raw = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
        raw_cache = decoder.cache_manager.register_blocks_cache(_desc(dd.DataType.DT_UINT8), [raw])
        await decoder.cache_manager.pull_blocks(KEY, raw_cache, [1, 2], [3, 4])
        assert (raw[[3, 4]] == 7).all() and not raw[[0, 1, 2, 5, 6, 7]].any()


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_pushing_bf16_blocks_into_an_fp16_cache_is_refused(transport: str) -> None:
    async with linked_pair(_options(transport, True)) as (prompt, decoder):
        dst = _array(dd.DataType.DT_FLOAT16, 0)
        decoder.cache_manager.register_blocks_cache(
            _desc(dd.DataType.DT_FLOAT16), [dst], dd.BlocksCacheKey(2, 0)
        )
        src = _array(dd.DataType.DT_BF16, 9)
        cache = prompt.cache_manager.register_blocks_cache(_desc(dd.DataType.DT_BF16), [src])
        with pytest.raises(dd.LLMException) as info:
            await prompt.cache_manager.push_blocks(dd.BlocksCacheKey(2, 0), cache, [0], [5])
        assert info.value.status_code == dd.LLMStatusCode.LLM_PARAM_INVALID
        assert "DT_BF16" in str(info.value) and "DT_FLOAT16" in str(info.value)
        assert not dst.view(np.uint8).any()


def test_the_data_type_travels_in_requests_and_tables_and_is_optional() -> None:
    addrs = np.array([4096], dtype=np.uint64)
    target = Address(By.BLOCKS_KEY, model_id=0)
    base = Request(1, Op.PULL, target, Shape.BLOCKS, (BLOCK, BLOCKS, True), addrs)
    assert Request.decode(base.encode()).dtype is None  # an earlier release: not checked
    typed = Request(1, Op.PULL, target, Shape.BLOCKS, (BLOCK, BLOCKS, True), addrs, dtype=27)
    assert Request.decode(typed.encode()).dtype == 27
    info = CacheInfo(3, (4096,), BLOCK, BLOCKS, True, 0, True)
    assert "dtype" not in info.encode() and CacheInfo.decode(info.encode()) == info
    typed_info = CacheInfo(3, (4096,), BLOCK, BLOCKS, True, 0, True, dtype=1)
    assert CacheInfo.decode(typed_info.encode()) == typed_info
    assert CacheInfo.decode({**typed_info.encode(), "dtype": "fp16"}) is None  # malformed
