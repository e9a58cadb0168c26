"""``LLMConfig``: a validated holder that produces the option dict of reference §4."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._checks import (
    UINT32_MAX,
    check_int32,
    check_isinstance,
    check_uint32,
)
from ._errors import raise_if_false, raise_param

__all__ = ["LLMConfig", "LlmConfig", "legacy_device_options"]


def _prop(name: str, check: Any, doc: str) -> property:
    attr = "_" + name

    def getter(self: LLMConfig) -> Any:
        return getattr(self, attr)

    def setter(self: LLMConfig, value: Any) -> None:
        check(name, value)
        setattr(self, attr, value)

    return property(getter, setter, doc=doc)


def _str(name: str, value: Any) -> None:
    check_isinstance(name, value, str)


def _opt_str(name: str, value: Any) -> None:
    check_isinstance(name, value, str, optional=True)


def _opt_bool(name: str, value: Any) -> None:
    check_isinstance(name, value, bool, optional=True)


def _bool(name: str, value: Any) -> None:
    check_isinstance(name, value, bool)


def _ge_options(name: str, value: Any) -> None:
    check_isinstance(name, value, dict)
    for k, v in value.items():
        check_isinstance(f"{name} key", k, str)
        check_isinstance(f"{name}[{k!r}]", v, str)


def _device_id(name: str, value: Any) -> None:
    if value is None:
        return
    check_isinstance(name, value, (int, list, tuple))
    for v in value if isinstance(value, list | tuple) else [value]:
        check_int32(name, v)
        raise_if_false(v >= 0, f"{name} must be >= 0, got {v}")


def _sync_kv_timeout(name: str, value: Any) -> None:
    if value is None:
        return
    check_isinstance(name, value, (int, str))
    if isinstance(value, str):
        raise_if_false(value.isdigit(), f"{name} must be a positive integer, got {value!r}")
        value = int(value)
    check_int32(name, value)
    raise_if_false(value > 0, f"{name} must be > 0, got {value}")


def _link_total_time(name: str, value: Any) -> None:
    check_isinstance(name, value, int, optional=True)
    if value is not None:
        raise_if_false(0 <= value <= UINT32_MAX, f"{name} must be in [0, 2**32-1]")


def _link_retry_count(name: str, value: Any) -> None:
    check_isinstance(name, value, int, optional=True)
    if value is not None:
        raise_if_false(1 <= value <= 100, f"{name} must be in [1, 100], got {value}")


def _opt_uint32(name: str, value: Any) -> None:
    check_uint32(name, value, optional=True)


def _cluster_info(name: str, value: Any) -> None:
    if value is None:
        return
    check_isinstance(name, value, str)
    try:
        json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None


def _cluster_info_with_int_ips(value: str) -> str:
    """Upstream turns ``listen_ip_info[].ip`` text into its little-endian integer form."""
    from ._cluster import ip_to_int

    info = json.loads(value)
    if isinstance(info, dict):
        for item in info.get("listen_ip_info", []) or []:
            if isinstance(item, dict) and isinstance(item.get("ip"), str):
                item["ip"] = ip_to_int(item["ip"])
    return json.dumps(info)


def _opt_int(name: str, value: Any) -> None:
    check_isinstance(name, value, int, optional=True)


def _mem_utilization(name: str, value: Any) -> None:
    check_isinstance(name, value, (float, int))
    raise_if_false(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}")


class LLMConfig:
    """Holder of engine settings; :meth:`generate_options` returns the option dict.

    Like upstream, the dict is kept on the object: repeated calls accumulate keys.
    Our own settings (``transport``, ``auth_key``) use the same ``llm.`` prefix.
    """

    ge_options = _prop("ge_options", _ge_options, "Extra raw options, merged first.")
    device_id = _prop("device_id", _device_id, "Device index (int, or list for legacy mode).")
    sync_kv_timeout = _prop(
        "sync_kv_timeout", _sync_kv_timeout, "Transfer deadline in ms (engine default 1000)."
    )
    deploy_res_path = _prop("deploy_res_path", _str, "Legacy deploy resource path.")
    buf_pool_cfg = _prop("buf_pool_cfg", _str, "Legacy buffer pool JSON.")
    mem_pool_cfg = _prop("mem_pool_cfg", _str, 'Device pool JSON {"memory_size", "page_shift"}.')
    host_mem_pool_cfg = _prop("host_mem_pool_cfg", _str, "Host pool JSON, same format.")
    enable_cache_manager = _prop("enable_cache_manager", _opt_bool, "Cache-manager mode.")
    enable_remote_cache_accessible = _prop(
        "enable_remote_cache_accessible", _opt_bool, "Remote-accessible (one-sided) mode."
    )
    listen_ip_info = _prop("listen_ip_info", _str, 'Listen address "ip:port".')
    link_total_time = _prop("link_total_time", _link_total_time, "Link budget in seconds.")
    link_retry_count = _prop("link_retry_count", _link_retry_count, "Link retries (1..100).")
    rdma_traffic_class = _prop("rdma_traffic_class", _opt_uint32, "Accepted for compatibility.")
    rdma_service_level = _prop("rdma_service_level", _opt_uint32, "Accepted for compatibility.")
    local_comm_res = _prop("local_comm_res", _opt_str, "Comm resources JSON; enables CM mode.")
    transfer_backend = _prop("transfer_backend", _opt_str, 'Only "hixl" upstream.')
    global_resource_config = _prop("global_resource_config", _opt_str, "HIXL passthrough.")
    cluster_info = _prop("cluster_info", _cluster_info, "Legacy cluster info JSON.")
    output_max_size = _prop("output_max_size", _opt_int, "Legacy output size.")
    enable_switch_role = _prop("enable_switch_role", _bool, "Legacy switch_role switch.")
    mem_utilization = _prop("mem_utilization", _mem_utilization, "Legacy memory ratio.")
    transport = _prop(
        "transport", _opt_str, "llm.Transport: auto, tcp, same-host, nixl or mooncake."
    )
    auth_key = _prop("auth_key", _opt_str, "llm.AuthKey: shared secret for link handshakes.")
    payload_auth = _prop(
        "payload_auth", _opt_bool, "llm.PayloadAuth: a MAC over every DATA payload (needs a key)."
    )

    def __init__(self) -> None:
        self._ge_options: dict[str, str] = {}
        self._device_id: int | list[int] | None = None
        self._sync_kv_timeout: int | str | None = None
        self._deploy_res_path = ""
        self._buf_pool_cfg = ""
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._listen_ip_info = ""
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._cluster_info: str | None = None
        self._output_max_size: int | None = None
        self._enable_switch_role = False
        self._mem_utilization: float = 0.95
        self._transport: str | None = None
        self._auth_key: str | None = None
        self._payload_auth: bool | None = None
        self._options: dict[str, str] = {}

    def generate_options(self) -> dict[str, str]:
        """Fill and return the option dict (the same dict object on every call)."""
        o = self._options
        o.update(self._ge_options)
        if self._device_id is not None:
            if isinstance(self._device_id, list | tuple):
                o["ge.session_device_id"] = str(self._device_id[0])
                o["ge.exec.deviceId"] = ";".join(str(d) for d in self._device_id)
            else:
                o["ge.exec.deviceId"] = str(self._device_id)
                o["ge.session_device_id"] = str(self._device_id)
        if self._sync_kv_timeout is not None:
            o["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            o["llm.deployResPath"] = self._deploy_res_path
        if self._buf_pool_cfg:
            o["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            o["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            o["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            o["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            o["llm.EnableRemoteCacheAccessible"] = (
                "1" if self._enable_remote_cache_accessible else "0"
            )
        if self._listen_ip_info:
            o["llm.listenIpInfo"] = self._listen_ip_info
        if self._link_total_time is not None:
            o["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            o["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            o["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            o["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            o["llm.LocalCommRes"] = self._local_comm_res
        if self._transfer_backend:
            o["llm.TransferBackend"] = self._transfer_backend
        if self._global_resource_config:
            o["llm.GlobalResourceConfig"] = self._global_resource_config
        if self._cluster_info is not None:
            o["llm.ClusterInfo"] = _cluster_info_with_int_ips(self._cluster_info)
        if self._output_max_size is not None:
            o["llm.OutputMaxSize"] = str(self._output_max_size)
        if self._enable_switch_role:
            o["llm.EnableSwitchRole"] = "1"
        o["llm.MemoryUtilization"] = str(self._mem_utilization)
        if self._transport is not None:
            o["llm.Transport"] = self._transport
        if self._auth_key is not None:
            o["llm.AuthKey"] = self._auth_key
        if self._payload_auth is not None:
            o["llm.PayloadAuth"] = "1" if self._payload_auth else "0"
        return o

    gen_options = generate_options


LlmConfig = LLMConfig


def _cluster_info_lists(text: str) -> tuple[list[Any] | None, list[Any] | None]:
    """``(logic_device_id, listen_ip_info)`` of an ``llm.ClusterInfo`` JSON (None if absent).

    Raises:
        LLMException: LLM_PARAM_INVALID for invalid JSON or lists of the wrong shape.
    """
    try:
        info = json.loads(text)
    except json.JSONDecodeError as exc:
        raise_param(f"llm.ClusterInfo is not valid JSON: {exc}")
    raise_if_false(isinstance(info, dict), "llm.ClusterInfo must be a JSON object")
    devices, listen = info.get("logic_device_id"), info.get("listen_ip_info")
    raise_if_false(
        devices is None or (isinstance(devices, list) and len(devices) > 0),
        "llm.ClusterInfo logic_device_id must be a non-empty list",
    )
    raise_if_false(
        listen is None
        or (
            isinstance(listen, list)
            and all(isinstance(x, dict) and "ip" in x and "port" in x for x in listen)
        ),
        'llm.ClusterInfo listen_ip_info must be a list of {"ip": ..., "port": ...}',
    )
    return devices, listen


def _listen_text(item: dict[str, Any]) -> str:
    from ._cluster import int_to_ip

    ip, port = item["ip"], item["port"]
    raise_if_false(
        isinstance(ip, int | str) and isinstance(port, int) and 0 <= port < 65536,
        f"llm.ClusterInfo listen_ip_info entry {item} is invalid",
    )
    if isinstance(ip, int):
        raise_if_false(0 <= ip < 2**32, f"llm.ClusterInfo listen ip {ip} is not an IPv4 int")
        ip = int_to_ip(ip)
    return f"{ip}:{port}"


def _device_number(logic_id: Any, index: int) -> str:
    """The device of a ``logic_device_id`` entry ``"server:die:device:x"`` (else its index)."""
    parts = str(logic_id).split(":")
    return parts[2] if len(parts) == 4 and parts[2].isdigit() else str(index)


def legacy_device_options(options: Mapping[str, str]) -> list[dict[str, str]]:
    """Split legacy-mode ``init`` options into one option dict per device (reference §4, §11).

    The devices are ``llm.ClusterInfo``'s ``logic_device_id`` list, else the ``;``-separated
    ``ge.exec.deviceId``; their listen addresses (a PROMPT needs them) are ``llm.ClusterInfo``'s
    ``listen_ip_info`` (integer or text ips), else the ``;``-separated ``llm.listenIpInfo``,
    one per device. Device ``i``'s dict names its own address in ``llm.listenIpInfo`` and its
    device in ``ge.exec.deviceId``. Cache-manager mode, and anything that is not a dict, come
    back as one unchanged dict (``init`` checks those); so does a single device given only
    ``llm.listenIpInfo``.

    Raises:
        LLMException: LLM_PARAM_INVALID for a malformed ``llm.ClusterInfo``, or a number of
            listen addresses other than the number of devices.
    """
    if not isinstance(options, dict):
        return [options]  # type: ignore[list-item]
    opts = dict(options)
    cache_manager = opts.get("llm.EnableCacheManager", "1" if "llm.LocalCommRes" in opts else "0")
    if cache_manager == "1" or any(not isinstance(v, str) for v in opts.values()):
        return [opts]
    logic, listen_items = (None, None)
    if "llm.ClusterInfo" in opts:
        logic, listen_items = _cluster_info_lists(opts["llm.ClusterInfo"])
    device_ids = opts["ge.exec.deviceId"].split(";") if "ge.exec.deviceId" in opts else None
    if logic is not None:
        n = len(logic)
        devices = [_device_number(d, i) for i, d in enumerate(logic)]
    else:
        n = len(device_ids) if device_ids else 1
        devices = device_ids if device_ids else ["0"]
    if listen_items:
        listens: list[str] | None = [_listen_text(x) for x in listen_items]
    elif opts.get("llm.listenIpInfo"):
        if n == 1:
            return [opts]  # one device: init takes the first address, as it always did
        listens = opts["llm.listenIpInfo"].split(";")
    else:
        listens = None
    if listens is not None:
        raise_if_false(
            len(listens) == n,
            f"{n} device(s) need {n} listen address(es) (one per device), got {len(listens)}",
        )
    if n == 1 and logic is None:
        if listens is not None:
            opts["llm.listenIpInfo"] = listens[0]
        return [opts]
    out = []
    for i in range(n):
        one = dict(opts)
        one.pop("llm.ClusterInfo", None)
        one["ge.exec.deviceId"] = devices[i]
        if listens is not None:
            one["llm.listenIpInfo"] = listens[i]
        else:
            one.pop("llm.listenIpInfo", None)
        out.append(one)
    return out
