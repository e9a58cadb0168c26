"""Replays of the real llm_datadist clients (clients.md) against ``llmdd_async.sync``.

Each test runs a client's prompt and decoder sides in separate spawned processes (upstream
allows one initialised LLMDataDist per process) and checks every child's result; the
children verify the transferred bytes themselves. See the ``replay`` package (one module per
client).
"""

from __future__ import annotations

from replay._common import HOST, run_replay
from replay.cann import (
    CACHE_NUM_TENSORS,
    cann_cache_to_blocks_decoder,
    cann_cache_to_blocks_prompt,
    cann_pull_blocks_decoder,
    cann_pull_blocks_prompt,
    cann_pull_cache_decoder,
    cann_pull_cache_prompt,
    cann_push_blocks_decoder,
    cann_push_blocks_prompt,
    cann_push_cache_decoder,
    cann_push_cache_prompt,
    cann_switch_role_decoder,
    cann_switch_role_prompt,
    cann_transfer_async_decoder,
    cann_transfer_async_prompt,
    cann_xpyd_decoder,
    cann_xpyd_prompt,
)
from replay.cann_multi_device import md_decoder, md_prompt, mdx_decoder, mdx_prompt
from replay.concurrency import concurrency_decoder, concurrency_prompt
from replay.mindie import mindie_decoder, mindie_prompt
from replay.omni import omni_decoder, omni_prompt
from replay.sglang import SG_CHUNKS, SG_GROUPS, SG_ROOMS, sglang_decoder, sglang_prompt
from replay.torchair import torchair_decoder, torchair_prompt
from replay.vllm_v0 import vllm_v0_decoder, vllm_v0_prompt
from replay.vllm_v1 import V1_REQUESTS, vllm_v1_decoder, vllm_v1_prompt
from replay.xllm import xllm_decoder, xllm_prompt

from llmdd_async.sync import LLMStatusCode
from llmdd_async.testing import free_ports


def test_vllm_ascend_v1_mha() -> None:
    """§1: link() on both sides, ThreadPoolExecutor(1) pulls, prefix-hit trimming."""
    ports = free_ports(2)
    out = run_replay(
        {
            "prompt": (vllm_v1_prompt, {"ports": ports, "variant": "mha"}),
            "decoder": (vllm_v1_decoder, {"ports": ports, "variant": "mha"}),
        }
    )
    assert out["decoder"]["remote_ids"] == [[9, 10, 11], [0, 14, 15, 13]]
    assert out["decoder"]["bytes_checked"] > 0
    assert out["prompt"]["finished"] == sorted(r[0] for r in V1_REQUESTS)
    assert out["prompt"]["linked_after"] == {}


def test_vllm_ascend_v1_mla() -> None:
    """§1, MLA: two caches (k_normed model 0, k_pe model 1) pulled per request."""
    ports = free_ports(2)
    out = run_replay(
        {
            "prompt": (vllm_v1_prompt, {"ports": ports, "variant": "mla"}),
            "decoder": (vllm_v1_decoder, {"ports": ports, "variant": "mla"}),
        }
    )
    assert out["decoder"]["bytes_checked"] > 0


def test_vllm_ascend_v0_legacy() -> None:
    """§2: KvCacheManager, hard-coded remote cache ids 1..4, CacheKeyByIdAndIndex pulls."""
    (port,) = free_ports(1)
    out = run_replay(
        {
            "prompt": (vllm_v0_prompt, {"port": port}),
            "decoder": (vllm_v0_decoder, {"port": port}),
        }
    )
    assert out["prompt"]["cache_ids"] == [1, 2, 3, 4]
    assert out["decoder"]["link"] == [0]
    assert out["decoder"]["bytes_checked"] > 0


def test_mindie_llm() -> None:
    """§3: windowed link() + 3-try status polling, K/V pulls per model_id, finalize."""
    p, d = free_ports(2)
    kwargs = {"cluster_ids": {"prefill": 1, "decoder": 2}, "ports": {"prefill": p, "decoder": d}}
    out = run_replay({"prompt": (mindie_prompt, kwargs), "decoder": (mindie_decoder, kwargs)})
    assert out["decoder"]["bytes_checked"] > 0
    assert out["decoder"]["queries"] >= 1
    assert out["prompt"]["queries"] > 3  # PREPARING was seen and the item re-queued


def test_omni_infer() -> None:
    """§4: to_thread pulls, P finalize()+init() on the same object, re-link on failure."""
    p, d = free_ports(2)
    kwargs = {"p_port": p, "d_port": d}
    out = run_replay({"prompt": (omni_prompt, kwargs), "decoder": (omni_decoder, kwargs)})
    assert out["decoder"]["relinks"] == 1
    assert out["decoder"]["bytes_checked"] > 0


def test_sglang_datadist_fork() -> None:
    """§5: non-empty local_comm_res, 12 pusher threads, tensor_num_per_layer=1, aux pushes."""
    (port,) = free_ports(1)
    out = run_replay(
        {
            "prompt": (sglang_prompt, {"port": port}),
            "decoder": (sglang_decoder, {"port": port}),
        }
    )
    assert out["decoder"]["none_rejected"] is True  # remote_cluster_id=None -> TypeError
    assert out["prompt"]["push_calls"] == SG_ROOMS * SG_CHUNKS * SG_GROUPS
    assert out["decoder"]["bytes_checked"] > 0


# ---------------------------------------------------------------- §6 CANN samples
def test_cann_pull_cache_sample() -> None:
    ports = free_ports(2)
    out = run_replay(
        {
            "prompt": (cann_pull_cache_prompt, {"ports": ports}),
            "decoder": (cann_pull_cache_decoder, {"ports": ports}),
        }
    )
    assert out["decoder"]["bytes_checked"] == 2 * 2 * 16 * 1024 * CACHE_NUM_TENSORS


def test_cann_pull_blocks_sample() -> None:
    ports = free_ports(2)
    out = run_replay(
        {
            "prompt": (cann_pull_blocks_prompt, {"ports": ports}),
            "decoder": (cann_pull_blocks_decoder, {"ports": ports}),
        }
    )
    assert out["decoder"]["bytes_checked"] == 3 * 8 * 1024 * 1024


def test_cann_pull_from_cache_to_blocks() -> None:
    ports = free_ports(2)
    out = run_replay(
        {
            "prompt": (cann_cache_to_blocks_prompt, {"ports": ports}),
            "decoder": (cann_cache_to_blocks_decoder, {"ports": ports}),
        }
    )
    assert out["decoder"]["bytes_checked"] == 2 * 16 * 1024 * CACHE_NUM_TENSORS


def test_cann_push_blocks_sample() -> None:
    p, d = free_ports(2)
    out = run_replay(
        {
            "prompt": (cann_push_blocks_prompt, {"p_port": p, "d_port": d}),
            "decoder": (cann_push_blocks_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["bytes_checked"] > 0


def test_cann_push_cache_sample() -> None:
    p, d = free_ports(2)
    out = run_replay(
        {
            "prompt": (cann_push_cache_prompt, {"p_port": p, "d_port": d}),
            "decoder": (cann_push_cache_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["bytes_checked"] > 0


def test_cann_pull_blocks_xpyd_sample() -> None:
    """Two prompts and one decoder: three processes."""
    p0, p1, d = free_ports(3)
    prompts = [f"{HOST}:{p0}", f"{HOST}:{p1}"]
    out = run_replay(
        {
            "prompt0": (cann_xpyd_prompt, {"local_ip_port": prompts[0]}),
            "prompt1": (cann_xpyd_prompt, {"local_ip_port": prompts[1]}),
            "decoder": (
                cann_xpyd_decoder,
                {"local_ip_port": f"{HOST}:{d}", "remote_ip_port": ";".join(prompts)},
            ),
        }
    )
    assert out["decoder"]["remotes"] == 2
    assert out["prompt0"]["cluster_id"] == (0x7F000001 << 16) | p0


def test_cann_switch_role_sample() -> None:
    (port,) = free_ports(1)
    out = run_replay(
        {
            "prompt": (cann_switch_role_prompt, {"port": port}),
            "decoder": (cann_switch_role_decoder, {"port": port}),
        }
    )
    assert out["prompt"]["bytes_checked"] > 0


def test_cann_transfer_cache_async_sample() -> None:
    p, d = free_ports(2)
    out = run_replay(
        {
            "prompt": (cann_transfer_async_prompt, {"p_port": p, "d_port": d}),
            "decoder": (cann_transfer_async_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["synchronize_calls"] == [(0, None)]
    assert out["decoder"]["bytes_checked"] > 0


def test_ascend_multiple_devices_sample() -> None:
    """Ascend's pull_cache_multiple_devices_sample: legacy single-process multi-device mode,
    four devices per process (llm.ClusterInfo, four ip infos per LLMClusterInfo, one pull_cache
    for every device)."""
    ports = free_ports(8)
    out = run_replay(
        {
            "prompt": (md_prompt, {"ports": ports}),
            "decoder": (md_decoder, {"ports": ports}),
        }
    )
    invalid = int(LLMStatusCode.LLM_PARAM_INVALID)
    assert out["decoder"]["short_ret"] == [invalid, [invalid]]
    assert out["decoder"]["link_rets"] == [0] and out["decoder"]["unlink_rets"] == [0]
    assert out["decoder"]["devices"] == 4 and out["prompt"]["distinct_devices"] == 4
    assert out["decoder"]["bytes_checked"] == 4 * 8 * 4 * 1024 * 2
    assert out["prompt"]["cache_id"] == 1


def test_legacy_multi_device_calls() -> None:
    """The rest of multi-device legacy mode: device lists from LLMConfig.device_id and
    "ip:port;ip:port", blocks pulled per device, copy_blocks, check_link_status, force unlink;
    transfer_cache_async and switch_role refused (as upstream)."""
    ports = free_ports(2)
    out = run_replay(
        {
            "prompt": (mdx_prompt, {"ports": ports}),
            "decoder": (mdx_decoder, {"ports": ports}),
        }
    )
    invalid = int(LLMStatusCode.LLM_PARAM_INVALID)
    assert out["prompt"]["refused"] == [invalid, invalid]
    assert out["decoder"]["bytes_checked"] == 2 * 3 * 256
    assert out["decoder"]["after_unlink"] == int(LLMStatusCode.LLM_NOT_YET_LINK)


def test_torchair_pd_separate() -> None:
    """§7: legacy mode, both sides cluster 0, CacheKey pulls into batch slot i % 4."""
    (port,) = free_ports(1)
    out = run_replay(
        {
            "prompt": (torchair_prompt, {"port": port}),
            "decoder": (torchair_decoder, {"port": port}),
        }
    )
    assert "LLM_SUCCESS" in out["decoder"]["link"]
    assert out["decoder"]["bytes_checked"] > 0


def test_xllm_cpp_api() -> None:
    """§8: the C++ API's shape: status codes, cache ids, layer-wise PushKvBlocks."""
    p, d = free_ports(2)
    out = run_replay(
        {
            "prompt": (xllm_prompt, {"p_port": p, "d_port": d}),
            "decoder": (xllm_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["cache_ids"] == [1, 2]
    assert out["decoder"]["bytes_checked"] > 0


def test_blocking_calls_from_many_threads_at_once() -> None:
    """In one process: vllm-ascend's ThreadPoolExecutor(1) pulls, Omni's asyncio.to_thread
    pulls and SGLang's 12 pushers all at once on one link, while the peer pushes back."""
    (port,) = free_ports(1)
    out = run_replay(
        {
            "prompt": (concurrency_prompt, {"port": port}),
            "decoder": (concurrency_decoder, {"port": port}),
        }
    )
    assert out["decoder"]["bytes_checked"] > 0
    assert out["prompt"]["bytes_checked"] > 0
