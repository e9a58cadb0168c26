"""clients.md §6: the CANN multiple-device samples (one process drives several devices).

Part of the replays of the real ``llm_datadist`` clients: see this package's docstring.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

from ._common import (
    HOST,
    Peer,
    assert_same,
    check_ok,
    host_tensors,
    pattern,
)
from .cann import LayerSynchronizerImpl

# ---------------------------------------------------------------- multiple_device_samples
# Ascend/samples ``python/level1_single_api/10_llm_data_dist/multiple_device_samples/
# pull_cache_multiple_devices_sample.py``: legacy mode, one process drives four devices (P: 0-3,
# D: 4-7 of one host); ``--cluster_id 1`` is the prompt, ``--cluster_id 2`` the decoder.
MD_CLUSTER_ID = {"prompt": 1, "decoder": 2}
#: DEVIATION: the sample's CacheDesc(80, [2, 2 * 1024 * 1024], DT_FLOAT16) is 640 MiB per
#: device; scaled down
MD_CACHE_DESC_ARGS = (8, [2, 4 * 1024], DataType.DT_FLOAT16)


def md_all_ips() -> list[str]:
    """``get_device_ips()`` (``hccn_tool`` per device): here every device is 127.0.0.1."""
    return [HOST] * 8


def _md_data(device_index: int, tensor: int) -> np.ndarray:
    shape = tuple(MD_CACHE_DESC_ARGS[1])
    return pattern(7000 + 100 * device_index + tensor, shape, np.float16)


def md_init_llm_datadist(role: LLMRole, cluster_id: int, all_ips: list[str], ports: list[int]):
    config_file = "numa_config.json" if role == LLMRole.PROMPT else "numa_config_1.json"
    os.environ["RESOURCE_CONFIG_PATH"] = os.path.join(os.getcwd(), config_file)

    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    cluster_config: dict[str, Any] = {
        "logic_device_id": ["0:0:0:0", "0:0:1:0", "0:0:2:0", "0:0:3:0"]
    }
    if role == LLMRole.PROMPT:
        # DEVIATION: port ports[i] instead of 26000 for all (the devices share 127.0.0.1 here)
        cluster_config["listen_ip_info"] = [
            {"ip": ip, "port": port} for ip, port in zip(all_ips[:4], ports[:4], strict=True)
        ]
    llm_config.cluster_info = json.dumps(cluster_config)
    # pull_cache timeout, ms
    llm_config.sync_kv_timeout = 3000
    llm_options = llm_config.generate_options()
    llm_options.update(
        {
            "ge.flowGraphMemMaxSize": "1000000000",
            "ge.session_device_id": "0" if role == LLMRole.PROMPT else "4",
        }
    )
    datadist.init(llm_options)
    return datadist


def md_link_unlink(
    datadist: LLMDataDist, all_ips: list[str], ports: list[int], is_link: bool = True
) -> list[int]:
    cluster_info = LLMClusterInfo()
    cluster_info.remote_cluster_id = 1
    for i in range(4):
        cluster_info.append_local_ip_info(all_ips[i + 4], ports[i + 4])  # DEVIATION: 26000
        cluster_info.append_remote_ip_info(all_ips[i], ports[i])  # DEVIATION: 26000
    func = datadist.link_clusters if is_link else datadist.unlink_clusters
    _, rets = func([cluster_info], 5000)
    for ret in rets:
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed, ret = {ret}")
    return [int(r) for r in rets]


def md_prompt(peer: Peer, ports: list[int]) -> dict:
    all_ips = md_all_ips()
    datadist = md_init_llm_datadist(LLMRole.PROMPT, MD_CLUSTER_ID["prompt"], all_ips, ports)
    prompt_cache_keys = [
        CacheKey(prompt_cluster_id=1, req_id=1),
        CacheKey(prompt_cluster_id=1, req_id=2),
    ]
    kv_cache_manager = datadist.kv_cache_manager
    kv_cache = kv_cache_manager.allocate_cache(CacheDesc(*MD_CACHE_DESC_ARGS), prompt_cache_keys)
    for device_index in [0, 1, 2, 3]:
        # (torch.npu.set_device(device_index))
        kv_tensor_addrs = kv_cache.per_device_tensor_addrs[device_index]
        kv_tensors = host_tensors(kv_cache.cache_desc.shape, np.float16, kv_tensor_addrs)
        for i, kv_tensor in enumerate(kv_tensors):
            # DEVIATION: a pattern per device and tensor instead of fill_(2), so that the
            # decoder can tell every device's data apart
            kv_tensor[...] = _md_data(device_index, i)
    peer.sync()  # DEVIATION: a barrier instead of the decoder's time.sleep(20): filled
    peer.sync()  # DEVIATION: a barrier instead of time.sleep(40): the decoder is done
    per_device = kv_cache.per_device_tensor_addrs
    datadist.finalize()
    return {"cache_id": kv_cache.cache_id, "distinct_devices": len({tuple(a) for a in per_device})}


def md_decoder(peer: Peer, ports: list[int]) -> dict:
    all_ips = md_all_ips()
    datadist = md_init_llm_datadist(LLMRole.DECODER, MD_CLUSTER_ID["decoder"], all_ips, ports)
    peer.sync()  # the prompt listens and filled its caches (see the prompt)
    # (replay check, not in the sample: one remote address for four devices is refused)
    short = LLMClusterInfo()
    short.remote_cluster_id = 1
    short.append_local_ip_info(all_ips[4], ports[4])
    short.append_remote_ip_info(all_ips[0], ports[0])
    short_ret = datadist.link_clusters([short], 5000)
    link_rets = md_link_unlink(datadist, all_ips, ports)
    kv_cache_manager = datadist.kv_cache_manager
    kv_cache = kv_cache_manager.allocate_cache(CacheDesc(*MD_CACHE_DESC_ARGS))
    kv_cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1), kv_cache, batch_index=1)
    checked = 0
    for device_index in [0, 1, 2, 3]:
        # (torch.npu.set_device(device_index + 4))
        kv_tensor_addrs = kv_cache.per_device_tensor_addrs[device_index]
        kv_tensors = host_tensors(kv_cache.cache_desc.shape, np.float16, kv_tensor_addrs)
        for i, kv_tensor in enumerate(kv_tensors):
            # (the sample logs the values; the replay checks them: req 1 is the prompt's
            # batch slot 0, pulled into slot 1 of the same device)
            want = _md_data(device_index, i)[0]
            checked += assert_same(kv_tensor[1], want, f"device {device_index} tensor {i}")
    unlink_rets = md_link_unlink(datadist, all_ips, ports, False)
    datadist.finalize()
    peer.sync()
    return {
        "short_ret": [int(short_ret[0]), [int(c) for c in short_ret[1]]],
        "link_rets": link_rets,
        "unlink_rets": unlink_rets,
        "devices": len(kv_cache.per_device_tensor_addrs),
        "bytes_checked": checked,
    }


# ---------------------------------------------------------------- multi-device, more calls
# Not a client: the rest of the legacy multi-device surface, with the other option spelling
# (LLMConfig.device_id as a list, "ip:port;ip:port" listen addresses).
MDX_DESC_ARGS = (2, [6, 256], DataType.DT_INT8)  # blocks cache: 6 blocks of 256 bytes


def _mdx_init(role: LLMRole, cluster_id: int, listen: str | None) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = [0, 1]
    if listen is not None:
        llm_config.listen_ip_info = listen
    llm_config.ge_options = {"ge.flowGraphMemMaxSize": "16777216"}
    datadist.init(llm_config.generate_options())
    return datadist


def _mdx_cluster(ports: list[int], with_remote: bool = True) -> LLMClusterInfo:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info(HOST, 0)
    if with_remote:
        for port in ports:
            cluster.append_remote_ip_info(HOST, port)
    return cluster


def mdx_prompt(peer: Peer, ports: list[int]) -> dict:
    datadist = _mdx_init(LLMRole.PROMPT, 1, ";".join(f"{HOST}:{p}" for p in ports))
    kvm = datadist.kv_cache_manager
    cache = kvm.allocate_blocks_cache(CacheDesc(*MDX_DESC_ARGS), BlocksCacheKey(1, 0))
    for device, tensor in enumerate(kvm.get_cache_tensors(cache, 1)):
        tensor.numpy()[...] = pattern(8000 + device, tuple(MDX_DESC_ARGS[1]), np.int8)
    refused = []
    for call in (
        lambda: kvm.transfer_cache_async(cache, LayerSynchronizerImpl(), []),
        lambda: datadist.switch_role(LLMRole.DECODER),
    ):
        try:
            call()
        except LLMException as exc:
            refused.append(int(exc.status_code))
    peer.sync()  # filled and listening
    peer.sync()  # the decoder is done
    kvm.deallocate_cache(cache)
    datadist.finalize()
    return {"refused": refused}


def mdx_decoder(peer: Peer, ports: list[int]) -> dict:
    datadist = _mdx_init(LLMRole.DECODER, 2, None)
    peer.sync()
    ret, _ = datadist.link_clusters([_mdx_cluster(ports)], 5000)
    check_ok(ret, "link_clusters")
    datadist.check_link_status(1)
    kvm = datadist.kv_cache_manager
    cache = kvm.allocate_blocks_cache(CacheDesc(*MDX_DESC_ARGS))
    kvm.pull_blocks(BlocksCacheKey(1, 0), cache, [4, 1], [0, 5])
    copy = kvm.allocate_blocks_cache(CacheDesc(*MDX_DESC_ARGS))
    kvm.copy_blocks(cache, {0: [2]})
    checked = 0
    for device, tensor in enumerate(kvm.get_cache_tensors(cache, 1)):
        want = pattern(8000 + device, tuple(MDX_DESC_ARGS[1]), np.int8)
        got = tensor.numpy()
        checked += assert_same(got[[0, 5, 2]], want[[4, 1, 4]], f"device {device}")
    kvm.deallocate_cache(copy)
    kvm.deallocate_cache(cache)
    ret, _ = datadist.unlink_clusters([_mdx_cluster(ports, with_remote=False)], 5000, True)
    check_ok(ret, "force unlink_clusters")
    try:
        datadist.check_link_status(1)
        after_unlink = 0
    except LLMException as exc:
        after_unlink = int(exc.status_code)
    datadist.finalize()
    peer.sync()
    return {"bytes_checked": checked, "after_unlink": after_unlink}
