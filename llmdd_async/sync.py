"""The blocking facade: ``llm_datadist``'s API, names and semantics, over llmdd_async.

Client code written for Huawei's ``llm_datadist`` runs by changing its import::

    from llmdd_async.sync import LLMDataDist, LLMConfig, LLMRole, CacheDesc, ...

Every call blocks its calling thread (never an event loop) and is safe from many threads at
once: the work runs on one background event-loop thread per process (uvloop when installed).
As upstream, one ``LLMDataDist`` may be initialised per process (a second raises
``LLMException(LLM_FAILED)``), ``finalize()`` then ``init()`` again on the same object works,
calls before ``init()`` raise ``RuntimeError("llm datadist is not initialized")``, an
``atexit`` hook finalises the live instance, ``link_clusters`` returns codes, and transfers
raise ``LLMException`` with upstream's status codes. ``transfer_cache_async`` returns a
:class:`CacheTask` whose ``synchronize()`` / ``get_results()`` block.

The C++-style surface (``LlmDataDist``, ``CacheIndex``, ``KvCacheExtParam``, returning status
codes) is here too, for clients ported from the C++ API.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _datadist
from ._config import LLMConfig, LlmConfig
from ._enums import DataType, LLMRole, LLMStatusCode, Memtype, Placement, RegisterMemStatus
from ._errors import LLMException, Status
from ._kv_cache_manager import KvCache, Tensor, TensorDesc
from ._sync_loop import LoopThread
from ._synchronizer import LayerSynchronizer
from ._task import CacheTask as _AsyncCacheTask
from ._task import TaskStatistics
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMClusterInfo,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "KvCache",
    "KvCacheExtParam",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LlmConfig",
    "LlmDataDist",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "Tensor",
    "TensorDesc",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]

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
        """One code per transfer config (None where no layer started)."""
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


def _bookkeeping(name: str) -> Callable[..., Any]:
    def method(self: _ManagerBase, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Blocking ``{name}`` (see the async manager's method for its rules)."
    return method


def _movement(name: str) -> Callable[..., None]:
    def method(self: _ManagerBase, *args: Any, **kwargs: Any) -> None:
        self._move(name, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = (
        f"Blocking ``{name}``: returns once the data moved; raises LLMException(status) on "
        "failure, TypeError / ValueError / LLMException(LLM_PARAM_INVALID) for bad arguments."
    )
    return method


class _ManagerBase:
    def __init__(self, owner: LLMDataDist, get: Callable[[], Any]) -> None:
        self._owner = owner
        self._get = get

    def _manager(self) -> Any:
        self._owner._check()
        return self._get()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            return getattr(self._manager(), name)(*args, **kwargs)

        return LoopThread.get().call(run)

    def _move(self, name: str, *args: Any, **kwargs: Any) -> None:
        async def run() -> None:
            await getattr(self._manager(), name)(*args, **kwargs)

        LoopThread.get().run(run)

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Start a layer-wise push; the synchronizer runs in a worker thread. Raises at once
        for bad arguments (TypeError / ValueError / LLMException)."""
        task = self._call(
            "transfer_cache_async",
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
        )
        return CacheTask(task)


class CacheManager(_ManagerBase):
    """``LLMDataDist.cache_manager`` (cache-manager mode), blocking."""

    register_cache = _bookkeeping("register_cache")
    register_blocks_cache = _bookkeeping("register_blocks_cache")
    unregister_cache = _bookkeeping("unregister_cache")
    allocate_cache = _bookkeeping("allocate_cache")
    allocate_blocks_cache = _bookkeeping("allocate_blocks_cache")
    deallocate_cache = _bookkeeping("deallocate_cache")
    deallocate_blocks_cache = _bookkeeping("deallocate_blocks_cache")
    remove_cache_key = _bookkeeping("remove_cache_key")
    remap_registered_memory = _bookkeeping("remap_registered_memory")
    pull_cache = _movement("pull_cache")
    pull_blocks = _movement("pull_blocks")
    push_cache = _movement("push_cache")
    push_blocks = _movement("push_blocks")
    copy_cache = _movement("copy_cache")
    copy_blocks = _movement("copy_blocks")
    swap_blocks = _movement("swap_blocks")


class KvCacheManager(_ManagerBase):
    """``LLMDataDist.kv_cache_manager`` (legacy mode), blocking."""

    allocate_cache = _bookkeeping("allocate_cache")
    allocate_blocks_cache = _bookkeeping("allocate_blocks_cache")
    deallocate_cache = _bookkeeping("deallocate_cache")
    remove_cache_key = _bookkeeping("remove_cache_key")
    get_cache_tensors = _bookkeeping("get_cache_tensors")
    pull_cache = _movement("pull_cache")
    pull_blocks = _movement("pull_blocks")
    copy_cache = _movement("copy_cache")
    copy_blocks = _movement("copy_blocks")
    swap_blocks = _movement("swap_blocks")

    def is_initialized(self) -> bool:
        return self._owner.is_initialized()


_live_lock = threading.Lock()
_live: list[LLMDataDist] = []  # the one initialised instance, as upstream


def _finalize_at_exit() -> None:
    for dist in list(_live):
        with contextlib.suppress(LLMException):
            dist.finalize()


atexit.register(_finalize_at_exit)


class LLMDataDist:
    """Upstream's ``LLMDataDist(role, cluster_id)``, blocking.

    Raises:
        TypeError: ``role`` is not an LLMRole. TypeError / ValueError: bad ``cluster_id``.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._async = _datadist.LLMDataDist(role, cluster_id)
        self._cm: CacheManager | None = None
        self._kvm: KvCacheManager | None = None

    @property
    def cluster_id(self) -> int:
        return self._async.cluster_id

    def _check(self) -> None:
        if not self._async.is_initialized():
            raise RuntimeError(_NOT_INITIALIZED)

    def init(self, options: Mapping[str, str]) -> None:
        """Start the endpoint. Returns at once if already initialised.

        Raises:
            LLMException: LLM_FAILED while another instance is initialised in this process;
                LLM_PARAM_INVALID for bad options; others as the engine reports.
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
            LoopThread.get().run(self._async.init, options)
            _live[:] = [self]

    def finalize(self) -> None:
        """Stop the endpoint (unlink, cancel, free). Idempotent."""
        with _live_lock:
            if self._async.is_initialized():
                LoopThread.get().run(self._async.finalize)
            if _live and _live[0] is self:
                _live.clear()

    def is_initialized(self) -> bool:
        return self._async.is_initialized()

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` this endpoint listens on (useful with port 0), or None."""
        self._check()
        return LoopThread.get().call(lambda: self._async.listen_address)

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return LoopThread.get().run(getattr(self._async, name), *args, **kwargs)

    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """``(overall, per_cluster)``; link failures never raise (see the async method)."""
        return self._run("link_clusters", clusters, timeout)

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        return self._run("unlink_clusters", clusters, timeout, force)

    def switch_role(self, role: LLMRole, switch_options: Mapping[str, str] | None = None) -> None:
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
        self._run("check_link_status", remote_cluster_id)

    @property
    def cache_manager(self) -> CacheManager:
        """Raises RuntimeError before init, LLMException(PARAM) in legacy mode."""
        self._check()
        LoopThread.get().call(lambda: self._async.cache_manager)
        if self._cm is None:
            self._cm = CacheManager(self, lambda: self._async.cache_manager)
        return self._cm

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """Raises RuntimeError before init, LLMException(PARAM) in cache-manager mode."""
        self._check()
        LoopThread.get().call(lambda: self._async.kv_cache_manager)
        if self._kvm is None:
            self._kvm = KvCacheManager(self, lambda: self._async.kv_cache_manager)
        return self._kvm


from ._cpp_style import CacheIndex, KvCacheExtParam, LlmDataDist  # noqa: E402
