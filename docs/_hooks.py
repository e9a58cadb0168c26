"""MkDocs hooks (``hooks:`` in mkdocs.yml): the generated parts of the reference pages.

A page holds a marker line ``<!-- generated: NAME -->``; ``on_page_markdown`` replaces it with
the text that ``GENERATORS[NAME]`` builds from the package itself:

- ``options``: every key of the option parser (``llmdd_async._options.KNOWN_OPTIONS``), its
  ``LLMConfig`` attribute, default and accepted values; a key without a description below, or a
  description of a key the parser does not know, fails the build;
- ``status-codes``: every ``LLMStatusCode`` with its value, the exception classes that carry it
  by default and the public API whose docstrings name it;
- ``cli``: the ``--help`` text of ``llmdd-async`` and of each subcommand.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)

# --- options -------------------------------------------------------------------------------

#: key -> (accepted values, meaning). Defaults are not written here: see _option_defaults.
OPTION_DOCS: dict[str, tuple[str, str]] = {
    "ge.exec.deviceId": (
        "device index; legacy mode: `0;1;...` (one per device)",
        "the device this endpoint serves (legacy mode: each device is one endpoint)",
    ),
    "ge.session_device_id": ("device index", "emitted by `LLMConfig.device_id`; accepted"),
    "ge.flowGraphMemMaxSize": (
        "bytes (a single number)",
        "legacy mode's KV memory, times `llm.MemoryUtilization`",
    ),
    "ge.resourceConfigPath": ("path", "accepted for compatibility, not used"),
    "llm.SyncKvCacheWaitTime": (
        "ms, `1`..`2**31-1`",
        "deadline of every transfer, from when the link is free for it (`LLM_TIMEOUT`)",
    ),
    "llm.deployResPath": ("path", "legacy deploy resource path; accepted, not used"),
    "llm.BufPoolCfg": ("JSON", "legacy buffer pool; accepted, not used"),
    "llm.MemPoolConfig": (
        '`{"memory_size": N, "page_shift": 16}` (N > 0, page_shift in [10, 31))',
        "the `Placement.DEVICE` pool for `allocate_cache` / `allocate_blocks_cache`",
    ),
    "llm.HostMemPoolConfig": (
        "as `llm.MemPoolConfig`",
        "the `Placement.HOST` pool for `allocate_cache` / `allocate_blocks_cache`",
    ),
    "llm.EnableCacheManager": ('`"1"` / `"0"`', "cache-manager mode (off: legacy mode)"),
    "llm.EnableRemoteCacheAccessible": (
        '`"1"` / `"0"`',
        "remote-accessible (one-sided) mode: push APIs, the table snapshot, one-sided pulls",
    ),
    "llm.listenIpInfo": (
        '`"ip:port"`, `"[ipv6]:port"`, `"hostname:port"` (port `0`: any free port); '
        'legacy mode: `"ip:port;ip:port"`, one per device',
        "listen exactly there for links (`listen_address` tells the port chosen)",
    ),
    "llm.LinkTotalTime": ("seconds, an integer >= 0", "comm-domain links' budget to connect"),
    "llm.LinkRetryCount": ("`1`..`100`", "accepted for compatibility"),
    "llm.RdmaTrafficClass": ("uint32", "accepted for compatibility (RDMA is NIXL's)"),
    "llm.RdmaServiceLevel": ("uint32", "accepted for compatibility (RDMA is NIXL's)"),
    "llm.LocalCommRes": ("JSON", "comm resources; turns cache-manager mode on"),
    "llm.TransferBackend": (
        "text",
        "needs cache-manager mode, remote-accessible mode and `llm.listenIpInfo`",
    ),
    "llm.GlobalResourceConfig": ("JSON", "HIXL passthrough; accepted, not used"),
    "llm.ClusterInfo": (
        "JSON with `logic_device_id` and `listen_ip_info` lists",
        "legacy mode's devices and their listen addresses (one endpoint per device)",
    ),
    "llm.OutputMaxSize": ("integer", "legacy output size; accepted, not used"),
    "llm.EnableSwitchRole": ('`"1"`', "legacy `switch_role` switch"),
    "llm.MemoryUtilization": (
        "a number in (0, 1]",
        "share of `ge.flowGraphMemMaxSize` that legacy mode's KV memory takes",
    ),
    "llm.Role": ("role name", "set by upstream's `init`; accepted"),
    "llm.ListenIp": ("address", "derived from `llm.listenIpInfo` in cache-manager mode"),
    "llm.ListenPort": ("port", "derived from `llm.listenIpInfo` in cache-manager mode"),
    "llm.Transport": (
        "one of {transports}; `nixl` needs NIXL installed, `mooncake` Mooncake TE",
        "how links move data (`auto` never picks `nixl` or `mooncake`); anything else is "
        "`LLM_PARAM_INVALID`",
    ),
    "llm.DeviceAdapter": ("`host`, `torch`", "what `Placement.DEVICE` memory is"),
    "llm.TorchDevice": (
        "`cuda`, `cuda:1`, `npu`, `cpu`, ...",
        "the torch adapter's device (unset: CUDA, else NPU)",
    ),
    "llm.LayerWindow": (
        "`1`..`1024`",
        "layers a layer-wise transfer may run ahead of its slowest destination",
    ),
    "llm.LayerSyncTimeout": (
        "ms, > 0",
        "bound on each wait for a layer's synchronizer (`LLM_TIMEOUT`); when set, also the "
        "synchronizer's `timeout_in_millis` (else it gets None, as upstream passes it)",
    ),
    "llm.CopyThreads": ("`1`..`64`", "worker threads for one large local copy"),
    "llm.AuthKey": (
        'non-empty text (`""` is `LLM_PARAM_INVALID`)',
        "shared secret: links are set up only between endpoints that know it, and every "
        "frame is authenticated",
    ),
    "llm.PayloadAuth": (
        '`"0"` / `"1"`; `"1"` needs `llm.AuthKey`',
        "a MAC over every DATA frame's payload on the link's TCP stream; both endpoints must agree",
    ),
    "llm.CommPortBase": (
        "port",
        "comm-domain links: rank r listens on base + 4 x (crc32(comm_name) mod 8192) + r",
    ),
    "llm.LinkMaxMeta": ("bytes", "largest meta (fields + descriptor arrays) of one peer frame"),
    "llm.LinkServing": ("requests", "requests of one peer served at once"),
    "llm.LinkQueue": (
        "requests, >= `llm.LinkServing`",
        "requests of one peer accepted but unfinished; more are refused with `LLM_LINK_BUSY`",
    ),
    "llm.LinkThreads": ("threads", "worker threads one link may hold"),
    "llm.ServeTimeout": (
        "ms",
        "the most one request of a peer may run here, whatever deadline the peer asks for",
    ),
    "llm.BusyPoll": (
        "µs, `0`..`10000`",
        "after each frame a link sends or receives, the event loop keeps polling (no sleep) "
        "for this long: the next frame is picked up by a running loop, not by a process the "
        "kernel wakes on an idle CPU (about 100 µs a small request on a VM), at the cost of "
        "a busy core while traffic flows, and the GIL held between polls: off where other "
        "threads run Python ([tuning](../how-to/tuning.md)); `0`: off",
    ),
    "llm.LinkHeartbeat": (
        "ms, `2000`..`3600000`",
        "a link whose peer's host acknowledges nothing for this long (a partition, a host gone "
        "without closing) is broken (`LLM_LINK_FAILED`): TCP keepalive probes an idle link "
        "from half of it, and data or probes unacknowledged for this long end it (a peer that "
        "reads nothing for this long too: set below the default, it shortens that tolerance)",
    ),
    "llm.MetaBudget": (
        "bytes, >= `llm.LinkMaxMeta`",
        "bytes of partial frames and queued descriptors held across all links at once",
    ),
}


def _option_defaults() -> dict[str, str]:
    """Defaults as the parser applies them: parse an empty cache-manager option dict (and
    read the module constants for what it leaves unset)."""
    from llmdd_async import LLMConfig
    from llmdd_async._options import (
        DEFAULT_LAYER_SYNC_TIMEOUT_MS,
        LEGACY_DEFAULT_KV_BYTES,
        LinkLimits,
        parse_options,
    )

    parsed = parse_options({"llm.EnableCacheManager": "1"})
    limits = LinkLimits()
    utilization = LLMConfig().generate_options()["llm.MemoryUtilization"]
    return {
        "llm.EnableCacheManager": '`"0"` (legacy mode)',
        "llm.EnableRemoteCacheAccessible": '`"1"` with `llm.LocalCommRes` or '
        f'`llm.TransferBackend`, else `"{int(parsed.remote_accessible)}"`',
        "llm.SyncKvCacheWaitTime": f"`{parsed.sync_kv_timeout_ms}`",
        "llm.Transport": f"`{parsed.transport}`",
        "llm.LayerWindow": f"`{parsed.layer_window}`",
        "llm.LayerSyncTimeout": f"`{DEFAULT_LAYER_SYNC_TIMEOUT_MS}` (the bound; synchronizers "
        "get None)",
        "llm.LinkTotalTime": f"`{parsed.link_total_time_s}`",
        "llm.PayloadAuth": '`"1"`' if parsed.payload_auth else '`"0"`',
        "llm.LinkMaxMeta": f"`{limits.meta_bytes}`",
        "llm.LinkServing": f"`{limits.serving}`",
        "llm.LinkQueue": f"`{limits.queued}`",
        "llm.LinkThreads": f"`{limits.threads}`",
        "llm.ServeTimeout": "`llm.SyncKvCacheWaitTime` per layer of the request",
        "llm.LinkHeartbeat": "`llm.SyncKvCacheWaitTime`, at least `10000` (the stall timeout)",
        "llm.BusyPoll": f"`{round(parsed.busy_poll_s * 1e6)}` (off)",
        "llm.MetaBudget": f"4 x `llm.LinkMaxMeta` (`{limits.meta_budget_bytes}`)",
        "llm.MemoryUtilization": f"`{utilization}` (what `LLMConfig` emits)",
        "ge.flowGraphMemMaxSize": f"`{LEGACY_DEFAULT_KV_BYTES}` (lazily touched)",
        "ge.exec.deviceId": "`0`",
        "llm.DeviceAdapter": "`host`",
        "llm.CopyThreads": "`2`",
        "llm.CommPortBase": "`30000`",
        "llm.MemPoolConfig": "none (no pool)",
        "llm.HostMemPoolConfig": "none (no pool)",
        "llm.listenIpInfo": "none (no listener)",
        "llm.AuthKey": "none (links unauthenticated)",
    }


def _config_attributes() -> dict[str, str]:
    """``option key -> LLMConfig attribute``: set each attribute on a fresh ``LLMConfig`` and
    see which key ``generate_options()`` adds."""
    from llmdd_async import LLMConfig

    samples: dict[type, Any] = {bool: True, str: "1", int: 1, float: 0.5}
    base = set(LLMConfig().generate_options())
    found: dict[str, str] = {}
    for name, attr in vars(LLMConfig).items():
        if not isinstance(attr, property) or name == "ge_options":
            continue
        candidates: list[Any] = (
            ['{"memory_size": 65536}', '{"logic_device_id": [0]}']
            if name.endswith("_cfg") or name == "cluster_info"
            else list(samples.values())
        )
        for value in candidates:
            config = LLMConfig()
            try:
                setattr(config, name, value)
            except (TypeError, ValueError, RuntimeError):
                continue
            new = set(config.generate_options()) - base
            if name == "mem_utilization":
                new = {"llm.MemoryUtilization"}
            if new:
                for key in new:
                    found.setdefault(key, f"`{name}`")
                break
    return found


def generate_options() -> str:
    from llmdd_async._options import (
        _LIMIT_KEYS,
        KNOWN_OPTIONS,
        OWN_OPTIONS,
        TRANSPORTS,
        UPSTREAM_OPTIONS,
    )

    missing = sorted(KNOWN_OPTIONS - OPTION_DOCS.keys())
    extra = sorted(OPTION_DOCS.keys() - KNOWN_OPTIONS)
    if missing or extra:
        raise PluginError(
            f"docs/_hooks.py OPTION_DOCS is out of date: undocumented {missing}, unknown {extra}"
        )
    defaults = _option_defaults()
    attributes = _config_attributes()
    transports = ", ".join(f"`{t}`" for t in TRANSPORTS)
    out = []
    for title, keys in (
        ("Upstream's keys", UPSTREAM_OPTIONS),
        ("This library's own keys", OWN_OPTIONS),
    ):
        out += [f"## {title}", "", "| option | `LLMConfig` | default | values | meaning |"]
        out.append("|---|---|---|---|---|")
        for key in sorted(keys, key=str.lower):
            values, meaning = OPTION_DOCS[key]
            values = values.replace("{transports}", transports)
            if key in _LIMIT_KEYS:
                _, lo, hi = _LIMIT_KEYS[key]
                values += f", an integer in [{lo}, {hi}]"
            row = [
                f"`{key}`",
                attributes.get(key, ""),
                defaults.get(key, ""),
                values,
                meaning,
            ]
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        out.append("")
    return "\n".join(out)


# --- status codes --------------------------------------------------------------------------


def _public_api() -> list[tuple[str, Any]]:
    import llmdd_async as dd

    found = []
    for name in dd.__all__:
        obj = getattr(dd, name)
        found.append((name, obj))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") or attr == "__init__":
                    found.append((f"{name}.{attr}", member))
    return found


def generate_status_codes() -> str:
    from llmdd_async import LLMStatusCode, _errors

    by_default: dict[LLMStatusCode, list[str]] = {}
    for name in _errors.__all__:
        cls = getattr(_errors, name)
        if (
            inspect.isclass(cls)
            and issubclass(cls, _errors.LLMException)
            and cls is not _errors.LLMException
        ):
            by_default.setdefault(cls.default_status, []).append(f"`{name}`")
    named_in: dict[str, list[str]] = {}
    for name, obj in _public_api():
        doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) or ""
        if name.count(".") == 0 and inspect.isclass(obj):
            doc = obj.__doc__ or ""
        for code in LLMStatusCode:
            if re.search(rf"\b{code.name}\b", doc):
                named_in.setdefault(code.name, []).append(f"`{name}`")
    out = ["| code | value | hex | exception classes (default) | named in the docstrings of |"]
    out.append("|---|---|---|---|---|")
    for code in LLMStatusCode:
        value = int(code)
        hexa = f"`0x{value:08X}`" if value >= 0 else ""
        classes = ", ".join(by_default.get(code, []))
        where = ", ".join(sorted(set(named_in.get(code.name, []))))
        out.append(f"| `{code.name}` | `{value}` | {hexa} | {classes} | {where} |")
    return "\n".join(out) + "\n"


# --- CLI -----------------------------------------------------------------------------------


def _help(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at $COLUMNS: the same text on every machine
    try:
        return parser.format_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def generate_cli() -> str:
    from llmdd_async._cli import build_parser

    parser = build_parser()
    out = ["## `llmdd-async`", "", "```text", _help(parser).rstrip(), "```", ""]
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        out += [f"## `llmdd-async {name}`", "", "```text", _help(sub).rstrip(), "```", ""]
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "options": generate_options,
    "status-codes": generate_status_codes,
    "cli": generate_cli,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_uri}: no generator for marker {name!r}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)
