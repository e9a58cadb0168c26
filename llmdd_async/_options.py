"""Parse and validate the engine option dict (reference §4, §6 ``init``) into typed settings."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import socket
from collections.abc import Mapping
from typing import Any

from ._cluster import address_of, split_host
from ._errors import raise_if_false, raise_param
from ._memory import PoolConfig

__all__ = [
    "EngineOptions",
    "KNOWN_OPTIONS",
    "PoolConfig",
    "TRANSPORTS",
    "option_key_hints",
    "parse_options",
    "warn_unknown_options",
]


#: the bound on one wait for a layer's signal unless ``llm.LayerSyncTimeout`` says otherwise
#: (the scheduler's own: a synchronizer is still passed None, as upstream passes it):
#: a forward pass that never signals a layer fails its transfer (LLM_TIMEOUT) instead of
#: holding it, its link and its caches for ever
DEFAULT_LAYER_SYNC_TIMEOUT_MS = 600_000

#: llm.LayerWindow's default: layers a layer-wise transfer may run ahead of its slowest
#: destination. The layers waiting there leave together (staging stays one chunk whatever
#: how many leave at once).
DEFAULT_LAYER_WINDOW = 16

#: llm.BusyPoll's bound (microseconds): polling pays for the time an answer takes to come,
#: and a linked peer that sends a frame per window keeps a core busy (10 ms: 100 frames/s)
MAX_BUSY_POLL_US = 10_000

#: Option keys of upstream (reference §4: emitted by ``LLMConfig``, accepted or derived by
#: ``init``) and this library's own ``llm.`` options.
UPSTREAM_OPTIONS = frozenset(
    {
        "ge.exec.deviceId",
        "ge.session_device_id",
        "ge.flowGraphMemMaxSize",
        "ge.resourceConfigPath",
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
        "llm.ClusterInfo",
        "llm.OutputMaxSize",
        "llm.EnableSwitchRole",
        "llm.MemoryUtilization",
        "llm.Role",
        "llm.ListenIp",
        "llm.ListenPort",
    }
)
OWN_OPTIONS = frozenset(
    {
        "llm.Transport",
        "llm.DeviceAdapter",
        "llm.TorchDevice",
        "llm.LayerWindow",
        "llm.LayerSyncTimeout",
        "llm.CopyThreads",
        "llm.AuthKey",
        "llm.PayloadAuth",
        "llm.CommPortBase",
        "llm.LinkMaxMeta",
        "llm.LinkServing",
        "llm.LinkQueue",
        "llm.LinkThreads",
        "llm.ServeTimeout",
        "llm.MetaBudget",
        "llm.LinkHeartbeat",
        "llm.BusyPoll",
    }
)
KNOWN_OPTIONS = UPSTREAM_OPTIONS | OWN_OPTIONS
_BY_LOWER = {k.lower(): k for k in KNOWN_OPTIONS}
_LLM_LOWER = sorted(k for k in _BY_LOWER if k.startswith("llm."))

TRANSPORTS = ("auto", "tcp", "same-host", "nixl", "mooncake")
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
#: legacy mode without ge.flowGraphMemMaxSize: a lazily touched 1 GiB mapping
LEGACY_DEFAULT_KV_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class LinkLimits:
    """What one linked peer may hold of this endpoint (README: Security model)."""

    #: bytes of one frame's meta (JSON fields are capped at 1 MiB within it)
    meta_bytes: int = 64 << 20
    #: the peer's requests served at once
    serving: int = 16
    #: the peer's requests accepted but not finished; more are refused with LLM_LINK_BUSY
    queued: int = 256
    #: worker threads the link may hold at once
    threads: int = 8
    #: most seconds one request of the peer may run here, 0 = derive from sync_kv_timeout
    serve_timeout_s: float = 0.0
    #: bytes of partial frames buffered across all links at once, 0 = 4 x ``meta_bytes``
    meta_budget: int = 0
    #: seconds after which a link whose peer's host acknowledges nothing is broken (TCP
    #: keepalive probes an idle link; TCP_USER_TIMEOUT bounds unacknowledged data, a zero
    #: window included), 0 = the stall timeout (what a peer may go without moving a byte)
    heartbeat_s: float = 0.0

    @property
    def meta_budget_bytes(self) -> int:
        return self.meta_budget or 4 * self.meta_bytes


_LIMIT_KEYS = {
    "llm.LinkMaxMeta": ("meta_bytes", 1 << 16, 1 << 30),
    "llm.LinkServing": ("serving", 1, 1024),
    "llm.LinkQueue": ("queued", 1, 1 << 16),
    "llm.LinkThreads": ("threads", 1, 256),
    "llm.ServeTimeout": ("serve_timeout_s", 1, 1 << 31),
    "llm.MetaBudget": ("meta_budget", 1 << 16, 1 << 42),
    "llm.LinkHeartbeat": ("heartbeat_s", 2000, 3_600_000),
}
#: limits given in milliseconds, kept in seconds
_MS_LIMITS = frozenset({"serve_timeout_s", "heartbeat_s"})


def parse_limits(opts: Mapping[str, str]) -> LinkLimits:
    """Raises LLMException(LLM_PARAM_INVALID) for a limit that is not an int in range."""
    values: dict[str, Any] = {}
    for key, (field, lo, hi) in _LIMIT_KEYS.items():
        raw = opts.get(key)
        if raw is None:
            continue
        raise_if_false(
            raw.isdigit() and lo <= int(raw) <= hi, f"{key} must be an int in [{lo}, {hi}]"
        )
        values[field] = int(raw) / 1000 if field in _MS_LIMITS else int(raw)
    limits = LinkLimits(**values)
    raise_if_false(limits.queued >= limits.serving, "llm.LinkQueue must be >= llm.LinkServing")
    raise_if_false(
        limits.meta_budget_bytes >= limits.meta_bytes, "llm.MetaBudget must be >= llm.LinkMaxMeta"
    )
    return limits


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Everything ``init`` derives from its options, validated."""

    raw: dict[str, str]
    cache_manager: bool
    remote_accessible: bool
    listen: tuple[str, int] | None
    sync_kv_timeout_ms: int
    device_pool: PoolConfig | None
    host_pool: PoolConfig | None
    local_comm_res: str | None
    transport: str
    auth_key: bytes | None
    #: as the user set it (None: unset; a user's synchronizer is then passed None, as
    #: upstream does, and the scheduler bounds the wait by DEFAULT_LAYER_SYNC_TIMEOUT_MS)
    layer_sync_timeout_ms: int | None = None
    layer_window: int = DEFAULT_LAYER_WINDOW
    #: legacy mode's KV memory: ge.flowGraphMemMaxSize x llm.MemoryUtilization
    legacy_kv_pool: PoolConfig | None = None
    link_total_time_s: int = 0
    limits: LinkLimits = LinkLimits()
    #: llm.PayloadAuth: every DATA frame's payload carries a MAC (keyed links only)
    payload_auth: bool = False
    #: llm.BusyPoll: seconds the event loop keeps polling after link traffic (0: off)
    busy_poll_s: float = 0.0


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``"host:port"`` (an IPv6 host written ``[addr]:port``); a host name is resolved
    here, once, to the address the endpoint then binds exactly (its first IPv4 address, else
    its first IPv6 one).

    Raises:
        LLMException: LLM_PARAM_INVALID unless it is one ``host:port`` with a valid port and a
            host that is an address or resolves to one.
    """
    raise_if_false(
        isinstance(value, str) and ";" not in value,
        f"llm.listenIpInfo must be a single 'ip:port', got {value!r}",
    )
    try:
        host, port_s = split_host(value, "llm.listenIpInfo")
    except ValueError as exc:
        raise_param(str(exc))
    raise_if_false(port_s.isdigit() and 0 <= int(port_s) <= 65535, f"bad port in {value!r}")
    try:
        return str(ipaddress.ip_address(host)), int(port_s)
    except ValueError:
        pass
    try:
        address_of(host)  # the same words as an LLMClusterInfo address
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (RuntimeError, OSError) as exc:
        raise_param(f"llm.listenIpInfo has a host that is no address and does not resolve: {exc}")
    addrs = [str(info[4][0]) for info in infos]
    v4 = [a for a in addrs if ":" not in a]
    return (v4 or addrs)[0], int(port_s)


def parse_pool(key: str, value: str) -> PoolConfig | None:
    """Parse a pool JSON ``{"memory_size": int > 0, "page_shift": int in [10, 31)}``.

    Raises:
        LLMException: LLM_PARAM_INVALID for malformed JSON or values out of range.
    """
    if not value:
        return None
    try:
        cfg = json.loads(value)
    except json.JSONDecodeError as exc:
        raise_param(f"{key} is not valid JSON: {exc}")
    raise_if_false(isinstance(cfg, dict), f"{key} must be a JSON object")
    size = cfg.get("memory_size")
    shift = cfg.get("page_shift", 16)
    raise_if_false(
        isinstance(size, int) and not isinstance(size, bool) and size > 0,
        f"{key}.memory_size must be an int > 0",
    )
    raise_if_false(
        isinstance(shift, int) and not isinstance(shift, bool) and 10 <= shift < 31,
        f"{key}.page_shift must be an int in [10, 31)",
    )
    raise_if_false((size >> shift) < 2**32, f"{key}: too many pages")
    return PoolConfig(size, shift)


def parse_busy_poll_us(value: str) -> int:
    """``llm.BusyPoll``: microseconds, ASCII digits, at most :data:`MAX_BUSY_POLL_US`.

    Raises:
        LLMException: LLM_PARAM_INVALID for anything else.
    """
    raise_if_false(
        value.isascii() and value.isdigit() and len(value) <= 9 and int(value) <= MAX_BUSY_POLL_US,
        f"llm.BusyPoll must be microseconds in [0, {MAX_BUSY_POLL_US}], got {value!r}",
    )
    return int(value)


def option_key_hints(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, closest known key)`` for every unknown key that looks like a misspelling: a
    known key up to letter case, or (for ``llm.`` keys) one that ``difflib`` finds close.
    Unknown keys without a close match are not listed (upstream accepts any key)."""
    hints = []
    for key in options:
        if not isinstance(key, str) or key in KNOWN_OPTIONS:
            continue
        low = key.lower()
        if low in _BY_LOWER:
            hints.append((key, _BY_LOWER[low]))
        elif low.startswith("llm."):
            close = difflib.get_close_matches(low, _LLM_LOWER, n=1, cutoff=0.8)
            if close:
                hints.append((key, _BY_LOWER[close[0]]))
    return hints


def warn_unknown_options(options: Mapping[str, Any], cluster_id: int | None = None) -> None:
    """Log ``option.unknown`` (a warning on the ``llmdd_async.engine`` logger, naming the
    closest known key) for every key that :func:`option_key_hints` finds. Never raises."""
    hints = option_key_hints(options)
    if not hints:
        return
    from ._log import get_logger

    log = get_logger("engine", cluster_id=cluster_id)
    for key, known in hints:
        log.warning("option.unknown", key=key, did_you_mean=known)


def parse_options(options: Mapping[str, str]) -> EngineOptions:
    """Apply upstream's defaults and checks to ``options``.

    Raises:
        TypeError: ``options`` is not a dict, or holds non-str keys or values.
        LLMException: LLM_PARAM_INVALID for any inconsistent or malformed option.
    """
    if not isinstance(options, dict):
        raise TypeError(f"options must be dict, got {type(options).__name__}")
    for k, v in options.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"options must map str to str, got {k!r}: {v!r}")
    opts = dict(options)
    mem = opts.get("ge.flowGraphMemMaxSize")
    if mem is not None:
        raise_if_false(mem.isdigit(), "ge.flowGraphMemMaxSize must be a single number")
    has_comm_res = "llm.LocalCommRes" in opts
    if has_comm_res:
        opts.setdefault("llm.EnableCacheManager", "1")
        opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
    cache_manager = opts.get("llm.EnableCacheManager") == "1"
    raise_if_false(not has_comm_res or cache_manager, "llm.LocalCommRes needs cache-manager mode")
    if "llm.TransferBackend" in opts:
        raise_if_false(cache_manager, "llm.TransferBackend needs cache-manager mode")
        opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
        raise_if_false(
            opts["llm.EnableRemoteCacheAccessible"] == "1",
            "llm.TransferBackend needs llm.EnableRemoteCacheAccessible=1",
        )
        raise_if_false("llm.listenIpInfo" in opts, "llm.TransferBackend needs llm.listenIpInfo")
    listen = None
    if opts.get("llm.listenIpInfo"):
        if cache_manager:
            listen = parse_listen(opts["llm.listenIpInfo"])
            opts["llm.ListenIp"], opts["llm.ListenPort"] = listen[0], str(listen[1])
        else:
            # Legacy mode accepts one address per device; this library serves one device.
            listen = parse_listen(opts["llm.listenIpInfo"].split(";")[0])
    timeout_s = opts.get("llm.SyncKvCacheWaitTime", str(DEFAULT_SYNC_KV_TIMEOUT_MS))
    raise_if_false(
        timeout_s.isdigit() and 0 < int(timeout_s) < 2**31,
        f"llm.SyncKvCacheWaitTime must be a positive integer, got {timeout_s!r}",
    )
    transport = opts.get("llm.Transport", "auto")
    raise_if_false(
        transport in TRANSPORTS, f"llm.Transport must be one of {TRANSPORTS}, got {transport!r}"
    )
    # A transport's optional package (NIXL, Mooncake) is checked here, where the option is read.
    from ._transports import require_installed

    require_installed(transport)
    device_s = opts.get("ge.exec.deviceId", "0").split(";")[0]
    raise_if_false(device_s.isdigit(), f"ge.exec.deviceId must be a number, got {device_s!r}")
    auth = opts.get("llm.AuthKey")
    # An empty key is a mistake (a missing environment variable), never "auth off".
    raise_if_false(auth is None or len(auth) > 0, "llm.AuthKey must not be empty")
    payload_auth = opts.get("llm.PayloadAuth", "0")
    raise_if_false(
        payload_auth in ("0", "1"), f'llm.PayloadAuth must be "0" or "1", got {payload_auth!r}'
    )
    raise_if_false(
        payload_auth == "0" or auth is not None,
        "llm.PayloadAuth=1 needs llm.AuthKey: the payload MAC is keyed by the link's key",
    )
    sync_to = opts.get("llm.LayerSyncTimeout")
    raise_if_false(
        sync_to is None or (sync_to.isdigit() and int(sync_to) > 0),
        f"llm.LayerSyncTimeout must be a positive number of ms, got {sync_to!r}",
    )
    legacy_pool = None
    if not cache_manager:
        total = int(mem) if mem else LEGACY_DEFAULT_KV_BYTES
        util_s = opts.get("llm.MemoryUtilization", "0.95")
        try:
            util = float(util_s)
        except ValueError:
            raise_param(f"llm.MemoryUtilization must be a number, got {util_s!r}")
        raise_if_false(0.0 < util <= 1.0, f"llm.MemoryUtilization must be in (0, 1]: {util}")
        legacy_pool = PoolConfig(max(1 << 16, int(total * util)), 16)
    total_time = opts.get("llm.LinkTotalTime", "0")
    raise_if_false(total_time.isdigit(), f"llm.LinkTotalTime must be seconds, got {total_time!r}")
    window = opts.get("llm.LayerWindow", str(DEFAULT_LAYER_WINDOW))
    raise_if_false(
        window.isdigit() and 1 <= int(window) <= 1024,
        f"llm.LayerWindow must be 1..1024, got {window!r}",
    )
    busy_us = parse_busy_poll_us(opts.get("llm.BusyPoll", "0"))
    return EngineOptions(
        raw=opts,
        cache_manager=cache_manager,
        remote_accessible=opts.get("llm.EnableRemoteCacheAccessible") == "1",
        listen=listen,
        sync_kv_timeout_ms=int(timeout_s),
        device_pool=parse_pool("llm.MemPoolConfig", opts.get("llm.MemPoolConfig", "")),
        host_pool=parse_pool("llm.HostMemPoolConfig", opts.get("llm.HostMemPoolConfig", "")),
        local_comm_res=opts.get("llm.LocalCommRes"),
        transport=transport,
        auth_key=auth.encode() if auth is not None else None,
        layer_sync_timeout_ms=int(sync_to) if sync_to else None,
        layer_window=int(window),
        legacy_kv_pool=legacy_pool,
        link_total_time_s=int(total_time),
        limits=parse_limits(opts),
        payload_auth=payload_auth == "1",
        busy_poll_s=busy_us / 1e6,
    )
