"""How a checked ``CacheManager`` call becomes a running ``CacheTask``.

The caches a task reads or writes stay pinned in the registry until it ends (a deallocation
meanwhile is deferred); local copies go to the device adapter; remote movements find their
peer's link, build their request in the wire's addressing format (:mod:`._net.addressing`) and
run under the scheduler (:mod:`._scheduler`), which owns every per-link turn and deadline.
Arguments are checked before these functions run (:mod:`._api_checks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ._api_checks import TransferShape, check_config
from ._engine import Engine
from ._errors import raise_if_false, raise_param
from ._messages import Op, Shape
from ._net.addressing import layer_spec_factory, target_of
from ._net.grants import TransferRequest
from ._net.link import Link
from ._planner import Plan
from ._registry import CacheEntry
from ._scheduler import Destination, run_request, run_transfer, start_request_now
from ._task import CacheTask, TaskControl
from ._types import TransferConfig, TransferWithCacheKeyConfig

__all__ = [
    "check_reachable",
    "peer_link",
    "require_remote_accessible_mode",
    "start_copy",
    "start_request",
    "start_task",
    "start_transfer",
]

#: a task body, without the registry pins that :func:`start_task` adds
Run = Callable[[TaskControl], Awaitable[None]]


def start_task(
    engine: Engine,
    kind: str,
    entries: list[CacheEntry],
    run: Run,
    slots: Sequence[int] = (0,),
    peers: tuple[int, ...] = (),
    task: CacheTask | None = None,
) -> CacheTask:
    """Start ``run`` as a task (``task``, or a new one) with the peer clusters ``peers``
    (named in its events); ``entries`` stay pinned (not freed) until it ends."""
    registry = engine.registry
    for e in entries:
        registry.pin(e)

    async def body(ctl: TaskControl) -> None:
        try:
            await run(ctl)
        finally:
            for e in entries:
                registry.unpin(e)

    return engine.start_task(task or engine.new_task(kind, slots, peers), body)


def start_copy(engine: Engine, kind: str, plan: Plan, entries: list[CacheEntry]) -> CacheTask:
    """Start a local copy of ``plan`` on the device adapter."""
    adapter = engine.adapter

    async def run(ctl: TaskControl) -> None:
        n = await adapter.copy(plan, ctl.token)
        ctl.add(n, len(plan))

    return start_task(engine, kind, entries, run)


def peer_link(engine: Engine, cluster_id: int) -> Link:
    """The live link to ``cluster_id``.

    Raises:
        LLMException: LLM_PARAM_INVALID for the own cluster id (cache-manager mode);
            LLM_NOT_YET_LINK without a link.
    """
    if cluster_id == engine.cluster_id and engine.options.cache_manager:
        raise_param(f"cannot transfer with own cluster id {cluster_id}")
    return engine.links.get(cluster_id)


def require_remote_accessible_mode(engine: Engine, kind: str) -> None:
    """Raises LLMException(LLM_PARAM_INVALID) outside remote-accessible mode."""
    raise_if_false(
        engine.options.remote_accessible, f"{kind} needs llm.EnableRemoteCacheAccessible=1"
    )


def check_reachable(engine: Engine, entry: CacheEntry) -> None:
    """In remote-accessible mode a peer reaches only remote-accessible local caches.

    Raises:
        LLMException: LLM_PARAM_INVALID for a cache that is not.
    """
    if engine.options.remote_accessible and not entry.remote_accessible:
        raise_param(
            f"cache {entry.cache_id} is not remote accessible (register it with "
            "remote_accessible=True)"
        )


def start_request(
    engine: Engine,
    kind: str,
    op: Op,
    key: Any,
    shape: Shape,
    entry: CacheEntry,
    ranges: tuple[range | None, range | None, int],
    steps: int = 1,
    **spec_fields: Any,
) -> CacheTask:
    """Start a transfer with the peer ``key`` names; ``steps`` layers of deadline budget.

    ``ranges`` are the checked ``(src_layer_range, dst_layer_range, tensor_num_per_layer)``;
    ``spec_fields`` the request's other fields (slot, size, offsets, block lists).

    Raises:
        LLMException: LLM_PARAM_INVALID for a local cache the peer may not reach, or the own
            cluster id; LLM_NOT_YET_LINK without a link.
    """
    check_reachable(engine, entry)
    link = peer_link(engine, key.cluster_id)
    src_r, dst_r, n = ranges
    spec = TransferRequest(
        op,
        target_of(key),
        shape,
        entry,
        src_range=src_r,
        dst_range=dst_r,
        tensor_num_per_layer=n,
        **spec_fields,
    )
    timeout, ra = engine.sync_kv_timeout_s, engine.options.remote_accessible
    engine.check_thread()
    task = engine.new_task(kind, peer_cluster_ids=(key.cluster_id,))
    registry, entry = engine.registry, spec.local
    registry.pin(entry)
    if start_request_now(
        engine, task, link, spec, timeout, steps, ra, lambda: registry.unpin(entry)
    ):
        return task
    registry.unpin(entry)

    async def run(ctl: TaskControl) -> None:
        # Registration's page population is waited for before any deadline runs: a pull
        # right after registering fresh memory must not spend its budget on page faults.
        await engine.populated(spec.local.addrs)
        await run_request(engine, ctl, link, spec, timeout, steps, ra)

    return start_task(engine, kind, [spec.local], run, peers=(key.cluster_id,), task=task)


def _destinations(
    engine: Engine,
    entry: CacheEntry,
    transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
    ts: TransferShape,
) -> list[Destination]:
    """One destination per config; configs to one cluster share its result slot and link.

    Raises:
        LLMException: as :func:`._api_checks.check_config` and :func:`peer_link`.
    """
    source = dataclasses.replace(entry, is_blocks=True) if ts.read_as_blocks else entry
    #: cluster id -> (result slot, link)
    per_cluster: dict[int, tuple[int, Link]] = {}
    dests: list[Destination] = []
    for i, c in enumerate(transfer_configs):
        src_r = check_config(i, c, entry, ts)
        cid = c.dst_cluster_id
        if cid not in per_cluster:
            per_cluster[cid] = (len(per_cluster), peer_link(engine, cid))
        slot, link = per_cluster[cid]
        make = layer_spec_factory(
            source,
            c,
            src_r,
            ts.shape,
            ts.src_blocks,
            ts.dst_blocks,
            ts.dst_block_bytes,
            ts.tensor_num_per_layer,
        )
        dests.append(Destination(i, slot, link, list(src_r), make, ts.tensor_num_per_layer))
    return dests


def start_transfer(
    engine: Engine,
    entry: CacheEntry,
    layer_synchronizer: Any,
    transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
    ts: TransferShape,
) -> CacheTask:
    """Start a layer-wise ``transfer_cache_async`` of ``entry`` (its shared arguments already
    checked into ``ts``).

    Raises:
        LLMException: as :func:`._api_checks.check_config`, :func:`peer_link` and
            :func:`check_reachable`.
    """
    dests = _destinations(engine, entry, transfer_configs, ts)
    check_reachable(engine, entry)
    ra = engine.options.remote_accessible
    timeout = engine.sync_kv_timeout_s
    sync_timeout = engine.options.layer_sync_timeout_ms
    window = engine.options.layer_window

    async def run(ctl: TaskControl) -> None:
        await engine.populated(entry.addrs)  # before any layer's deadline (as start_request)
        await run_transfer(
            engine, ctl, layer_synchronizer, dests, timeout, sync_timeout, window, ra
        )

    slots = [d.slot for d in dests]
    peers = tuple(dict.fromkeys(c.dst_cluster_id for c in transfer_configs))
    return start_task(engine, "transfer_cache_async", [entry], run, slots, peers)


def release_allocated(engine: Engine, cache_id: int) -> None:
    """What dropping the last reference of an allocated legacy cache does (on the loop)."""
    entry = engine.registry.entries.get(cache_id)
    if entry is not None and entry.allocated:
        engine.registry.release_id(entry)
