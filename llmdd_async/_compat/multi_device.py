"""Upstream's single-process multi-device legacy mode, for the blocking facade (reference §11).

Upstream's legacy engine drives several devices from one process: ``llm.ClusterInfo`` lists
them (``logic_device_id``) with one listen address each, an ``LLMClusterInfo`` carries one
local and one remote address per device, and a ``KvCache`` has one address list per device.
Here every device is one async endpoint (the same cluster id, its own listener and memory):
device *i* links to the peer's device *i*, and each cache call runs on every device.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._api_checks import check_clusters
from .._checks import check_isinstance
from .._cluster import LLMClusterInfo
from .._enums import LLMStatusCode
from .._errors import LLMException, raise_param
from .._faces import face_of
from .._kv_cache_manager import KvCache, KvCacheManager, Tensor
from .._sync_loop import LoopThread
from .._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
)

__all__ = ["MultiDeviceKvCacheManager", "check_link_devices", "link_devices"]

T = TypeVar("T")
_OK = LLMStatusCode.LLM_SUCCESS


# ====================================================================== links
def _device_cluster(c: LLMClusterInfo, local: tuple[int | str, int] | None, remote: Any) -> Any:
    one = LLMClusterInfo()
    assert c.remote_cluster_id is not None
    one.remote_cluster_id = c.remote_cluster_id
    one.remote_role_type = c.remote_role_type
    if local is not None:
        one.append_local_ip_info(*local)
    if remote is not None:
        one.append_remote_ip_info(*remote)
    return one


async def link_devices(
    devices: Sequence[Any],
    clusters: Sequence[LLMClusterInfo],
    timeout: int,
    unlink: bool = False,
    force: bool = False,
) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    """``link_clusters`` (or ``unlink_clusters``) of every device: device ``i`` to the
    address ``remote_ip_info_list[i]`` of each cluster, all devices at once.

    A cluster's code is its first failing device's code (SUCCESS if none); it is
    LLM_PARAM_INVALID without one remote address per device (not needed for a forced unlink)
    or with a local address count other than 0, 1 or one per device. A cluster that linked on
    some devices but failed on others is unlinked (force) where it linked.

    Raises:
        TypeError / ValueError / LLMException: as one endpoint's ``link_clusters``.
    """
    check_clusters(clusters, timeout)
    if unlink:
        check_isinstance("force", force, bool)
    if not clusters:
        return LLMStatusCode.LLM_PARAM_INVALID, []
    n = len(devices)
    codes: list[LLMStatusCode | None] = [None] * len(clusters)
    per_device: list[list[tuple[int, LLMClusterInfo]]] = [[] for _ in range(n)]
    for j, c in enumerate(clusters):
        remotes, locals_ = c.remote_ip_info_list, c.local_ip_info_list
        need_remote = not (unlink and force)
        if ((need_remote or remotes) and len(remotes) != n) or len(locals_) not in (0, 1, n):
            codes[j] = LLMStatusCode.LLM_PARAM_INVALID
            continue
        for i in range(n):
            local = locals_[i if len(locals_) == n else 0] if locals_ else None
            per_device[i].append((j, _device_cluster(c, local, remotes[i] if remotes else None)))

    async def one(i: int) -> list[LLMStatusCode]:
        infos = [ci for _, ci in per_device[i]]
        if not infos:
            return []
        if unlink:
            return (await devices[i].unlink_clusters(infos, timeout, force))[1]
        return (await devices[i].link_clusters(infos, timeout))[1]

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    by_cluster: dict[int, list[LLMStatusCode]] = {}
    for i, got in enumerate(results):
        assert isinstance(got, list)
        for (j, _), code in zip(per_device[i], got, strict=True):
            by_cluster.setdefault(j, []).append(code)
    for j, device_codes in by_cluster.items():
        failed = [c for c in device_codes if c != _OK]
        codes[j] = failed[0] if failed else _OK
        if failed and not unlink:
            for i, code in enumerate(device_codes):  # undo the devices that did link
                if code == _OK:
                    with contextlib.suppress(LLMException):
                        await devices[i].unlink_clusters(
                            [_device_cluster(clusters[j], None, None)], timeout, True
                        )
    final = [c if c is not None else LLMStatusCode.LLM_PARAM_INVALID for c in codes]
    return next((c for c in final if c != _OK), _OK), final


async def check_link_devices(devices: Sequence[Any], remote_cluster_id: int) -> None:
    """``check_link_status`` on every device. Raises as the first failing device does."""
    for device in devices:
        await device.check_link_status(remote_cluster_id)


# ====================================================================== caches
def _parts(name: str, cache: Any, n: int) -> list[Cache]:
    """The per-device caches of ``cache``.

    Raises:
        TypeError: not a Cache. LLMException: LLM_PARAM_INVALID for a CPU cache without one
            address list per device; LLM_KV_CACHE_NOT_EXIST for a cache of another endpoint.
    """
    check_isinstance(name, cache, Cache)
    parts: list[Cache] = list(cache.devices) if isinstance(cache, KvCache) else [cache]
    if len(parts) == n:
        return parts
    if cache.cache_id < 0:
        raise_param(f"{name} needs one address list per device ({n}), got {len(parts)}")
    raise LLMException(
        f"{name}: cache {cache.cache_id} is not a cache of this endpoint's {n} devices",
        status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )


async def _wait(task: Awaitable[Any]) -> None:
    await task


def _per_device(definition: Callable[..., Any], *caches: str) -> Callable[..., Any]:
    """The multi-device face of a legacy movement: the arguments bound as ``definition``
    binds them, the parameters named ``caches`` replaced by each device's part, the call
    started on every device, and all of them awaited."""
    signature = inspect.signature(definition)

    def call(self: MultiDeviceKvCacheManager, name: str, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)

        def start(m: Any, parts: list[Cache]) -> Any:
            one = signature.bind(*bound.args, **bound.kwargs)
            one.arguments.update(zip(caches, parts, strict=True))
            return getattr(m, name)(*one.args[1:], **one.kwargs)

        self._move(start, *((c, bound.arguments[c]) for c in caches))

    return face_of(
        definition, call, returns=None, doc="Each device moves with the peer's same device."
    )


class MultiDeviceKvCacheManager:
    """``LLMDataDist.kv_cache_manager`` in multi-device legacy mode, blocking: every call runs
    on each device's legacy manager, and caches are :class:`KvCache` objects over one cache
    per device. Argument rules and errors are those of the one-device manager."""

    def __init__(
        self,
        check: Callable[[], None],
        devices: Callable[[], Sequence[Any]],
        initialized: Callable[[], bool],
    ) -> None:
        self._check = check
        self._devices = devices
        self._initialized = initialized

    def _managers(self) -> list[Any]:  # on the loop thread
        self._check()
        return [d.kv_cache_manager for d in self._devices()]

    def _each(self, fn: Callable[[list[Any]], T]) -> T:
        return LoopThread.get().call(lambda: fn(self._managers()))

    def _move(self, start: Callable[[Any, list[Cache]], Any], *caches: tuple[str, Any]) -> None:
        """Start ``start(manager, that device's caches)`` on every device, then wait for all.

        Raises:
            LLMException: the first device's failure (after every device finished).
        """

        async def run() -> None:
            managers = self._managers()
            parts = [_parts(name, c, len(managers)) for name, c in caches]
            tasks = []
            try:
                for i, m in enumerate(managers):
                    tasks.append(start(m, [p[i] for p in parts]))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*(_wait(t) for t in tasks), return_exceptions=True)
                raise
            results = await asyncio.gather(*(_wait(t) for t in tasks), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r

        LoopThread.get().run(run)

    # ------------------------------------------------------------------ memory
    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> KvCache:
        """One cache per device, each with ``cache_keys`` bound. Raises as one device does."""

        def run(managers: list[Any]) -> KvCache:
            parts: list[KvCache] = []
            try:
                for m in managers:
                    parts.append(m.allocate_cache(cache_desc, cache_keys))
            except BaseException:
                for m, part in zip(managers, parts, strict=False):
                    for key in cache_keys:
                        with contextlib.suppress(LLMException):
                            m.remove_cache_key(key)
                    with contextlib.suppress(LLMException):
                        m.deallocate_cache(part)
                raise
            return KvCache.of_devices(parts)

        return self._each(run)

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> KvCache:
        def run(managers: list[Any]) -> KvCache:
            parts: list[KvCache] = []
            try:
                for m in managers:
                    parts.append(m.allocate_blocks_cache(cache_desc, blocks_cache_key))
            except BaseException:
                for m, part in zip(managers, parts, strict=False):
                    with contextlib.suppress(LLMException):
                        m.deallocate_cache(part)
                raise
            return KvCache.of_devices(parts)

        return self._each(run)

    def deallocate_cache(self, cache: Cache) -> None:
        def run(managers: list[Any]) -> None:
            for m, part in zip(managers, _parts("cache", cache, len(managers)), strict=True):
                m.deallocate_cache(part)

        self._each(run)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        def run(managers: list[Any]) -> None:
            for m in managers:
                m.remove_cache_key(cache_key)

        self._each(run)

    def get_cache_tensors(self, cache: Cache, tensor_index: int = 0) -> list[Tensor]:
        """Tensor ``tensor_index`` of every device's cache, in device order."""

        def run(managers: list[Any]) -> list[Tensor]:
            parts = _parts("cache", cache, len(managers))
            return [
                m.get_cache_tensors(part, tensor_index)[0]
                for m, part in zip(managers, parts, strict=True)
            ]

        return self._each(run)

    def is_initialized(self) -> bool:
        return self._initialized()

    # ------------------------------------------------------------------ movement
    pull_cache = _per_device(KvCacheManager.pull_cache, "kv_cache")
    pull_blocks = _per_device(KvCacheManager.pull_blocks, "decoder_kv_cache")
    copy_cache = _per_device(KvCacheManager.copy_cache, "dst", "src")
    copy_blocks = _per_device(KvCacheManager.copy_blocks, "cache")
    #: a CPU cache needs one address list per device (``KvCache.create_cpu_cache``)
    swap_blocks = _per_device(KvCacheManager.swap_blocks, "src", "dst")

    def _no_transfer(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Raises: LLMException(LLM_PARAM_INVALID): upstream does not offer it in
        single-process multi-device mode."""
        self._check()
        raise_param(f"{name} cannot be called in single-process multi-device mode")

    transfer_cache_async = face_of(
        KvCacheManager.transfer_cache_async,
        _no_transfer,
        returns=None,
        doc="Not in single-process multi-device mode: raises LLMException(LLM_PARAM_INVALID).",
    )
