"""The C++-style surface (``LlmDataDist``, ``CacheIndex``, ``KvCacheExtParam``): status codes."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from helpers import blocking_peer, cluster, endpoint_options

import llmdd_async.sync as s
from llmdd_async.testing import encode_key

S = s.LLMStatusCode


@pytest.mark.parametrize(
    ("param", "want"),
    [
        (s.KvCacheExtParam(), (None, None, 2)),
        (s.KvCacheExtParam((0, 1), (2, 3)), (range(0, 2), range(2, 4), 2)),
        (s.KvCacheExtParam((3, 3), (3, 3), 1), (range(3, 4), range(3, 4), 1)),
    ],
)
def test_inclusive_layer_ranges(param, want) -> None:
    assert param.ranges() == want


@pytest.mark.parametrize(
    "param",
    [s.KvCacheExtParam((2, 1)), s.KvCacheExtParam((0, 1), (0, 2)), s.KvCacheExtParam((-1, 3))],
)
def test_bad_layer_ranges(param) -> None:
    with pytest.raises(s.LLMException) as err:
        param.ranges()
    assert err.value.status_code == S.LLM_PARAM_INVALID


def test_cache_index_types() -> None:
    with pytest.raises(TypeError):
        s.CacheIndex("1", 2)
    with pytest.raises(ValueError):
        s.CacheIndex(1, 2, -1)


def test_status_codes_instead_of_exceptions() -> None:
    with blocking_peer(s.LLMRole.DECODER, 2, endpoint_options(listen=True, ra=True)) as (p, portal):
        portal.call(
            lambda: p.request(
                "register",
                kind="blocks",
                num_tensors=2,
                shape=[8, 128],
                blocks_key=encode_key(s.BlocksCacheKey(2, 0)),
                seed=4,
            )
        )
        dd = s.LlmDataDist(1, s.LLMRole.PROMPT)  # C++ argument order
        assert dd.pull_kv_blocks(s.CacheIndex(2, 1), 1, [0], [0]) == S.LLM_FAILED  # not init
        assert dd.initialize({"llm.DeviceId": "0"}) == S.LLM_SUCCESS
        try:
            code, rets = dd.link_llm_clusters([cluster(2, p.listen)], 5000)
            assert (code, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            k = [
                np.arange(8 * 128, dtype=np.uint32).astype(np.uint8).reshape(8, 128) + i
                for i in range(2)
            ]
            status, cache_id = dd.register_kv_cache(
                s.CacheDesc(2, [8, 128], s.DataType.DT_UINT8), [a.ctypes.data for a in k]
            )
            assert status == S.LLM_SUCCESS and cache_id == 1
            assert dd.register_kv_cache(s.CacheDesc(2, [8, 128], s.DataType.DT_UINT8), [0, 0]) == (
                S.LLM_PARAM_INVALID,
                -1,
            )
            # layer-wise push of layer 1 only, one tensor per "layer" (xLLM's pattern)
            ext = s.KvCacheExtParam((1, 1), (1, 1), 1)
            assert dd.push_kv_blocks(cache_id, s.CacheIndex(2, 1), [3], [5], ext) == S.LLM_SUCCESS
            got = base64.b64decode(portal.call(lambda: p.request("read", cache_id=1, tensor=1)))
            assert np.array_equal(np.frombuffer(got, np.uint8).reshape(8, 128)[5], k[1][3])
            got0 = base64.b64decode(portal.call(lambda: p.request("read", cache_id=1, tensor=0)))
            assert np.frombuffer(got0, np.uint8).reshape(8, 128)[5].tolist() != k[0][3].tolist()
            # pull back by id into another local cache
            mine = [np.zeros((8, 128), np.uint8) for _ in range(2)]
            _, other = dd.register_kv_cache(
                s.CacheDesc(2, [8, 128], s.DataType.DT_UINT8), [a.ctypes.data for a in mine]
            )
            assert dd.pull_kv_blocks(s.CacheIndex(2, 1), other, [5], [0]) == S.LLM_SUCCESS
            assert np.array_equal(mine[1][0], k[1][3])
            assert dd.pull_kv_blocks(s.CacheIndex(2, 1, 1), other, [5], [0]) == (
                S.LLM_PARAM_INVALID
            )
            assert dd.pull_kv_blocks(s.CacheIndex(2, 99), other, [5], [0]) == (
                S.LLM_KV_CACHE_NOT_EXIST
            )
            assert dd.pull_kv_blocks(s.CacheIndex(2, 1), other, [8], [0]) == S.LLM_PARAM_INVALID
            assert dd.unregister_kv_cache(other) == S.LLM_SUCCESS
            assert dd.unlink_llm_clusters([cluster(2)], 1000, True) == (
                S.LLM_SUCCESS,
                [S.LLM_SUCCESS],
            )
        finally:
            dd.finalize()
