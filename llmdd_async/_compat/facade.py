"""The blocking facade's classes: ``LLMDataDist``, its managers and ``CacheTask``.

Published by :mod:`llmdd_async.sync` (with the C++-style surface of :mod:`._cpp_style`, which
builds on these classes). Every call blocks its calling thread and runs on the process's one
background event-loop thread (:class:`._sync_loop.LoopThread`).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _cache_manager as _async_cm
from .. import _datadist
from .. import _kv_cache_manager as _async_kvm
from .._cluster import LLMClusterInfo
from .._config import legacy_device_options
from .._enums import LLMRole, LLMStatusCode, RegisterMemStatus
from .._errors import LLMException, raise_param
from .._faces import face_of
from .._log import get_logger
from .._sync_loop import LoopThread
from .._task import CacheTask as _AsyncCacheTask
from .._task import TaskStatistics
from .multi_device import MultiDeviceKvCacheManager, check_link_devices, link_devices

__all__ = ["CacheManager", "CacheTask", "KvCacheManager", "LLMDataDist"]

_NOT_INITIALIZED = "llm datadist is not initialized"


class CacheTask:
    """A running transfer; ``synchronize`` and ``get_results`` block (their timeouts do not
    cancel the transfer, as upstream)."""

    def __init__(self, task: _AsyncCacheTask) -> None:
        self._task = task

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait (forever when None); the first failing code, or SUCCESS, or the default timeout
        code if still running. Raises TypeError / ValueError for a bad timeout."""
        return LoopThread.get().run(self._task.synchronize, timeout_in_millis)

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One code per transfer config (None where no layer started and nothing failed for it)."""
        return LoopThread.get().run(self._task.get_results, timeout_in_millis)

    def cancel(self) -> None:
        """Stop the transfer and wait until it is fenced (its buffers are no longer touched)."""
        LoopThread.get().run(self._cancel_and_wait)

    async def _cancel_and_wait(self) -> None:
        self._task.cancel()
        with contextlib.suppress(LLMException):
            await self._task

    def done(self) -> bool:
        return self._task.done()

    def statistics(self) -> TaskStatistics:
        return self._task.statistics()


def _bookkeeping(definition: Callable[..., Any]) -> Callable[..., Any]:
    """The blocking face of a manager method that returns at once (registration, keys)."""

    def call(self: _ManagerBase, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    return face_of(definition, call, doc=f"Blocking ``{definition.__name__}``.")


def _movement(definition: Callable[..., Any]) -> Callable[..., Any]:
    """The blocking face of a manager method that returns a task: it waits for the task."""

    def call(self: _ManagerBase, name: str, *args: Any, **kwargs: Any) -> None:
        self._move(name, *args, **kwargs)

    return face_of(
        definition,
        call,
        returns=None,
        doc=(
            f"Blocking ``{definition.__name__}``: returns once the data moved; raises "
            "LLMException(status) on failure, TypeError / ValueError / "
            "LLMException(LLM_PARAM_INVALID) for bad arguments."
        ),
    )


def _starter(definition: Callable[..., Any]) -> Callable[..., Any]:
    """The face of ``transfer_cache_async``: the task, with blocking ``synchronize``."""

    def call(self: _ManagerBase, name: str, *args: Any, **kwargs: Any) -> CacheTask:
        return CacheTask(self._call(name, *args, **kwargs))

    return face_of(
        definition,
        call,
        returns="CacheTask",
        doc=(
            "Start a layer-wise push; the synchronizer runs in a worker thread. Raises at once "
            "for bad arguments (TypeError / ValueError / LLMException)."
        ),
    )


class _ManagerBase:
    def __init__(self, check: Callable[[], None], get: Callable[[], Any]) -> None:
        self._check = check
        self._get = get

    def _manager(self) -> Any:
        self._check()
        return self._get()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            return getattr(self._manager(), name)(*args, **kwargs)

        return LoopThread.get().call(run)

    def _move(self, name: str, *args: Any, **kwargs: Any) -> None:
        async def run() -> None:
            await getattr(self._manager(), name)(*args, **kwargs)

        LoopThread.get().run(run)


class CacheManager(_ManagerBase):
    """``LLMDataDist.cache_manager`` (cache-manager mode), blocking: each method is the async
    :class:`llmdd_async.CacheManager`'s, with its signature."""

    register_cache = _bookkeeping(_async_cm.CacheManager.register_cache)
    register_blocks_cache = _bookkeeping(_async_cm.CacheManager.register_blocks_cache)
    unregister_cache = _bookkeeping(_async_cm.CacheManager.unregister_cache)
    allocate_cache = _bookkeeping(_async_cm.CacheManager.allocate_cache)
    allocate_blocks_cache = _bookkeeping(_async_cm.CacheManager.allocate_blocks_cache)
    deallocate_cache = _bookkeeping(_async_cm.CacheManager.deallocate_cache)
    deallocate_blocks_cache = _bookkeeping(_async_cm.CacheManager.deallocate_blocks_cache)
    remove_cache_key = _bookkeeping(_async_cm.CacheManager.remove_cache_key)
    remap_registered_memory = _bookkeeping(_async_cm.CacheManager.remap_registered_memory)
    pull_cache = _movement(_async_cm.CacheManager.pull_cache)
    pull_blocks = _movement(_async_cm.CacheManager.pull_blocks)
    push_cache = _movement(_async_cm.CacheManager.push_cache)
    push_blocks = _movement(_async_cm.CacheManager.push_blocks)
    copy_cache = _movement(_async_cm.CacheManager.copy_cache)
    copy_blocks = _movement(_async_cm.CacheManager.copy_blocks)
    swap_blocks = _movement(_async_cm.CacheManager.swap_blocks)
    transfer_cache_async = _starter(_async_cm.CacheManager.transfer_cache_async)
    # the C++ API's PullKvBlocks / PushKvBlocks (used by the C++-style face)
    pull_blocks_by_id = _movement(_async_cm.CacheManager.pull_blocks_by_id)
    push_blocks_by_id = _movement(_async_cm.CacheManager.push_blocks_by_id)


class KvCacheManager(_ManagerBase):
    """``LLMDataDist.kv_cache_manager`` (legacy mode), blocking: each method is the async
    legacy manager's, with its signature."""

    allocate_cache = _bookkeeping(_async_kvm.KvCacheManager.allocate_cache)
    allocate_blocks_cache = _bookkeeping(_async_kvm.KvCacheManager.allocate_blocks_cache)
    deallocate_cache = _bookkeeping(_async_kvm.KvCacheManager.deallocate_cache)
    remove_cache_key = _bookkeeping(_async_kvm.KvCacheManager.remove_cache_key)
    get_cache_tensors = _bookkeeping(_async_kvm.KvCacheManager.get_cache_tensors)
    pull_cache = _movement(_async_kvm.KvCacheManager.pull_cache)
    pull_blocks = _movement(_async_kvm.KvCacheManager.pull_blocks)
    copy_cache = _movement(_async_kvm.KvCacheManager.copy_cache)
    copy_blocks = _movement(_async_kvm.KvCacheManager.copy_blocks)
    swap_blocks = _movement(_async_kvm.KvCacheManager.swap_blocks)
    transfer_cache_async = _starter(_async_kvm.KvCacheManager.transfer_cache_async)

    def __init__(
        self, check: Callable[[], None], get: Callable[[], Any], initialized: Callable[[], bool]
    ) -> None:
        super().__init__(check, get)
        self._initialized = initialized

    def is_initialized(self) -> bool:
        return self._initialized()


_live_lock = threading.Lock()
_live: list[LLMDataDist] = []  # the one initialised instance, as upstream


def _finalize_at_exit() -> None:
    for dist in list(_live):
        with contextlib.suppress(LLMException):
            dist.finalize()


atexit.register(_finalize_at_exit)


class LLMDataDist:
    """Upstream's ``LLMDataDist(role, cluster_id)``, blocking.

    In legacy mode with several devices (``llm.ClusterInfo``'s ``logic_device_id`` list, or a
    ``;``-separated ``ge.exec.deviceId``) it is upstream's single-process multi-device mode:
    each device is one endpoint listening on its own ``listen_ip_info`` entry, an
    ``LLMClusterInfo`` carries one local and one remote address per device (device *i* links
    to the peer's device *i*), and the ``kv_cache_manager`` allocates, pulls and copies on
    every device (``KvCache.per_device_tensor_addrs``).

    Raises:
        TypeError: ``role`` is not an LLMRole. TypeError / ValueError: bad ``cluster_id``.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._async = _datadist.LLMDataDist(role, cluster_id)
        #: one async endpoint per device; device 0 is ``_async``
        self._devices: list[_datadist.LLMDataDist] = [self._async]
        self._cm: CacheManager | None = None
        self._kvm: KvCacheManager | None = None
        self._multi_kvm: MultiDeviceKvCacheManager | None = None

    @property
    def cluster_id(self) -> int:
        return self._async.cluster_id

    @property
    def _multi(self) -> bool:
        return len(self._devices) > 1

    def _check(self) -> None:
        if not self._async.is_initialized():
            raise RuntimeError(_NOT_INITIALIZED)

    def init(self, options: Mapping[str, str]) -> None:
        """Start the endpoint (one per device in multi-device legacy mode). Returns at once if
        already initialised.

        Raises:
            LLMException: LLM_FAILED while another instance is initialised in this process;
                LLM_PARAM_INVALID for bad options (a multi-device PROMPT without one listen
                address per device included); others as the engine reports.
            TypeError: options not a dict of str.
        """
        if self._async.is_initialized():
            return
        with _live_lock:
            if _live and _live[0] is not self:
                raise LLMException(
                    "another LLMDataDist is already initialized in this process",
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            per_device = legacy_device_options(options)
            role, cid = self._async.role, self._async.cluster_id
            devices = [self._async] + [_datadist.LLMDataDist(role, cid) for _ in per_device[1:]]
            LoopThread.get().run(_init_devices, devices, per_device)
            engine = self._async._engine  # (started on the loop thread: read, not called)
            if engine is not None and engine.options.busy_poll_s:
                # The loop thread would hold the GIL between its polls while the callers'
                # threads run Python: they wait for it, and the calls get slower, not faster.
                get_logger("engine", cluster_id=cid).warning(
                    "option.busy_poll_with_blocking_calls",
                    advice="leave llm.BusyPoll off with the blocking API (docs: tuning)",
                )
            self._devices = devices
            _live[:] = [self]

    def finalize(self) -> None:
        """Stop the endpoint (unlink, cancel, free) on every device. Idempotent."""
        with _live_lock:
            if self._async.is_initialized():
                LoopThread.get().run(_finalize_devices, self._devices)
            if _live and _live[0] is self:
                _live.clear()

    def is_initialized(self) -> bool:
        return self._async.is_initialized()

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` this endpoint (device 0) listens on (useful with port 0), or None."""
        self._check()
        return LoopThread.get().call(lambda: self._async.listen_address)

    @property
    def listen_addresses(self) -> list[tuple[str, int] | None]:
        """What each device listens on (one entry unless in multi-device mode)."""
        self._check()
        return LoopThread.get().call(lambda: [d.listen_address for d in self._devices])

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return LoopThread.get().run(getattr(self._async, name), *args, **kwargs)

    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """``(overall, per_cluster)``; link failures never raise (see the async method). With
        several devices each cluster needs one remote address per device (else its code is
        LLM_PARAM_INVALID); a cluster that fails on one device is unlinked on the others."""
        if self._multi:
            self._check()
            return LoopThread.get().run(link_devices, self._devices, clusters, timeout)
        return self._run("link_clusters", clusters, timeout)

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """As the async method; with several devices, on each device (remote addresses: one
        per device, needed unless ``force``)."""
        if self._multi:
            self._check()
            return LoopThread.get().run(link_devices, self._devices, clusters, timeout, True, force)
        return self._run("unlink_clusters", clusters, timeout, force)

    def wait_for_link(self, cluster_id: int, timeout_in_millis: int | None = None) -> None:
        """Block until ``cluster_id`` has a live link to this endpoint (either side made it).

        Raises:
            LLMException: LLM_TIMEOUT when none came in time (see the async method).
        """
        self._run("wait_for_link", cluster_id, timeout_in_millis)

    def link_failure(self, cluster_id: int) -> str | None:
        """Why the last link to ``cluster_id`` failed or broke; None once a link is up."""
        self._check()
        return LoopThread.get().call(self._async.link_failure, cluster_id)

    def switch_role(self, role: LLMRole, switch_options: Mapping[str, str] | None = None) -> None:
        """Raises as the async method; LLMException(LLM_PARAM_INVALID) with several devices
        (not supported there, as upstream)."""
        if self._multi:
            self._check()
            raise_param("switch_role is not supported in single-process multi-device mode")
        self._run("switch_role", role, switch_options)

    def link(self, comm_name: str, cluster_rank_info: Mapping[int, int], rank_table: str) -> int:
        """Join a comm domain; poll ``query_register_mem_status`` until OK."""
        return self._run("link", comm_name, cluster_rank_info, rank_table)

    def unlink(self, comm_id: int) -> None:
        self._run("unlink", comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        self._check()
        return LoopThread.get().call(self._async.query_register_mem_status, comm_id)

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Raises as the async method (for the first device whose link fails)."""
        if self._multi:
            self._check()
            LoopThread.get().run(check_link_devices, self._devices, remote_cluster_id)
            return
        self._run("check_link_status", remote_cluster_id)

    @property
    def cache_manager(self) -> CacheManager:
        """Raises RuntimeError before init, LLMException(PARAM) in legacy mode."""
        self._check()
        LoopThread.get().call(lambda: self._async.cache_manager)
        if self._cm is None:
            self._cm = CacheManager(self._check, lambda: self._async.cache_manager)
        return self._cm

    @property
    def kv_cache_manager(self) -> KvCacheManager | MultiDeviceKvCacheManager:
        """Raises RuntimeError before init, LLMException(PARAM) in cache-manager mode."""
        self._check()
        LoopThread.get().call(lambda: self._async.kv_cache_manager)
        if self._multi:
            if self._multi_kvm is None:
                self._multi_kvm = MultiDeviceKvCacheManager(
                    self._check, lambda: self._devices, self.is_initialized
                )
            return self._multi_kvm
        if self._kvm is None:
            self._kvm = KvCacheManager(
                self._check, lambda: self._async.kv_cache_manager, self.is_initialized
            )
        return self._kvm


async def _init_devices(devices: list[_datadist.LLMDataDist], options: list[Any]) -> None:
    """Initialise every device's endpoint; on a failure, stop those already started."""
    started: list[_datadist.LLMDataDist] = []
    try:
        for device, opts in zip(devices, options, strict=True):
            await device.init(opts)
            started.append(device)
    except BaseException:
        await _finalize_devices(started)
        raise


async def _finalize_devices(devices: list[_datadist.LLMDataDist]) -> None:
    for device in reversed(devices):
        with contextlib.suppress(LLMException):
            await device.finalize()
