"""Table-driven checks of the validation rules in the reference, §2-§7.

Reference: ``/work/shared/reference/llm_datadist_api.md`` (enums §2, error model §3, LLMConfig §4,
LLMClusterInfo §5, ``LLMDataDist`` and ``init`` steps 1-5 §6, value types §7) and
``clients.md`` §1 (the option keys vLLM-Ascend ends up with).

``ERROR_ROWS`` lists calls that must raise: ``(id, call, exception class, status code)``. The
status code is the one an ``LLMException`` must carry; ``None`` means the error must not be an
``LLMException`` at all. Where the reference states a bound but not which class its violation
raises (a semantic check or an integer range), the class is ``RANGE``: a ``ValueError`` or an
``LLMException`` with ``LLM_PARAM_INVALID``, and nothing else.

``VALUE_ROWS`` lists calls that must NOT raise, with the value each must produce, so that a rule
made too strict (or an enum value, string form or option key that drifts) fails here too.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any

import pytest

import llmdd_async as dd
from llmdd_async._options import parse_options

S = dd.LLMStatusCode
PARAM = S.LLM_PARAM_INVALID
U64 = 2**64 - 1
U32 = 2**32 - 1
I32 = 2**31 - 1
I64 = 2**63 - 1
MU = "llm.MemoryUtilization"
RANGE = (ValueError, dd.LLMException)
ANY_CHECK = (TypeError, ValueError, dd.LLMException)

Call = Callable[[], Any]


# ----------------------------------------------------------------------------------------------
# helpers (each builds a fresh object, so rows never share state)


def set_attr(obj: Any, name: str, value: Any) -> Any:
    setattr(obj, name, value)
    return obj


def cfg(**props: Any) -> dd.LLMConfig:
    """An LLMConfig with ``props`` set in the given order."""
    config = dd.LLMConfig()
    for name, value in props.items():
        setattr(config, name, value)
    return config


def opts(**props: Any) -> dict[str, str]:
    """A copy of ``generate_options()`` for a config with ``props`` set."""
    return dict(cfg(**props).generate_options())


def keys(**props: Any) -> list[str]:
    """Option keys in the order ``generate_options()`` emits them."""
    return list(cfg(**props).generate_options())


def cfg_set(name: str, value: Any) -> Call:
    return lambda: setattr(dd.LLMConfig(), name, value)


def accumulated() -> dict[str, str]:
    """Options after a key was emitted, its property turned off, and the options regenerated."""
    config = cfg(enable_switch_role=True, listen_ip_info="127.0.0.1:26000")
    config.generate_options()
    config.enable_switch_role = False
    config.device_id = 3
    return dict(config.generate_options())


def same_dict_each_call() -> bool:
    config = cfg(device_id=1)
    first = config.generate_options()
    config.sync_kv_timeout = 500
    second = config.generate_options()
    return first is second and first["llm.SyncKvCacheWaitTime"] == "500"


def gen_options_alias() -> bool:
    config = cfg(device_id=1)
    return config.gen_options() is config.generate_options()


def cluster_info_ip() -> object:
    info = json.dumps(
        {
            "cluster_id": 1,
            "logic_device_id": ["0:0:0:0"],
            "listen_ip_info": [{"ip": "192.168.1.2", "port": 26000}],
        }
    )
    emitted = json.loads(opts(cluster_info=info)["llm.ClusterInfo"])
    return type(emitted["listen_ip_info"][0]["ip"])


def full_config() -> dd.LLMConfig:
    """One property from each row of the §4 table that emits a single key, in table order."""
    return cfg(
        mem_utilization=0.5,
        enable_switch_role=True,
        output_max_size=64,
        global_resource_config="{}",
        transfer_backend="hixl",
        local_comm_res="",
        rdma_service_level=4,
        rdma_traffic_class=132,
        link_retry_count=2,
        link_total_time=5,
        listen_ip_info="127.0.0.1:26000",
        enable_remote_cache_accessible=True,
        enable_cache_manager=True,
        host_mem_pool_cfg='{"memory_size": 1024}',
        mem_pool_cfg='{"memory_size": 2048}',
        buf_pool_cfg='{"total_size": 1}',
        deploy_res_path="/tmp/res",
        sync_kv_timeout=1000,
        ge_options={"ge.custom": "x"},
    )


FULL_ORDER = [
    "ge.custom",
    "llm.SyncKvCacheWaitTime",
    "llm.deployResPath",
    "llm.BufPoolCfg",
    "llm.MemPoolConfig",
    "llm.HostMemPoolConfig",
    "llm.EnableCacheManager",
    "llm.EnableRemoteCacheAccessible",
    "llm.listenIpInfo",
    "llm.LinkTotalTime",
    "llm.LinkRetryCount",
    "llm.RdmaTrafficClass",
    "llm.RdmaServiceLevel",
    "llm.LocalCommRes",
    "llm.TransferBackend",
    "llm.GlobalResourceConfig",
    "llm.OutputMaxSize",
    "llm.EnableSwitchRole",
    "llm.MemoryUtilization",
]


def vllm_ascend_config() -> dd.LLMConfig:
    """The settings of clients.md §1 (vLLM-Ascend V1 connector), in its order."""
    return cfg(
        device_id=0,
        sync_kv_timeout=33000,
        enable_switch_role=True,
        enable_cache_manager=True,
        enable_remote_cache_accessible=True,
    )


VLLM_ASCEND_OPTIONS = {
    "ge.exec.deviceId": "0",
    "ge.session_device_id": "0",
    "llm.SyncKvCacheWaitTime": "33000",
    "llm.EnableCacheManager": "1",
    "llm.EnableRemoteCacheAccessible": "1",
    "llm.EnableSwitchRole": "1",
    "llm.MemoryUtilization": "0.95",
}


def cluster(*calls: tuple[str, tuple[Any, ...]]) -> dd.LLMClusterInfo:
    info = dd.LLMClusterInfo()
    for method, args in calls:
        getattr(info, method)(*args)
    return info


def desc(
    num_tensors: int = 2,
    shape: Any = (4, 8),
    data_type: Any = dd.DataType.DT_FLOAT16,
    **kwargs: Any,
) -> dd.CacheDesc:
    return dd.CacheDesc(num_tensors, shape, data_type, **kwargs)


def host_desc(num_tensors: int = 2) -> dd.CacheDesc:
    return dd.CacheDesc(num_tensors, [4, 8], dd.DataType.DT_FLOAT16, placement=dd.Placement.HOST)


def updated_desc() -> tuple[int, list[int], int]:
    d = desc(1, [4, 8], dd.DataType.DT_FLOAT)
    before = d.size
    d.update_dim(0, 8)
    return before, list(d.shape), d.size


def cpu_cache() -> dd.Cache:
    return dd.Cache.create_cpu_cache(host_desc(2), [4096, 8192])


def pull_check(*args: Any, **kwargs: Any) -> Call:
    return lambda: dd.CacheKey(*args, **kwargs).check_pullable()


def pullable(*args: Any, **kwargs: Any) -> bool:
    dd.CacheKey(*args, **kwargs).check_pullable()
    return True


def transfer_config(**kwargs: Any) -> dd.TransferConfig:
    return dd.TransferConfig(1, [10, 20], range(0, 1), **kwargs)


def keyed_config(key: Any = None, **kwargs: Any) -> dd.TransferWithCacheKeyConfig:
    key = dd.BlocksCacheKey(5, 1) if key is None else key
    return dd.TransferWithCacheKeyConfig(key, range(0, 2), range(2, 4), **kwargs)


def cm(**extra: str) -> dict[str, str]:
    return {"llm.EnableCacheManager": "1", **extra}


def parse_unmodified() -> dict[str, str]:
    options = {"llm.LocalCommRes": "", "llm.listenIpInfo": "127.0.0.1:26000"}
    parse_options(options)
    return options


def pool(memory_size: Any, page_shift: Any = None) -> str:
    cfg_: dict[str, Any] = {"memory_size": memory_size}
    if page_shift is not None:
        cfg_["page_shift"] = page_shift
    return json.dumps(cfg_)


def read_pool(key: str, value: str) -> tuple[int, int]:
    parsed = parse_options(cm(**{key: value}))
    p = parsed.device_pool if key == "llm.MemPoolConfig" else parsed.host_pool
    assert p is not None
    return p.memory_size, p.page_shift


# ----------------------------------------------------------------------------------------------
# calls that must raise

ERROR_ROWS: list[tuple[str, Call, Any, Any]] = [
    # §3 error model
    (
        "LLMException.status_code-read-only",
        lambda: set_attr(dd.LLMException("x", status_code=PARAM), "status_code", S.LLM_FAILED),
        AttributeError,
        None,
    ),
    # §4 LLMConfig setters
    ("cfg.ge_options-not-dict", cfg_set("ge_options", [("a", "b")]), TypeError, None),
    ("cfg.ge_options-str", cfg_set("ge_options", "a=b"), TypeError, None),
    ("cfg.ge_options-int-key", cfg_set("ge_options", {1: "a"}), TypeError, None),
    ("cfg.ge_options-int-value", cfg_set("ge_options", {"a": 1}), TypeError, None),
    ("cfg.device_id-str", cfg_set("device_id", "0"), TypeError, None),
    ("cfg.device_id-float", cfg_set("device_id", 1.0), TypeError, None),
    ("cfg.device_id-list-str-item", cfg_set("device_id", [0, "1"]), TypeError, None),
    ("cfg.device_id-over-int32", cfg_set("device_id", 2**31), ValueError, None),
    ("cfg.device_id-list-over-int32", cfg_set("device_id", [0, 2**31]), ValueError, None),
    ("cfg.device_id-negative", cfg_set("device_id", -1), RANGE, PARAM),
    ("cfg.device_id-list-negative", cfg_set("device_id", [0, -1]), RANGE, PARAM),
    ("cfg.device_id-tuple-negative", cfg_set("device_id", (-1,)), RANGE, PARAM),
    ("cfg.sync_kv_timeout-float", cfg_set("sync_kv_timeout", 1.5), TypeError, None),
    ("cfg.sync_kv_timeout-over-int32", cfg_set("sync_kv_timeout", 2**31), ValueError, None),
    (
        "cfg.sync_kv_timeout-digit-str-over-int32",
        cfg_set("sync_kv_timeout", "2147483648"),
        ValueError,
        None,
    ),
    ("cfg.sync_kv_timeout-zero", cfg_set("sync_kv_timeout", 0), RANGE, PARAM),
    ("cfg.sync_kv_timeout-negative", cfg_set("sync_kv_timeout", -5), RANGE, PARAM),
    ("cfg.sync_kv_timeout-str-zero", cfg_set("sync_kv_timeout", "0"), RANGE, PARAM),
    ("cfg.sync_kv_timeout-non-digit-str", cfg_set("sync_kv_timeout", "abc"), ANY_CHECK, PARAM),
    ("cfg.sync_kv_timeout-negative-str", cfg_set("sync_kv_timeout", "-5"), ANY_CHECK, PARAM),
    ("cfg.deploy_res_path-int", cfg_set("deploy_res_path", 1), TypeError, None),
    ("cfg.buf_pool_cfg-dict", cfg_set("buf_pool_cfg", {"total_size": 1}), TypeError, None),
    ("cfg.mem_pool_cfg-dict", cfg_set("mem_pool_cfg", {"memory_size": 1}), TypeError, None),
    ("cfg.host_mem_pool_cfg-int", cfg_set("host_mem_pool_cfg", 1), TypeError, None),
    ("cfg.enable_cache_manager-str", cfg_set("enable_cache_manager", "1"), TypeError, None),
    ("cfg.enable_cache_manager-int", cfg_set("enable_cache_manager", 1), TypeError, None),
    (
        "cfg.enable_remote_cache_accessible-str",
        cfg_set("enable_remote_cache_accessible", "1"),
        TypeError,
        None,
    ),
    (
        "cfg.enable_remote_cache_accessible-int",
        cfg_set("enable_remote_cache_accessible", 1),
        TypeError,
        None,
    ),
    ("cfg.listen_ip_info-int", cfg_set("listen_ip_info", 26000), TypeError, None),
    ("cfg.link_total_time-str", cfg_set("link_total_time", "5"), TypeError, None),
    ("cfg.link_total_time-float", cfg_set("link_total_time", 5.0), TypeError, None),
    ("cfg.link_total_time-negative", cfg_set("link_total_time", -1), RANGE, PARAM),
    ("cfg.link_total_time-over-uint32", cfg_set("link_total_time", 2**32), RANGE, PARAM),
    ("cfg.link_retry_count-str", cfg_set("link_retry_count", "2"), TypeError, None),
    ("cfg.link_retry_count-zero", cfg_set("link_retry_count", 0), RANGE, PARAM),
    ("cfg.link_retry_count-101", cfg_set("link_retry_count", 101), RANGE, PARAM),
    ("cfg.rdma_traffic_class-str", cfg_set("rdma_traffic_class", "132"), TypeError, None),
    ("cfg.rdma_traffic_class-negative", cfg_set("rdma_traffic_class", -1), ValueError, None),
    ("cfg.rdma_traffic_class-over-uint32", cfg_set("rdma_traffic_class", 2**32), ValueError, None),
    ("cfg.rdma_service_level-float", cfg_set("rdma_service_level", 4.0), TypeError, None),
    ("cfg.rdma_service_level-negative", cfg_set("rdma_service_level", -1), ValueError, None),
    ("cfg.rdma_service_level-over-uint32", cfg_set("rdma_service_level", 2**32), ValueError, None),
    ("cfg.local_comm_res-dict", cfg_set("local_comm_res", {"version": "1.3"}), TypeError, None),
    ("cfg.transfer_backend-int", cfg_set("transfer_backend", 1), TypeError, None),
    ("cfg.global_resource_config-dict", cfg_set("global_resource_config", {}), TypeError, None),
    ("cfg.cluster_info-dict", cfg_set("cluster_info", {"cluster_id": 1}), TypeError, None),
    ("cfg.output_max_size-str", cfg_set("output_max_size", "64"), TypeError, None),
    ("cfg.enable_switch_role-str", cfg_set("enable_switch_role", "1"), TypeError, None),
    ("cfg.enable_switch_role-int", cfg_set("enable_switch_role", 1), TypeError, None),
    ("cfg.mem_utilization-str", cfg_set("mem_utilization", "0.5"), TypeError, None),
    ("cfg.mem_utilization-above-1", cfg_set("mem_utilization", 1.5), RANGE, PARAM),
    ("cfg.mem_utilization-negative", cfg_set("mem_utilization", -0.1), RANGE, PARAM),
    # §5 LLMClusterInfo
    ("cluster.ctor-takes-no-args", lambda: dd.LLMClusterInfo(1), TypeError, None),
    (
        "cluster.remote_cluster_id-negative",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_cluster_id", -1),
        ValueError,
        None,
    ),
    (
        "cluster.remote_cluster_id-over-uint64",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_cluster_id", 2**64),
        ValueError,
        None,
    ),
    (
        "cluster.remote_cluster_id-str",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_cluster_id", "1"),
        TypeError,
        None,
    ),
    (
        "cluster.remote_cluster_id-float",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_cluster_id", 1.0),
        TypeError,
        None,
    ),
    (
        "cluster.local-port-over-uint16",
        lambda: dd.LLMClusterInfo().append_local_ip_info("127.0.0.1", 65536),
        ValueError,
        None,
    ),
    (
        "cluster.local-port-negative",
        lambda: dd.LLMClusterInfo().append_local_ip_info("127.0.0.1", -1),
        ValueError,
        None,
    ),
    (
        "cluster.local-port-str",
        lambda: dd.LLMClusterInfo().append_local_ip_info("127.0.0.1", "80"),
        TypeError,
        None,
    ),
    (
        "cluster.remote-port-over-uint16",
        lambda: dd.LLMClusterInfo().append_remote_ip_info("127.0.0.1", 65536),
        ValueError,
        None,
    ),
    (
        "cluster.remote-port-negative",
        lambda: dd.LLMClusterInfo().append_remote_ip_info("127.0.0.1", -1),
        ValueError,
        None,
    ),
    (
        "cluster.remote-port-float",
        lambda: dd.LLMClusterInfo().append_remote_ip_info("127.0.0.1", 80.0),
        TypeError,
        None,
    ),
    (
        "cluster.local-ip-octet-256",
        lambda: dd.LLMClusterInfo().append_local_ip_info("1.2.3.256", 0),
        RuntimeError,
        None,
    ),
    (
        # (a host name is taken, where upstream takes IPv4 only: text that is no host name is
        # not)
        "cluster.local-ip-not-a-host-name",
        lambda: dd.LLMClusterInfo().append_local_ip_info("not an ip", 0),
        RuntimeError,
        None,
    ),
    (
        "cluster.remote-ip-five-parts",
        lambda: dd.LLMClusterInfo().append_remote_ip_info("1.2.3.4.5", 26000),
        RuntimeError,
        None,
    ),
    (
        "cluster.remote-ip-empty",
        lambda: dd.LLMClusterInfo().append_remote_ip_info("", 26000),
        RuntimeError,
        None,
    ),
    (
        "cluster.local_ip_info_list-read-only",
        lambda: set_attr(dd.LLMClusterInfo(), "local_ip_info_list", []),
        AttributeError,
        None,
    ),
    (
        "cluster.remote_ip_info_list-read-only",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_ip_info_list", []),
        AttributeError,
        None,
    ),
    # §6 LLMDataDist(role, cluster_id)
    ("datadist.role-int", lambda: dd.LLMDataDist(1, 1), TypeError, None),
    ("datadist.role-str", lambda: dd.LLMDataDist("PROMPT", 1), TypeError, None),
    ("datadist.role-placement", lambda: dd.LLMDataDist(dd.Placement.DEVICE, 1), TypeError, None),
    (
        "datadist.args-swapped",
        lambda: dd.LLMDataDist(1, dd.LLMRole.PROMPT),
        TypeError,
        None,
    ),
    (
        "datadist.cluster_id-negative",
        lambda: dd.LLMDataDist(dd.LLMRole.PROMPT, -1),
        ValueError,
        None,
    ),
    (
        "datadist.cluster_id-over-uint64",
        lambda: dd.LLMDataDist(dd.LLMRole.PROMPT, 2**64),
        ValueError,
        None,
    ),
    ("datadist.cluster_id-str", lambda: dd.LLMDataDist(dd.LLMRole.PROMPT, "1"), TypeError, None),
    # §6 init steps 1-5 (parse_options)
    ("options.not-dict", lambda: parse_options([("a", "b")]), TypeError, None),
    ("options.none", lambda: parse_options(None), TypeError, None),
    ("options.int-value", lambda: parse_options({"ge.exec.deviceId": 0}), TypeError, None),
    ("options.int-key", lambda: parse_options({1: "1"}), TypeError, None),
    (
        "options.flowGraphMemMaxSize-commas",
        lambda: parse_options({"ge.flowGraphMemMaxSize": "1024,2048"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.flowGraphMemMaxSize-not-digits",
        lambda: parse_options({"ge.flowGraphMemMaxSize": "1G"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.LocalCommRes-without-cm",
        lambda: parse_options({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.TransferBackend-without-cm",
        lambda: parse_options(
            {"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:26000"}
        ),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.TransferBackend-remote-access-off",
        lambda: parse_options(
            cm(
                **{
                    "llm.TransferBackend": "hixl",
                    "llm.listenIpInfo": "127.0.0.1:26000",
                    "llm.EnableRemoteCacheAccessible": "0",
                }
            )
        ),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.TransferBackend-without-listenIpInfo",
        lambda: parse_options(cm(**{"llm.TransferBackend": "hixl"})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.TransferBackend-LocalCommRes-remote-access-off",
        lambda: parse_options(
            {
                "llm.LocalCommRes": "",
                "llm.TransferBackend": "hixl",
                "llm.listenIpInfo": "127.0.0.1:26000",
                "llm.EnableRemoteCacheAccessible": "0",
            }
        ),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.cm-listenIpInfo-two-addresses",
        lambda: parse_options(cm(**{"llm.listenIpInfo": "127.0.0.1:26000;127.0.0.1:26001"})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.cm-listenIpInfo-no-port",
        lambda: parse_options(cm(**{"llm.listenIpInfo": "127.0.0.1"})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.cm-listenIpInfo-three-parts",
        lambda: parse_options(cm(**{"llm.listenIpInfo": "127.0.0.1:26000:1"})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.LocalCommRes-implies-cm-listen-check",
        lambda: parse_options(
            {"llm.LocalCommRes": "", "llm.listenIpInfo": "127.0.0.1:1;127.0.0.1:2"}
        ),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.SyncKvCacheWaitTime-zero",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": "0"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.SyncKvCacheWaitTime-negative",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": "-1"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.SyncKvCacheWaitTime-float",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": "1.5"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.SyncKvCacheWaitTime-word",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": "abc"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.SyncKvCacheWaitTime-empty",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": ""}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.Transport-udp",
        lambda: parse_options({"llm.Transport": "udp"}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.Transport-empty",
        lambda: parse_options({"llm.Transport": ""}),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-size-zero",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": pool(0)})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-size-negative",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": pool(-1)})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-size-missing",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": '{"page_shift": 16}'})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-page_shift-9",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": pool(1 << 20, 9)})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-page_shift-31",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": pool(1 << 40, 31)})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-2^32-pages",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": pool(2**42, 10)})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.MemPoolConfig-not-json",
        lambda: parse_options(cm(**{"llm.MemPoolConfig": "memory_size=1024"})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.HostMemPoolConfig-size-zero",
        lambda: parse_options(cm(**{"llm.HostMemPoolConfig": pool(0)})),
        dd.LLMException,
        PARAM,
    ),
    (
        "options.HostMemPoolConfig-page_shift-31",
        lambda: parse_options(cm(**{"llm.HostMemPoolConfig": pool(1 << 40, 31)})),
        dd.LLMException,
        PARAM,
    ),
    # §7 CacheDesc
    ("desc.num_tensors-negative", lambda: desc(-1), ValueError, None),
    ("desc.num_tensors-over-uint32", lambda: desc(2**32), ValueError, None),
    ("desc.num_tensors-str", lambda: desc("2"), TypeError, None),
    ("desc.num_tensors-float", lambda: desc(2.0), TypeError, None),
    ("desc.shape-str", lambda: desc(shape="4,8"), TypeError, None),
    ("desc.shape-int", lambda: desc(shape=4), TypeError, None),
    ("desc.shape-str-dim", lambda: desc(shape=[4, "8"]), TypeError, None),
    ("desc.shape-float-dim", lambda: desc(shape=[4, 8.0]), TypeError, None),
    ("desc.shape-dim-over-int64", lambda: desc(shape=[4, 2**63]), ValueError, None),
    ("desc.shape-dim-under-int64", lambda: desc(shape=[4, -(2**63) - 1]), ValueError, None),
    ("desc.data_type-int", lambda: desc(data_type=1), TypeError, None),
    ("desc.data_type-str", lambda: desc(data_type="DT_FLOAT16"), TypeError, None),
    ("desc.placement-int", lambda: desc(placement=1), TypeError, None),
    ("desc.placement-memtype", lambda: desc(placement=dd.Memtype.MEM_TYPE_HOST), TypeError, None),
    ("desc.kv_tensor_format-int", lambda: desc(kv_tensor_format=1), TypeError, None),
    ("desc.batch_dim_index-past-shape", lambda: desc(batch_dim_index=2), RANGE, PARAM),
    ("desc.batch_dim_index-negative", lambda: desc(batch_dim_index=-1), RANGE, PARAM),
    ("desc.seq_len_dim_index-past-shape", lambda: desc(seq_len_dim_index=2), RANGE, PARAM),
    ("desc.seq_len_dim_index-minus-2", lambda: desc(seq_len_dim_index=-2), RANGE, PARAM),
    # §7 Cache.create_cpu_cache
    (
        "cpu_cache.device-placement",
        lambda: dd.Cache.create_cpu_cache(desc(2), [4096, 8192]),
        dd.LLMException,
        PARAM,
    ),
    (
        "cpu_cache.too-few-addrs",
        lambda: dd.Cache.create_cpu_cache(host_desc(2), [4096]),
        dd.LLMException,
        PARAM,
    ),
    (
        "cpu_cache.too-many-addrs",
        lambda: dd.Cache.create_cpu_cache(host_desc(2), [4096, 8192, 12288]),
        dd.LLMException,
        PARAM,
    ),
    # §7 CacheKey
    ("cachekey.five-positional", lambda: dd.CacheKey(1, 2, 3, 4, 5), dd.LLMException, PARAM),
    (
        "cachekey.five-mixed",
        lambda: dd.CacheKey(1, 2, model_id=3, prefix_id=4, prompt_cluster_id=5),
        dd.LLMException,
        PARAM,
    ),
    ("cachekey.no-args", lambda: dd.CacheKey(), dd.LLMException, PARAM),
    ("cachekey.only-cluster_id", lambda: dd.CacheKey(1), dd.LLMException, PARAM),
    ("cachekey.only-req_id", lambda: dd.CacheKey(req_id=1), dd.LLMException, PARAM),
    (
        "cachekey.missing-req_id-with-model",
        lambda: dd.CacheKey(cluster_id=1, model_id=0),
        dd.LLMException,
        PARAM,
    ),
    (
        "cachekey.missing-cluster_id",
        lambda: dd.CacheKey(req_id=1, model_id=0, prefix_id=2),
        dd.LLMException,
        PARAM,
    ),
    ("cachekey.unknown-kwarg", lambda: dd.CacheKey(1, 2, batch_index=0), dd.LLMException, PARAM),
    (
        "cachekey.unknown-kwarg-only",
        lambda: dd.CacheKey(cluster=1, req_id=2),
        dd.LLMException,
        PARAM,
    ),
    ("cachekey.cluster_id-negative", lambda: dd.CacheKey(-1, 2), ValueError, None),
    ("cachekey.cluster_id-over-uint64", lambda: dd.CacheKey(2**64, 2), ValueError, None),
    (
        "cachekey.prompt_cluster_id-negative",
        lambda: dd.CacheKey(prompt_cluster_id=-1, req_id=2),
        ValueError,
        None,
    ),
    ("cachekey.req_id-negative", lambda: dd.CacheKey(1, -1), ValueError, None),
    ("cachekey.req_id-over-uint64", lambda: dd.CacheKey(1, 2**64), ValueError, None),
    ("cachekey.model_id-negative", lambda: dd.CacheKey(1, 2, -1), ValueError, None),
    ("cachekey.model_id-over-uint64", lambda: dd.CacheKey(1, 2, model_id=2**64), ValueError, None),
    ("cachekey.prefix_id-negative", lambda: dd.CacheKey(1, 2, 0, -1), ValueError, None),
    (
        "cachekey.prefix_id-over-uint64",
        lambda: dd.CacheKey(1, 2, prefix_id=2**64),
        ValueError,
        None,
    ),
    ("cachekey.cluster_id-str", lambda: dd.CacheKey("1", 2), TypeError, None),
    ("cachekey.req_id-float", lambda: dd.CacheKey(1, 2.0), TypeError, None),
    ("cachekey.pull-both-ids-valid", pull_check(1, 2, prefix_id=3), dd.LLMException, PARAM),
    ("cachekey.pull-no-id-valid", pull_check(1, U64), dd.LLMException, PARAM),
    ("cachekey.pull-no-id-valid-explicit", pull_check(1, U64, 0, U64), dd.LLMException, PARAM),
    # §7 CacheKeyByIdAndIndex
    ("byid.cluster_id-negative", lambda: dd.CacheKeyByIdAndIndex(-1, 0), ValueError, None),
    ("byid.cluster_id-over-uint64", lambda: dd.CacheKeyByIdAndIndex(2**64, 0), ValueError, None),
    ("byid.cluster_id-str", lambda: dd.CacheKeyByIdAndIndex("1", 0), TypeError, None),
    ("byid.cache_id-over-int64", lambda: dd.CacheKeyByIdAndIndex(1, 2**63), ValueError, None),
    (
        "byid.cache_id-under-int64",
        lambda: dd.CacheKeyByIdAndIndex(1, -(2**63) - 1),
        ValueError,
        None,
    ),
    ("byid.cache_id-float", lambda: dd.CacheKeyByIdAndIndex(1, 0.0), TypeError, None),
    ("byid.batch_index-negative", lambda: dd.CacheKeyByIdAndIndex(1, 0, -1), ValueError, None),
    (
        "byid.batch_index-over-uint32",
        lambda: dd.CacheKeyByIdAndIndex(1, 0, 2**32),
        ValueError,
        None,
    ),
    ("byid.batch_index-str", lambda: dd.CacheKeyByIdAndIndex(1, 0, "0"), TypeError, None),
    # §7 BlocksCacheKey
    ("blockskey.three-positional", lambda: dd.BlocksCacheKey(1, 0, 0), dd.LLMException, PARAM),
    (
        "blockskey.three-mixed",
        lambda: dd.BlocksCacheKey(1, model_id=0, prompt_cluster_id=1),
        dd.LLMException,
        PARAM,
    ),
    ("blockskey.cluster_id-str", lambda: dd.BlocksCacheKey("1"), TypeError, None),
    ("blockskey.cluster_id-float", lambda: dd.BlocksCacheKey(1.0), TypeError, None),
    ("blockskey.model_id-str", lambda: dd.BlocksCacheKey(1, "0"), TypeError, None),
    (
        "blockskey.prompt_cluster_id-str",
        lambda: dd.BlocksCacheKey(prompt_cluster_id="1"),
        TypeError,
        None,
    ),
    # §7 MemInfo
    ("meminfo.mem_type-int", lambda: dd.MemInfo(0, 4096, 1024), TypeError, None),
    (
        "meminfo.mem_type-placement",
        lambda: dd.MemInfo(dd.Placement.HOST, 4096, 1024),
        TypeError,
        None,
    ),
    (
        "meminfo.addr-str",
        lambda: dd.MemInfo(dd.Memtype.MEM_TYPE_HOST, "4096", 1024),
        TypeError,
        None,
    ),
    (
        "meminfo.size-float",
        lambda: dd.MemInfo(dd.Memtype.MEM_TYPE_HOST, 4096, 1024.0),
        TypeError,
        None,
    ),
    # §7 TransferConfig
    ("tc.dst_cluster_id-negative", lambda: dd.TransferConfig(-1, [10, 20]), ValueError, None),
    (
        "tc.dst_cluster_id-over-uint64",
        lambda: dd.TransferConfig(2**64, [10, 20]),
        ValueError,
        None,
    ),
    ("tc.dst_cluster_id-str", lambda: dd.TransferConfig("1", [10, 20]), TypeError, None),
    ("tc.dst_addrs-int", lambda: dd.TransferConfig(1, 10), TypeError, None),
    ("tc.dst_addrs-str-item", lambda: dd.TransferConfig(1, [10, "20"]), TypeError, None),
    ("tc.dst_addrs-negative-item", lambda: dd.TransferConfig(1, [10, -1]), ValueError, None),
    (
        "tc.dst_addrs-item-over-uint64",
        lambda: dd.TransferConfig(1, (10, 2**64)),
        ValueError,
        None,
    ),
    ("tc.src_layer_range-list", lambda: dd.TransferConfig(1, [10, 20], [0]), TypeError, None),
    (
        "tc.src_layer_range-step-2",
        lambda: dd.TransferConfig(1, [10, 20, 30, 40], range(0, 4, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.src_layer_range-reversed",
        lambda: dd.TransferConfig(1, [10, 20], range(1, 0, -1)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.src_layer_range-empty",
        lambda: dd.TransferConfig(1, [], range(2, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.src_layer_range-start-after-stop",
        lambda: dd.TransferConfig(1, [], range(3, 1)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.src_layer_range-negative-start",
        lambda: dd.TransferConfig(1, [10, 20, 30, 40], range(-1, 1)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.src_batch_index-negative",
        lambda: dd.TransferConfig(1, [10, 20], None, -1),
        ValueError,
        None,
    ),
    (
        "tc.src_batch_index-over-uint32",
        lambda: dd.TransferConfig(1, [10, 20], None, 2**32),
        ValueError,
        None,
    ),
    (
        "tc.set-dst_cluster_id-negative",
        lambda: set_attr(transfer_config(), "dst_cluster_id", -1),
        ValueError,
        None,
    ),
    (
        "tc.set-dst_addrs-negative-item",
        lambda: set_attr(transfer_config(), "dst_addrs", [-1, 0]),
        ValueError,
        None,
    ),
    (
        "tc.set-dst_addrs-str",
        lambda: set_attr(transfer_config(), "dst_addrs", "10,20"),
        TypeError,
        None,
    ),
    (
        "tc.set-src_layer_range-step-2",
        lambda: set_attr(transfer_config(), "src_layer_range", range(0, 4, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.set-src_layer_range-empty",
        lambda: set_attr(transfer_config(), "src_layer_range", range(1, 1)),
        dd.LLMException,
        PARAM,
    ),
    (
        "tc.set-src_batch_index-negative",
        lambda: set_attr(transfer_config(), "src_batch_index", -1),
        ValueError,
        None,
    ),
    # §7 TransferWithCacheKeyConfig
    (
        "twck.cache_key-CacheKey",
        lambda: dd.TransferWithCacheKeyConfig(dd.CacheKey(1, 2), range(0, 1), range(0, 1)),
        TypeError,
        None,
    ),
    (
        "twck.cache_key-int",
        lambda: dd.TransferWithCacheKeyConfig(1, range(0, 1), range(0, 1)),
        TypeError,
        None,
    ),
    (
        "twck.src_layer_range-None",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), None, range(0, 1)),
        TypeError,
        None,
    ),
    (
        "twck.dst_layer_range-None",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(0, 1), None),
        TypeError,
        None,
    ),
    (
        "twck.both-ranges-None",
        lambda: dd.TransferWithCacheKeyConfig(dd.CacheKeyByIdAndIndex(1, 0), None, None),
        TypeError,
        None,
    ),
    (
        "twck.src_layer_range-step-2",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(0, 4, 2), range(0, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.dst_layer_range-step-2",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(0, 2), range(0, 4, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.src_layer_range-empty",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(2, 2), range(2, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.dst_layer_range-start-after-stop",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(0, 2), range(3, 1)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.dst_layer_range-negative-start",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(0, 2), range(-1, 1)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.unequal-lengths",
        lambda: dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(1), range(0, 2), range(0, 3)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.unequal-lengths-byid",
        lambda: dd.TransferWithCacheKeyConfig(
            dd.CacheKeyByIdAndIndex(1, 0), range(0, 3), range(1, 3)
        ),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.blocks-key-batch-index-1",
        lambda: keyed_config(dd.BlocksCacheKey(5, 1), src_batch_index=1),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.set-src_layer_range-step-2",
        lambda: set_attr(keyed_config(), "src_layer_range", range(0, 4, 2)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.set-dst_layer_range-empty",
        lambda: set_attr(keyed_config(), "dst_layer_range", range(3, 3)),
        dd.LLMException,
        PARAM,
    ),
    (
        "twck.set-cache_key-CacheKey",
        lambda: set_attr(keyed_config(), "cache_key", dd.CacheKey(1, 2)),
        TypeError,
        None,
    ),
]


# ----------------------------------------------------------------------------------------------
# calls that must NOT raise, with the value each must produce

LLM_ROLE = {"PROMPT": 1, "DECODER": 2, "MIX": 3}
PLACEMENT = {"HOST": 0, "DEVICE": 1}
DATA_TYPES = {  # member: (value, bytes per element)
    "DT_FLOAT": (0, 4),
    "DT_FLOAT16": (1, 2),
    "DT_INT8": (2, 1),
    "DT_INT32": (3, 4),
    "DT_UINT8": (4, 1),
    "DT_INT16": (6, 2),
    "DT_UINT16": (7, 2),
    "DT_UINT32": (8, 4),
    "DT_INT64": (9, 8),
    "DT_UINT64": (10, 8),
    "DT_DOUBLE": (11, 8),
    "DT_BOOL": (12, 1),
    "DT_STRING": (13, None),
    "DT_BF16": (27, 2),
}
MEMTYPE = {"MEM_TYPE_DEVICE": 0, "MEM_TYPE_HOST": 1}
REGISTER_MEM_STATUS = {"OK": 0, "PREPARING": 1, "FAILED": 2}
PUSH_TYPE = {"NO_CACHE_KEY": 0, "BLOCKS_CACHE_KEY": 1, "CACHE_KEY_BY_ID": 2}
STATUS_CODES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 0xFFFFFFFF,
    "LLM_WAIT_PROCESS_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002,
    "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004,
    "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006,
    "LLM_NOT_YET_LINK": 0x5010B007,
    "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009,
    "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D,
    "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F,
    "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LENOVERLIMIT": 0x5010B011,
    "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013,
    "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019,
    "LLM_TIMEOUT": 0x5010B01A,
    "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}


def enum_rows(
    prefix: str, enum_cls: type[enum.Enum], members: dict[str, int]
) -> list[tuple[str, Call, Any]]:
    rows: list[tuple[str, Call, Any]] = [
        (f"{prefix}.{name}", lambda n=name: enum_cls[n].value, value)
        for name, value in members.items()
    ]
    rows.append((f"{prefix}.members", lambda: list(enum_cls.__members__), list(members)))
    return rows


def itemsize_rows() -> list[tuple[str, Call, Any]]:
    """``CacheDesc.size`` is prod(shape) x element size, per the §2 table."""
    return [
        (
            f"DataType.{name}.bytes",
            lambda n=name: dd.CacheDesc(1, [3, 5], dd.DataType[n]).size,
            15 * size,
        )
        for name, (_, size) in DATA_TYPES.items()
        if size is not None
    ]


VALUE_ROWS: list[tuple[str, Call, Any]] = [
    # §2 enums: values, member lists, IntEnum-ness, str() forms
    *enum_rows("LLMRole", dd.LLMRole, LLM_ROLE),
    *enum_rows("Placement", dd.Placement, PLACEMENT),
    *enum_rows("DataType", dd.DataType, {k: v for k, (v, _) in DATA_TYPES.items()}),
    *itemsize_rows(),
    *enum_rows("Memtype", dd.Memtype, MEMTYPE),
    *enum_rows("RegisterMemStatus", dd.RegisterMemStatus, REGISTER_MEM_STATUS),
    *enum_rows("PushType", dd.PushType, PUSH_TYPE),
    *enum_rows("LLMStatusCode", dd.LLMStatusCode, STATUS_CODES),
    ("LLMRole.is-IntEnum", lambda: issubclass(dd.LLMRole, enum.IntEnum), True),
    ("Placement.is-IntEnum", lambda: issubclass(dd.Placement, enum.IntEnum), True),
    ("LLMStatusCode.is-IntEnum", lambda: issubclass(dd.LLMStatusCode, enum.IntEnum), True),
    ("DataType.is-Enum", lambda: issubclass(dd.DataType, enum.Enum), True),
    ("Memtype.is-Enum", lambda: issubclass(dd.Memtype, enum.Enum), True),
    ("RegisterMemStatus.is-Enum", lambda: issubclass(dd.RegisterMemStatus, enum.Enum), True),
    ("LLMRole.PROMPT.str", lambda: str(dd.LLMRole.PROMPT), "LLMRole.PROMPT"),
    ("LLMRole.DECODER.str", lambda: str(dd.LLMRole.DECODER), "LLMRole.DECODER"),
    ("LLMRole.MIX.str", lambda: str(dd.LLMRole.MIX), "LLMRole.MIX"),
    ("LLMRole.PROMPT.fstring", lambda: f"{dd.LLMRole.PROMPT}", "LLMRole.PROMPT"),
    ("LLMStatusCode.str-success", lambda: str(S.LLM_SUCCESS), "LLMStatusCode.LLM_SUCCESS"),
    ("LLMStatusCode.str-param", lambda: str(PARAM), "LLMStatusCode.LLM_PARAM_INVALID"),
    ("LLMStatusCode.str-timeout", lambda: str(S.LLM_TIMEOUT), "LLMStatusCode.LLM_TIMEOUT"),
    (
        "LLMStatusCode.no-cpp-only-members",
        lambda: sorted(
            n
            for n in (
                "LLM_CACHE_INCOMPATIBLE",
                "LLM_CACHE_KEY_ALREADY_EXIST",
                "LLM_COPY_CACHE_FAILED",
                "LLM_CACHE_ID_ALREADY_EXIST",
            )
            if n in dd.LLMStatusCode.__members__
        ),
        [],
    ),
    # §3 error model
    ("LLMException.is-RuntimeError", lambda: issubclass(dd.LLMException, RuntimeError), True),
    (
        "LLMException.status_code-kw",
        lambda: dd.LLMException("x", status_code=S.LLM_TIMEOUT).status_code,
        S.LLM_TIMEOUT,
    ),
    ("LLMException.default-success", lambda: dd.LLMException("x").status_code, S.LLM_SUCCESS),
    ("LLMException.no-args-default", lambda: dd.LLMException().status_code, S.LLM_SUCCESS),
    ("LLMException.args", lambda: dd.LLMException("a", "b", status_code=PARAM).args, ("a", "b")),
    (
        "LLMException.status_code-keyword-only",
        lambda: dd.LLMException("a", PARAM).status_code,
        S.LLM_SUCCESS,
    ),
    ("Status.is_ok-success", lambda: dd.Status(S.LLM_SUCCESS).is_ok(), True),
    ("Status.is_ok-failed", lambda: dd.Status(S.LLM_FAILED).is_ok(), False),
    ("Status.is_ok-param", lambda: dd.Status(PARAM).is_ok(), False),
    ("Status.status_code", lambda: dd.Status(S.LLM_TIMEOUT).status_code, S.LLM_TIMEOUT),
    # §4 LLMConfig: defaults and exactly which keys each property emits
    ("cfg.LlmConfig-alias", lambda: dd.LlmConfig is dd.LLMConfig, True),
    ("cfg.unset-emits-only-MemoryUtilization", lambda: opts(), {MU: "0.95"}),
    ("cfg.default-ge_options", lambda: dd.LLMConfig().ge_options, {}),
    ("cfg.default-device_id", lambda: dd.LLMConfig().device_id, None),
    ("cfg.default-sync_kv_timeout", lambda: dd.LLMConfig().sync_kv_timeout, None),
    ("cfg.default-deploy_res_path", lambda: dd.LLMConfig().deploy_res_path, ""),
    ("cfg.default-buf_pool_cfg", lambda: dd.LLMConfig().buf_pool_cfg, ""),
    ("cfg.default-mem_pool_cfg", lambda: dd.LLMConfig().mem_pool_cfg, ""),
    ("cfg.default-host_mem_pool_cfg", lambda: dd.LLMConfig().host_mem_pool_cfg, ""),
    ("cfg.default-listen_ip_info", lambda: dd.LLMConfig().listen_ip_info, ""),
    ("cfg.default-enable_switch_role", lambda: dd.LLMConfig().enable_switch_role, False),
    ("cfg.default-mem_utilization", lambda: dd.LLMConfig().mem_utilization, 0.95),
    ("cfg.ge_options", lambda: opts(ge_options={"ge.a": "1"}), {"ge.a": "1", MU: "0.95"}),
    ("cfg.ge_options-empty", lambda: opts(ge_options={}), {MU: "0.95"}),
    (
        "cfg.ge_options-merged-first",
        lambda: keys(device_id=0, ge_options={"ge.a": "1"}),
        ["ge.a", "ge.exec.deviceId", "ge.session_device_id", MU],
    ),
    (
        "cfg.ge_options-overridden-by-property",
        lambda: opts(ge_options={"ge.exec.deviceId": "9"}, device_id=2)["ge.exec.deviceId"],
        "2",
    ),
    (
        "cfg.device_id-int",
        lambda: opts(device_id=3),
        {"ge.exec.deviceId": "3", "ge.session_device_id": "3", MU: "0.95"},
    ),
    ("cfg.device_id-0", lambda: opts(device_id=0)["ge.exec.deviceId"], "0"),
    ("cfg.device_id-int32-max", lambda: opts(device_id=I32)["ge.session_device_id"], str(I32)),
    (
        "cfg.device_id-list",
        lambda: opts(device_id=[2, 3]),
        {"ge.session_device_id": "2", "ge.exec.deviceId": "2;3", MU: "0.95"},
    ),
    (
        "cfg.device_id-tuple",
        lambda: opts(device_id=(4, 5, 6)),
        {"ge.session_device_id": "4", "ge.exec.deviceId": "4;5;6", MU: "0.95"},
    ),
    (
        "cfg.sync_kv_timeout-int",
        lambda: opts(sync_kv_timeout=5000),
        {"llm.SyncKvCacheWaitTime": "5000", MU: "0.95"},
    ),
    (
        "cfg.sync_kv_timeout-digit-str",
        lambda: opts(sync_kv_timeout="3000"),
        {"llm.SyncKvCacheWaitTime": "3000", MU: "0.95"},
    ),
    ("cfg.sync_kv_timeout-1", lambda: opts(sync_kv_timeout=1)["llm.SyncKvCacheWaitTime"], "1"),
    (
        "cfg.sync_kv_timeout-int32-max",
        lambda: opts(sync_kv_timeout=I32)["llm.SyncKvCacheWaitTime"],
        str(I32),
    ),
    (
        "cfg.deploy_res_path",
        lambda: opts(deploy_res_path="/tmp/res"),
        {"llm.deployResPath": "/tmp/res", MU: "0.95"},
    ),
    (
        "cfg.buf_pool_cfg",
        lambda: opts(buf_pool_cfg='{"total_size": 1}'),
        {"llm.BufPoolCfg": '{"total_size": 1}', MU: "0.95"},
    ),
    (
        "cfg.mem_pool_cfg",
        lambda: opts(mem_pool_cfg='{"memory_size": 1024}'),
        {"llm.MemPoolConfig": '{"memory_size": 1024}', MU: "0.95"},
    ),
    (
        "cfg.host_mem_pool_cfg",
        lambda: opts(host_mem_pool_cfg='{"memory_size": 1024}'),
        {"llm.HostMemPoolConfig": '{"memory_size": 1024}', MU: "0.95"},
    ),
    (
        "cfg.enable_cache_manager-true",
        lambda: opts(enable_cache_manager=True),
        {"llm.EnableCacheManager": "1", MU: "0.95"},
    ),
    (
        "cfg.enable_cache_manager-false",
        lambda: opts(enable_cache_manager=False),
        {"llm.EnableCacheManager": "0", MU: "0.95"},
    ),
    (
        "cfg.enable_remote_cache_accessible-true",
        lambda: opts(enable_remote_cache_accessible=True),
        {"llm.EnableRemoteCacheAccessible": "1", MU: "0.95"},
    ),
    (
        "cfg.enable_remote_cache_accessible-false",
        lambda: opts(enable_remote_cache_accessible=False),
        {"llm.EnableRemoteCacheAccessible": "0", MU: "0.95"},
    ),
    (
        "cfg.listen_ip_info-lower-case-key",
        lambda: opts(listen_ip_info="127.0.0.1:26000"),
        {"llm.listenIpInfo": "127.0.0.1:26000", MU: "0.95"},
    ),
    (
        "cfg.link_total_time",
        lambda: opts(link_total_time=30),
        {"llm.LinkTotalTime": "30", MU: "0.95"},
    ),
    ("cfg.link_total_time-0", lambda: opts(link_total_time=0)["llm.LinkTotalTime"], "0"),
    (
        "cfg.link_total_time-uint32-max",
        lambda: opts(link_total_time=U32)["llm.LinkTotalTime"],
        str(U32),
    ),
    (
        "cfg.link_retry_count",
        lambda: opts(link_retry_count=3),
        {"llm.LinkRetryCount": "3", MU: "0.95"},
    ),
    ("cfg.link_retry_count-1", lambda: opts(link_retry_count=1)["llm.LinkRetryCount"], "1"),
    ("cfg.link_retry_count-100", lambda: opts(link_retry_count=100)["llm.LinkRetryCount"], "100"),
    (
        "cfg.rdma_traffic_class",
        lambda: opts(rdma_traffic_class=132),
        {"llm.RdmaTrafficClass": "132", MU: "0.95"},
    ),
    (
        "cfg.rdma_traffic_class-uint32-max",
        lambda: opts(rdma_traffic_class=U32)["llm.RdmaTrafficClass"],
        str(U32),
    ),
    (
        "cfg.rdma_service_level",
        lambda: opts(rdma_service_level=4),
        {"llm.RdmaServiceLevel": "4", MU: "0.95"},
    ),
    (
        "cfg.rdma_service_level-0",
        lambda: opts(rdma_service_level=0)["llm.RdmaServiceLevel"],
        "0",
    ),
    (
        "cfg.local_comm_res-empty-still-emitted",
        lambda: opts(local_comm_res=""),
        {"llm.LocalCommRes": "", MU: "0.95"},
    ),
    (
        "cfg.local_comm_res-json",
        lambda: opts(local_comm_res='{"version": "1.3"}'),
        {"llm.LocalCommRes": '{"version": "1.3"}', MU: "0.95"},
    ),
    (
        "cfg.transfer_backend",
        lambda: opts(transfer_backend="hixl"),
        {"llm.TransferBackend": "hixl", MU: "0.95"},
    ),
    (
        "cfg.global_resource_config",
        lambda: opts(global_resource_config='{"a": 1}'),
        {"llm.GlobalResourceConfig": '{"a": 1}', MU: "0.95"},
    ),
    ("cfg.cluster_info-key", lambda: "llm.ClusterInfo" in opts(cluster_info="{}"), True),
    ("cfg.cluster_info-ip-str-to-int", cluster_info_ip, int),
    (
        "cfg.output_max_size",
        lambda: opts(output_max_size=4096),
        {"llm.OutputMaxSize": "4096", MU: "0.95"},
    ),
    (
        "cfg.enable_switch_role-true",
        lambda: opts(enable_switch_role=True),
        {"llm.EnableSwitchRole": "1", MU: "0.95"},
    ),
    ("cfg.enable_switch_role-false", lambda: opts(enable_switch_role=False), {MU: "0.95"}),
    ("cfg.mem_utilization", lambda: opts(mem_utilization=0.5), {MU: "0.5"}),
    ("cfg.mem_utilization-0", lambda: opts(mem_utilization=0.0)[MU], "0.0"),
    ("cfg.mem_utilization-1", lambda: opts(mem_utilization=1.0)[MU], "1.0"),
    ("cfg.key-order", lambda: list(full_config().generate_options()), FULL_ORDER),
    (
        "cfg.all-values-str",
        lambda: sorted(
            k for k, v in full_config().generate_options().items() if type(v) is not str
        ),
        [],
    ),
    ("cfg.same-dict-every-call", same_dict_each_call, True),
    ("cfg.gen_options-alias", gen_options_alias, True),
    (
        "cfg.repeated-calls-accumulate",
        accumulated,
        {
            "llm.listenIpInfo": "127.0.0.1:26000",
            "llm.EnableSwitchRole": "1",
            MU: "0.95",
            "ge.exec.deviceId": "3",
            "ge.session_device_id": "3",
        },
    ),
    (
        "cfg.vllm-ascend-keys",
        lambda: dict(vllm_ascend_config().generate_options()),
        VLLM_ASCEND_OPTIONS,
    ),
    (
        "cfg.vllm-ascend-keys-parse",
        lambda: (
            (p := parse_options(dict(vllm_ascend_config().generate_options()))).cache_manager,
            p.remote_accessible,
            p.sync_kv_timeout_ms,
            p.listen,
        ),
        (True, True, 33000, None),
    ),
    # §5 LLMClusterInfo
    ("cluster.default-remote_cluster_id", lambda: dd.LLMClusterInfo().remote_cluster_id, None),
    ("cluster.default-local-list", lambda: dd.LLMClusterInfo().local_ip_info_list, []),
    ("cluster.default-remote-list", lambda: dd.LLMClusterInfo().remote_ip_info_list, []),
    (
        "cluster.remote_cluster_id-uint64-max",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_cluster_id", U64).remote_cluster_id,
        U64,
    ),
    (
        "cluster.remote_cluster_id-0",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_cluster_id", 0).remote_cluster_id,
        0,
    ),
    (
        "cluster.remote_role_type-role",
        lambda: (
            set_attr(dd.LLMClusterInfo(), "remote_role_type", dd.LLMRole.DECODER).remote_role_type
        ),
        dd.LLMRole.DECODER,
    ),
    (
        "cluster.remote_role_type-int",
        lambda: set_attr(dd.LLMClusterInfo(), "remote_role_type", 1).remote_role_type,
        1,
    ),
    (
        "cluster.local-ip-little-endian",
        lambda: cluster(("append_local_ip_info", ("192.168.1.2", 26000))).local_ip_info_list,
        [(0x0201A8C0, 26000)],
    ),
    (
        "cluster.remote-ip-little-endian",
        lambda: cluster(("append_remote_ip_info", ("10.0.0.1", 80))).remote_ip_info_list,
        [(0x0100000A, 80)],
    ),
    (
        "cluster.ip-inet_aton-short-form",
        lambda: cluster(("append_remote_ip_info", ("127.1", 80))).remote_ip_info_list,
        [(0x0100007F, 80)],
    ),
    (
        "cluster.ip-int-passthrough",
        lambda: cluster(("append_remote_ip_info", (0x0100007F, 8080))).remote_ip_info_list,
        [(0x0100007F, 8080)],
    ),
    (
        "cluster.port-0-and-65535",
        lambda: (
            cluster(
                ("append_local_ip_info", ("127.0.0.1", 0)),
                ("append_local_ip_info", ("127.0.0.2", 65535)),
            ).local_ip_info_list
        ),
        [(0x0100007F, 0), (0x0200007F, 65535)],
    ),
    (
        "cluster.lists-kept-apart",
        lambda: (
            (c := cluster(("append_local_ip_info", ("127.0.0.1", 1)))).local_ip_info_list,
            c.remote_ip_info_list,
        ),
        ([(0x0100007F, 1)], []),
    ),
    # §6 LLMDataDist(role, cluster_id)
    (
        "datadist.cluster_id-uint64-max",
        lambda: dd.LLMDataDist(dd.LLMRole.DECODER, U64).cluster_id,
        U64,
    ),
    ("datadist.cluster_id-0", lambda: dd.LLMDataDist(dd.LLMRole.MIX, 0).cluster_id, 0),
    ("datadist.cluster_id-prompt", lambda: dd.LLMDataDist(dd.LLMRole.PROMPT, 7).cluster_id, 7),
    # §6 init steps 1-5 (parse_options)
    (
        "options.empty",
        lambda: (
            (p := parse_options({})).cache_manager,
            p.remote_accessible,
            p.listen,
            p.sync_kv_timeout_ms,
        ),
        (False, False, None, 1000),
    ),
    (
        "options.cm-alone-no-remote-default",
        lambda: (
            (p := parse_options(cm())).cache_manager,
            p.remote_accessible,
        ),
        (True, False),
    ),
    (
        "options.LocalCommRes-defaults",
        lambda: (
            (p := parse_options({"llm.LocalCommRes": ""})).cache_manager,
            p.remote_accessible,
            p.local_comm_res,
        ),
        (True, True, ""),
    ),
    (
        "options.LocalCommRes-caller-remote-off",
        lambda: (
            (
                p := parse_options({"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"})
            ).cache_manager,
            p.remote_accessible,
        ),
        (True, False),
    ),
    (
        "options.LocalCommRes-explicit-cm",
        lambda: parse_options({"llm.LocalCommRes": "{}", **cm()}).cache_manager,
        True,
    ),
    (
        "options.input-not-modified",
        parse_unmodified,
        {
            "llm.LocalCommRes": "",
            "llm.listenIpInfo": "127.0.0.1:26000",
        },
    ),
    (
        "options.flowGraphMemMaxSize-digits",
        lambda: parse_options({"ge.flowGraphMemMaxSize": "1073741824"}).cache_manager,
        False,
    ),
    (
        "options.TransferBackend-valid",
        lambda: (
            (
                p := parse_options(
                    cm(**{"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:26000"})
                )
            ).remote_accessible,
            p.listen,
        ),
        (True, ("127.0.0.1", 26000)),
    ),
    (
        "options.TransferBackend-via-LocalCommRes",
        lambda: (
            parse_options(
                {
                    "llm.LocalCommRes": "",
                    "llm.TransferBackend": "hixl",
                    "llm.listenIpInfo": "10.0.0.1:26000",
                }
            ).remote_accessible
        ),
        True,
    ),
    (
        "options.cm-listen-split",
        lambda: parse_options(cm(**{"llm.listenIpInfo": "10.1.2.3:26000"})).listen,
        ("10.1.2.3", 26000),
    ),
    (
        "options.kvm-listen-several-addresses",
        lambda: (
            parse_options({"llm.listenIpInfo": "127.0.0.1:26000;127.0.0.1:26001"}).cache_manager
        ),
        False,
    ),
    (
        "options.SyncKvCacheWaitTime",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": "5000"}).sync_kv_timeout_ms,
        5000,
    ),
    (
        "options.SyncKvCacheWaitTime-1",
        lambda: parse_options({"llm.SyncKvCacheWaitTime": "1"}).sync_kv_timeout_ms,
        1,
    ),
    ("options.Transport-auto", lambda: parse_options({"llm.Transport": "auto"}).transport, "auto"),
    ("options.Transport-tcp", lambda: parse_options({"llm.Transport": "tcp"}).transport, "tcp"),
    (
        "options.Transport-same-host",
        lambda: parse_options({"llm.Transport": "same-host"}).transport,
        "same-host",
    ),
    (
        "options.MemPoolConfig-default-page_shift",
        lambda: read_pool("llm.MemPoolConfig", pool(1 << 20)),
        (1 << 20, 16),
    ),
    (
        "options.MemPoolConfig-page_shift-10",
        lambda: read_pool("llm.MemPoolConfig", pool(1 << 20, 10)),
        (1 << 20, 10),
    ),
    (
        "options.MemPoolConfig-page_shift-30",
        lambda: read_pool("llm.MemPoolConfig", pool(1 << 30, 30)),
        (1 << 30, 30),
    ),
    (
        "options.MemPoolConfig-pages-2^32-1",
        lambda: read_pool("llm.MemPoolConfig", pool(2**42 - 1, 10)),
        (2**42 - 1, 10),
    ),
    (
        "options.HostMemPoolConfig",
        lambda: read_pool("llm.HostMemPoolConfig", pool(1 << 24, 12)),
        (1 << 24, 12),
    ),
    # §7 CacheDesc
    (
        "desc.defaults",
        lambda: (
            (d := desc(2, [4, 8], dd.DataType.DT_FLOAT16)).num_tensors,
            list(d.shape),
            d.data_type,
            d.placement,
            d.batch_dim,
            d.seq_len_dim_index,
            d.kv_tensor_format,
        ),
        (2, [4, 8], dd.DataType.DT_FLOAT16, dd.Placement.DEVICE, 0, -1, None),
    ),
    ("desc.size-one-tensor", lambda: desc(3, [4, 8, 16], dd.DataType.DT_FLOAT16).size, 1024),
    ("desc.shape-tuple", lambda: list(desc(shape=(2, 3)).shape), [2, 3]),
    ("desc.num_tensors-0", lambda: desc(0).num_tensors, 0),
    ("desc.num_tensors-uint32-max", lambda: desc(U32).num_tensors, U32),
    (
        "desc.batch_size-follows-batch_dim_index",
        lambda: (
            (d := desc(shape=[4, 8, 16], batch_dim_index=1)).batch_size,
            d.batch_dim,
        ),
        (8, 1),
    ),
    ("desc.batch_size-default", lambda: desc(shape=[6, 8]).batch_size, 6),
    ("desc.batch_dim_index-last", lambda: desc(shape=[4, 8], batch_dim_index=1).batch_dim, 1),
    (
        "desc.seq_len_dim_index-in-range",
        lambda: desc(shape=[4, 8], seq_len_dim_index=1).seq_len_dim_index,
        1,
    ),
    (
        "desc.placement-host",
        lambda: desc(placement=dd.Placement.HOST).placement,
        dd.Placement.HOST,
    ),
    ("desc.kv_tensor_format", lambda: desc(kv_tensor_format="BSND").kv_tensor_format, "BSND"),
    ("desc.update_dim-resets-size", updated_desc, (128, [8, 8], 256)),
    # §7 Cache.create_cpu_cache
    (
        "cpu_cache.fields",
        lambda: ((c := cpu_cache()).cache_id, c.tensor_addrs, c.is_blocks_cache),
        (-1, [4096, 8192], True),
    ),
    (
        "cpu_cache.desc",
        lambda: (
            (c := dd.Cache.create_cpu_cache(host_desc(1), [4096])).cache_desc.num_tensors,
            c.cache_desc.placement,
        ),
        (1, dd.Placement.HOST),
    ),
    # §7 CacheKey
    (
        "cachekey.positional-order",
        lambda: (
            (k := dd.CacheKey(1, 2, 3, 4)).cluster_id,
            k.req_id,
            k.model_id,
            k.prefix_id,
        ),
        (1, 2, 3, 4),
    ),
    (
        "cachekey.defaults",
        lambda: ((k := dd.CacheKey(1, 2)).model_id, k.prefix_id),
        (0, U64),
    ),
    (
        "cachekey.keywords",
        lambda: (
            (k := dd.CacheKey(prefix_id=4, model_id=3, req_id=2, cluster_id=1)).cluster_id,
            k.req_id,
            k.model_id,
            k.prefix_id,
        ),
        (1, 2, 3, 4),
    ),
    (
        "cachekey.prompt_cluster_id-alias",
        lambda: (
            (k := dd.CacheKey(prompt_cluster_id=7, req_id=2)).cluster_id,
            k.prompt_cluster_id,
        ),
        (7, 7),
    ),
    (
        "cachekey.prompt_cluster_id-four-params",
        lambda: dd.CacheKey(prompt_cluster_id=7, req_id=2, model_id=1, prefix_id=3).prefix_id,
        3,
    ),
    ("cachekey.cluster_id-property-alias", lambda: dd.CacheKey(9, 2).prompt_cluster_id, 9),
    (
        "cachekey.uint64-max-fields",
        lambda: (
            (k := dd.CacheKey(U64, U64, U64, U64)).cluster_id,
            k.req_id,
            k.model_id,
            k.prefix_id,
        ),
        (U64, U64, U64, U64),
    ),
    ("cachekey.zero-fields", lambda: dd.CacheKey(0, 0, 0, 0).req_id, 0),
    ("cachekey.pull-req_id", lambda: pullable(1, 2), True),
    ("cachekey.pull-req_id-0", lambda: pullable(1, 0), True),
    ("cachekey.pull-prefix", lambda: pullable(1, U64, prefix_id=0), True),
    ("cachekey.pull-prefix-with-model", lambda: pullable(1, U64, 2, 5), True),
    # §7 CacheKeyByIdAndIndex
    (
        "byid.fields",
        lambda: (
            (k := dd.CacheKeyByIdAndIndex(1, 2, 3)).cluster_id,
            k.cache_id,
            k.batch_index,
        ),
        (1, 2, 3),
    ),
    ("byid.default-batch_index", lambda: dd.CacheKeyByIdAndIndex(1, 2).batch_index, 0),
    ("byid.cache_id-negative-int64", lambda: dd.CacheKeyByIdAndIndex(1, -1).cache_id, -1),
    (
        "byid.limits",
        lambda: (
            (k := dd.CacheKeyByIdAndIndex(U64, -(2**63), U32)).cluster_id,
            k.cache_id,
            k.batch_index,
        ),
        (U64, -(2**63), U32),
    ),
    ("byid.cache_id-int64-max", lambda: dd.CacheKeyByIdAndIndex(0, I64).cache_id, I64),
    ("byid.keywords", lambda: dd.CacheKeyByIdAndIndex(cluster_id=1, cache_id=2).cache_id, 2),
    # §7 BlocksCacheKey
    (
        "blockskey.positional-order",
        lambda: ((k := dd.BlocksCacheKey(5, 2)).cluster_id, k.model_id),
        (5, 2),
    ),
    ("blockskey.default-model_id", lambda: dd.BlocksCacheKey(5).model_id, 0),
    (
        "blockskey.prompt_cluster_id-alias",
        lambda: ((k := dd.BlocksCacheKey(prompt_cluster_id=6, model_id=1)).cluster_id, k.model_id),
        (6, 1),
    ),
    ("blockskey.keyword-cluster_id", lambda: dd.BlocksCacheKey(cluster_id=8).cluster_id, 8),
    (
        "blockskey.no-range-check",
        lambda: ((k := dd.BlocksCacheKey(-1, 2**70)).cluster_id, k.model_id),
        (-1, 2**70),
    ),
    # §7 MemInfo
    (
        "meminfo.fields",
        lambda: (
            (m := dd.MemInfo(dd.Memtype.MEM_TYPE_HOST, 4096, 1024)).mem_type,
            m.addr,
            m.size,
        ),
        (dd.Memtype.MEM_TYPE_HOST, 4096, 1024),
    ),
    (
        "meminfo.device",
        lambda: dd.MemInfo(dd.Memtype.MEM_TYPE_DEVICE, 0, 0).mem_type,
        dd.Memtype.MEM_TYPE_DEVICE,
    ),
    # §7 TransferConfig
    (
        "tc.fields",
        lambda: (
            (t := dd.TransferConfig(3, [10, 20, 30, 40], range(1, 3), 2)).dst_cluster_id,
            list(t.dst_addrs),
            t.src_layer_range,
            t.src_batch_index,
            t.dst_layer_range,
        ),
        (3, [10, 20, 30, 40], range(1, 3), 2, None),
    ),
    (
        "tc.defaults",
        lambda: ((t := dd.TransferConfig(1, (10, 20))).src_layer_range, t.src_batch_index),
        (None, 0),
    ),
    ("tc.dst_addrs-tuple", lambda: list(dd.TransferConfig(1, (10, 20)).dst_addrs), [10, 20]),
    (
        "tc.limits",
        lambda: (
            (t := dd.TransferConfig(U64, [U64, 0], None, U32)).dst_cluster_id,
            list(t.dst_addrs),
            t.src_batch_index,
        ),
        (U64, [U64, 0], U32),
    ),
    (
        "tc.setters",
        lambda: (
            (
                t := set_attr(
                    set_attr(
                        set_attr(
                            set_attr(transfer_config(), "dst_cluster_id", 9), "dst_addrs", [7]
                        ),
                        "src_layer_range",
                        range(2, 3),
                    ),
                    "src_batch_index",
                    4,
                )
            ).dst_cluster_id,
            list(t.dst_addrs),
            t.src_layer_range,
            t.src_batch_index,
        ),
        (9, [7], range(2, 3), 4),
    ),
    (
        "tc.set-src_layer_range-None",
        lambda: set_attr(transfer_config(), "src_layer_range", None).src_layer_range,
        None,
    ),
    # §7 TransferWithCacheKeyConfig
    (
        "twck.blocks-key",
        lambda: (
            (t := keyed_config(dd.BlocksCacheKey(5, 1))).dst_cluster_id,
            t.src_layer_range,
            t.dst_layer_range,
            t.src_batch_index,
            t.cache_key,
        ),
        (5, range(0, 2), range(2, 4), 0, dd.BlocksCacheKey(5, 1)),
    ),
    (
        "twck.byid-key-batch-index",
        lambda: (
            (t := keyed_config(dd.CacheKeyByIdAndIndex(7, 3, 1), src_batch_index=2)).dst_cluster_id,
            t.src_batch_index,
        ),
        (7, 2),
    ),
    (
        "twck.set-ranges",
        lambda: (
            (
                t := set_attr(
                    set_attr(keyed_config(), "src_layer_range", range(4, 6)),
                    "dst_layer_range",
                    range(0, 2),
                )
            ).src_layer_range,
            t.dst_layer_range,
        ),
        (range(4, 6), range(0, 2)),
    ),
    (
        "twck.set-cache_key",
        lambda: set_attr(keyed_config(), "cache_key", dd.CacheKeyByIdAndIndex(8, 1)).dst_cluster_id,
        8,
    ),
]


def _ids(rows: list[tuple[Any, ...]]) -> list[Any]:
    ids = [row[0] for row in rows]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"duplicate row ids: {duplicates}"
    return [pytest.param(*row[1:], id=row[0]) for row in rows]


@pytest.mark.parametrize(("call", "exc", "code"), _ids(ERROR_ROWS))
def test_invalid_raises(call: Call, exc: Any, code: dd.LLMStatusCode | None) -> None:
    with pytest.raises(exc) as info:
        call()
    err = info.value
    if isinstance(err, dd.LLMException):
        assert code is not None, f"expected a plain {exc}, got LLMException({err.status_code})"
        assert err.status_code == code, f"{err!r}"


@pytest.mark.parametrize(("call", "expected"), _ids(VALUE_ROWS))
def test_valid_value(call: Call, expected: Any) -> None:
    assert call() == expected
