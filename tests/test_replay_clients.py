"""Replays of the real llm_datadist clients (clients.md) against ``llmdd_async.sync``.

Each test runs a client's prompt and decoder sides in separate spawned processes (upstream
allows one initialised LLMDataDist per process) and checks every child's result; the
children verify the transferred bytes themselves. See ``replay_clients.py``.
"""

from __future__ import annotations

import replay_clients as rc


def test_vllm_ascend_v1_mha() -> None:
    """§1: link() on both sides, ThreadPoolExecutor(1) pulls, prefix-hit trimming."""
    ports = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.vllm_v1_prompt, {"ports": ports, "variant": "mha"}),
            "decoder": (rc.vllm_v1_decoder, {"ports": ports, "variant": "mha"}),
        }
    )
    assert out["decoder"]["remote_ids"] == [[9, 10, 11], [0, 14, 15, 13]]
    assert out["decoder"]["bytes_checked"] > 0
    assert out["prompt"]["finished"] == sorted(r[0] for r in rc.V1_REQUESTS)
    assert out["prompt"]["linked_after"] == {}


def test_vllm_ascend_v1_mla() -> None:
    """§1, MLA: two caches (k_normed model 0, k_pe model 1) pulled per request."""
    ports = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.vllm_v1_prompt, {"ports": ports, "variant": "mla"}),
            "decoder": (rc.vllm_v1_decoder, {"ports": ports, "variant": "mla"}),
        }
    )
    assert out["decoder"]["bytes_checked"] > 0


def test_vllm_ascend_v0_legacy() -> None:
    """§2: KvCacheManager, hard-coded remote cache ids 1..4, CacheKeyByIdAndIndex pulls."""
    (port,) = rc.free_ports(1)
    out = rc.run_replay(
        {
            "prompt": (rc.vllm_v0_prompt, {"port": port}),
            "decoder": (rc.vllm_v0_decoder, {"port": port}),
        }
    )
    assert out["prompt"]["cache_ids"] == [1, 2, 3, 4]
    assert out["decoder"]["link"] == [0]
    assert out["decoder"]["bytes_checked"] > 0


def test_mindie_llm() -> None:
    """§3: windowed link() + 3-try status polling, K/V pulls per model_id, finalize."""
    p, d = rc.free_ports(2)
    kwargs = {"cluster_ids": {"prefill": 1, "decoder": 2}, "ports": {"prefill": p, "decoder": d}}
    out = rc.run_replay(
        {"prompt": (rc.mindie_prompt, kwargs), "decoder": (rc.mindie_decoder, kwargs)}
    )
    assert out["decoder"]["bytes_checked"] > 0
    assert out["decoder"]["queries"] >= 1
    assert out["prompt"]["queries"] > 3  # PREPARING was seen and the item re-queued


def test_omni_infer() -> None:
    """§4: to_thread pulls, P finalize()+init() on the same object, re-link on failure."""
    p, d = rc.free_ports(2)
    kwargs = {"p_port": p, "d_port": d}
    out = rc.run_replay({"prompt": (rc.omni_prompt, kwargs), "decoder": (rc.omni_decoder, kwargs)})
    assert out["decoder"]["relinks"] == 1
    assert out["decoder"]["bytes_checked"] > 0


def test_sglang_datadist_fork() -> None:
    """§5: non-empty local_comm_res, 12 pusher threads, tensor_num_per_layer=1, aux pushes."""
    (port,) = rc.free_ports(1)
    out = rc.run_replay(
        {
            "prompt": (rc.sglang_prompt, {"port": port}),
            "decoder": (rc.sglang_decoder, {"port": port}),
        }
    )
    assert out["decoder"]["none_rejected"] is True  # remote_cluster_id=None -> TypeError
    assert out["prompt"]["push_calls"] == rc.SG_ROOMS * rc.SG_CHUNKS * rc.SG_GROUPS
    assert out["decoder"]["bytes_checked"] > 0


# ---------------------------------------------------------------- §6 CANN samples
def test_cann_pull_cache_sample() -> None:
    ports = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_pull_cache_prompt, {"ports": ports}),
            "decoder": (rc.cann_pull_cache_decoder, {"ports": ports}),
        }
    )
    assert out["decoder"]["bytes_checked"] == 2 * 2 * 16 * 1024 * rc.CACHE_NUM_TENSORS


def test_cann_pull_blocks_sample() -> None:
    ports = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_pull_blocks_prompt, {"ports": ports}),
            "decoder": (rc.cann_pull_blocks_decoder, {"ports": ports}),
        }
    )
    assert out["decoder"]["bytes_checked"] == 3 * 8 * 1024 * 1024


def test_cann_pull_from_cache_to_blocks() -> None:
    ports = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_cache_to_blocks_prompt, {"ports": ports}),
            "decoder": (rc.cann_cache_to_blocks_decoder, {"ports": ports}),
        }
    )
    assert out["decoder"]["bytes_checked"] == 2 * 16 * 1024 * rc.CACHE_NUM_TENSORS


def test_cann_push_blocks_sample() -> None:
    p, d = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_push_blocks_prompt, {"p_port": p, "d_port": d}),
            "decoder": (rc.cann_push_blocks_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["bytes_checked"] > 0


def test_cann_push_cache_sample() -> None:
    p, d = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_push_cache_prompt, {"p_port": p, "d_port": d}),
            "decoder": (rc.cann_push_cache_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["bytes_checked"] > 0


def test_cann_pull_blocks_xpyd_sample() -> None:
    """Two prompts and one decoder: three processes."""
    p0, p1, d = rc.free_ports(3)
    prompts = [f"{rc.HOST}:{p0}", f"{rc.HOST}:{p1}"]
    out = rc.run_replay(
        {
            "prompt0": (rc.cann_xpyd_prompt, {"local_ip_port": prompts[0]}),
            "prompt1": (rc.cann_xpyd_prompt, {"local_ip_port": prompts[1]}),
            "decoder": (
                rc.cann_xpyd_decoder,
                {"local_ip_port": f"{rc.HOST}:{d}", "remote_ip_port": ";".join(prompts)},
            ),
        }
    )
    assert out["decoder"]["remotes"] == 2
    assert out["prompt0"]["cluster_id"] == (0x7F000001 << 16) | p0


def test_cann_switch_role_sample() -> None:
    (port,) = rc.free_ports(1)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_switch_role_prompt, {"port": port}),
            "decoder": (rc.cann_switch_role_decoder, {"port": port}),
        }
    )
    assert out["prompt"]["bytes_checked"] > 0


def test_cann_transfer_cache_async_sample() -> None:
    p, d = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.cann_transfer_async_prompt, {"p_port": p, "d_port": d}),
            "decoder": (rc.cann_transfer_async_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["synchronize_calls"] == [(0, None)]
    assert out["decoder"]["bytes_checked"] > 0


def test_ascend_multiple_devices_sample() -> None:
    """Ascend's pull_cache_multiple_devices_sample: legacy single-process multi-device mode,
    four devices per process (llm.ClusterInfo, four ip infos per LLMClusterInfo, one pull_cache
    for every device)."""
    ports = rc.free_ports(8)
    out = rc.run_replay(
        {
            "prompt": (rc.md_prompt, {"ports": ports}),
            "decoder": (rc.md_decoder, {"ports": ports}),
        }
    )
    invalid = int(rc.LLMStatusCode.LLM_PARAM_INVALID)
    assert out["decoder"]["short_ret"] == [invalid, [invalid]]
    assert out["decoder"]["link_rets"] == [0] and out["decoder"]["unlink_rets"] == [0]
    assert out["decoder"]["devices"] == 4 and out["prompt"]["distinct_devices"] == 4
    assert out["decoder"]["bytes_checked"] == 4 * 8 * 4 * 1024 * 2
    assert out["prompt"]["cache_id"] == 1


def test_legacy_multi_device_calls() -> None:
    """The rest of multi-device legacy mode: device lists from LLMConfig.device_id and
    "ip:port;ip:port", blocks pulled per device, copy_blocks, check_link_status, force unlink;
    transfer_cache_async and switch_role refused (as upstream)."""
    ports = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.mdx_prompt, {"ports": ports}),
            "decoder": (rc.mdx_decoder, {"ports": ports}),
        }
    )
    invalid = int(rc.LLMStatusCode.LLM_PARAM_INVALID)
    assert out["prompt"]["refused"] == [invalid, invalid]
    assert out["decoder"]["bytes_checked"] == 2 * 3 * 256
    assert out["decoder"]["after_unlink"] == int(rc.LLMStatusCode.LLM_NOT_YET_LINK)


def test_torchair_pd_separate() -> None:
    """§7: legacy mode, both sides cluster 0, CacheKey pulls into batch slot i % 4."""
    (port,) = rc.free_ports(1)
    out = rc.run_replay(
        {
            "prompt": (rc.torchair_prompt, {"port": port}),
            "decoder": (rc.torchair_decoder, {"port": port}),
        }
    )
    assert "LLM_SUCCESS" in out["decoder"]["link"]
    assert out["decoder"]["bytes_checked"] > 0


def test_xllm_cpp_api() -> None:
    """§8: the C++ API's shape: status codes, cache ids, layer-wise PushKvBlocks."""
    p, d = rc.free_ports(2)
    out = rc.run_replay(
        {
            "prompt": (rc.xllm_prompt, {"p_port": p, "d_port": d}),
            "decoder": (rc.xllm_decoder, {"p_port": p, "d_port": d}),
        }
    )
    assert out["prompt"]["cache_ids"] == [1, 2]
    assert out["decoder"]["bytes_checked"] > 0


def test_blocking_calls_from_many_threads_at_once() -> None:
    """In one process: vllm-ascend's ThreadPoolExecutor(1) pulls, Omni's asyncio.to_thread
    pulls and SGLang's 12 pushers all at once on one link, while the peer pushes back."""
    (port,) = rc.free_ports(1)
    out = rc.run_replay(
        {
            "prompt": (rc.concurrency_prompt, {"port": port}),
            "decoder": (rc.concurrency_decoder, {"port": port}),
        }
    )
    assert out["decoder"]["bytes_checked"] > 0
    assert out["prompt"]["bytes_checked"] > 0
