"""The running engine behind one initialised ``LLMDataDist``: memory, registry and tasks.

It lives exactly as long as the task group of ``LLMDataDist.running()``; nothing here is global.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
from anyio.abc import TaskGroup

from ._busy_poll import BusyPoll
from ._devices import DeviceAdapter, DevicePool, load_adapter
from ._drivers import (
    LoopEvent,
    Wakeup,
    event_factory,
    loop_clock,
    soon_caller,
    threadsafe_caller,
    wakeup_factory,
)
from ._enums import LLMRole, LLMStatusCode, Placement
from ._log import get_logger
from ._memory import EpochPage, MemoryPool, populate
from ._net.host import ScratchPool
from ._net.link import Link
from ._net.link_manager import LinkManager
from ._net.streams import VIEWS_INLINE, ManyRangesStream
from ._observe import Observers
from ._options import EngineOptions
from ._registry import CacheEntry, Registry
from ._task import CacheTask, SchedulePoints, TaskControl
from ._timers import Timers
from ._transports import TransportEndpoint, start_endpoint
from ._transports._staging import LinkStaging, StagedStream
from ._transports.tcp import StreamPlan

__all__ = ["Engine"]


class Engine:
    """State and task group of one initialised endpoint: the host of its links
    (``_net.host.LinkHost``)."""

    def __init__(
        self,
        role: LLMRole,
        cluster_id: int,
        options: EngineOptions,
        observers: Observers | None = None,
    ) -> None:
        self.role = role
        self.cluster_id = cluster_id
        self.options = options
        #: told of transfers and links as they happen (``llmdd_async.metrics``)
        self.observers = observers if observers is not None else Observers()
        self.log = get_logger("engine", cluster_id=cluster_id)
        self._task_ids = itertools.count(1)
        #: when this endpoint's finished tasks last yielded to the loop (see SchedulePoints)
        self._schedule_points = SchedulePoints()
        self.registry = Registry()
        self.adapter: DeviceAdapter = load_adapter(
            options.raw.get("llm.DeviceAdapter", "host"), dict(options.raw)
        )
        self.pools: dict[Placement, DevicePool] = {}
        self._tg: TaskGroup | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        #: calls a function on the loop thread, from any thread (the running backend's)
        self._threadsafe: Callable[[Callable[[], None]], None] | None = None
        self._soon: Callable[[Callable[[], None]], bool] | None = None
        self._thread: int | None = None
        self.closed = False
        #: caches whose pages are being faulted in, by first tensor address
        self._populating: dict[int, anyio.Event] = {}
        #: scratch buffers borrowed by links that must discard incoming bytes
        self.scratch = ScratchPool()
        #: set by ``link()`` (comm-domain links): later registrations default to not accessible.
        self.comm_linked = False
        self.links = LinkManager(self)
        #: the endpoint-wide half of the chosen transport (NIXL's agent), if it has one: made
        #: when the engine starts
        self.transport_endpoint: TransportEndpoint | None = None
        #: bumped whenever a cache id is released; same-host peers map it (one-sided pulls)
        self.epoch: EpochPage | None = None
        #: deadlines of transfers that run without a task of their own; ``timers.now()`` is
        #: the loop's clock
        self.timers = Timers()
        #: llm.BusyPoll: keeps the loop polling for a while after link traffic (links kick it)
        self.busy_poll = BusyPoll(options.busy_poll_s)
        #: makes the running backend's own event (set on the loop thread): cheaper than an
        #: ``anyio.Event`` where one is made per layer
        self.new_event: Callable[[], LoopEvent] = anyio.Event
        #: makes the running backend's :class:`Wakeup` (None while the engine is not running)
        self._new_wakeup: Callable[[], Wakeup] | None = None

    @property
    def listen_host(self) -> str | None:
        """The address of ``llm.listenIpInfo``, or None when the endpoint does not listen."""
        return self.options.listen[0] if self.options.listen is not None else None

    @property
    def sync_kv_timeout_s(self) -> float:
        return self.options.sync_kv_timeout_ms / 1000

    def _create_pools(self) -> None:
        device_pool = self.options.device_pool
        if device_pool is None and not self.options.cache_manager:
            device_pool = self.options.legacy_kv_pool
        if device_pool is not None:
            self.pools[Placement.DEVICE] = self.adapter.create_pool(device_pool, "device")
        if self.options.host_pool is not None:
            self.pools[Placement.HOST] = MemoryPool(self.options.host_pool, "host")

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[Engine]:
        """Open the engine's task group; on exit every task is cancelled and fenced."""
        self._thread = threading.get_ident()
        self._create_pools()
        self.epoch = EpochPage()
        self.registry.on_release = self.epoch.bump
        body_error: BaseException | None = None
        try:
            async with (
                anyio.create_task_group() as tg,
                anyio.from_thread.BlockingPortal() as portal,
            ):
                self._tg = tg
                self._portal = portal
                self._threadsafe = threadsafe_caller()
                self._soon = soon_caller()
                self.new_event = event_factory()
                self._new_wakeup = wakeup_factory()
                self.timers.now = loop_clock()
                tg.start_soon(self.timers.run)
                tg.start_soon(self.busy_poll.run)
                try:
                    await self.start_services()
                    self.log.info("engine.up", role=str(self.role))
                    yield self
                except BaseException as exc:
                    # Re-raised below, outside the task group, so that callers see their own
                    # exception rather than an ExceptionGroup around it.
                    body_error = exc
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.stop_services()
                    tg.cancel_scope.cancel()
        finally:
            self._tg = None
            self._portal = None
            self._threadsafe = None
            self._soon = None
            self.new_event = anyio.Event
            self._new_wakeup = None
            self.timers.now = anyio.current_time
            self.closed = True
            self.registry.close()
            if self.transport_endpoint is not None:
                self.transport_endpoint.close()
                self.transport_endpoint = None
            for pool in self.pools.values():
                pool.close()
            self.pools.clear()
            if self.epoch is not None:
                self.registry.on_release = None
                self.epoch.close()
                self.epoch = None
            self.adapter.close()
            self.log.info("engine.down")
        if body_error is not None:
            raise body_error

    async def start_services(self) -> None:
        """Start the transport's endpoint-wide half (NIXL's agent, ``llm.Transport=nixl``),
        open the same-host side channel; listen when ``llm.listenIpInfo`` was given.

        Raises:
            LLMException: LLM_PARAM_INVALID without the transport's optional package,
                LLM_FAILED when it cannot start; LLM_LINK_FAILED when the listen address
                cannot be bound.
        """
        endpoint = await start_endpoint(self.options.transport, self)
        if endpoint is not None:
            self.transport_endpoint = endpoint
            self.registry.on_add = endpoint.register
            self.registry.on_free = endpoint.deregister
        await self.links.start()
        if self.options.listen is not None:
            await self.links.listen(self.options.listen)

    async def stop_services(self) -> None:
        """Close every link (telling peers) and the listener."""
        await self.links.close_all()

    @property
    def stall_timeout_s(self) -> float:
        """How long a worker waits on a silent peer when no request deadline applies."""
        return max(10.0, self.sync_kv_timeout_s)

    def serve_budget_s(self, tensors: int) -> float:
        """The most a peer's request over ``tensors`` tensors may run here, whatever deadline
        the peer asked for: ``llm.ServeTimeout``, else ``sync_kv_timeout`` per layer (K and V),
        as this side's own pushes get."""
        if self.options.limits.serve_timeout_s:
            return self.options.limits.serve_timeout_s
        return self.sync_kv_timeout_s * max(1, (tensors + 1) // 2)

    def prefault(self, addrs: np.ndarray, nbytes: int) -> None:
        """Fault a newly registered or allocated cache's host pages in, in a worker thread, so
        that its first transfer does not pay page faults (device memory is left alone)."""
        if not self.host_reachable(addrs) or self._tg is None:
            return
        ready = anyio.Event()
        key = int(addrs[0])
        self._populating[key] = ready

        async def job() -> None:
            try:
                done = await anyio.to_thread.run_sync(populate, addrs, nbytes)
                self.log.debug("cache.populated", bytes=done)
            finally:
                ready.set()
                if self._populating.get(key) is ready:
                    del self._populating[key]

        self.spawn(job)

    def is_populated(self, addrs: np.ndarray) -> bool:
        """True unless the pages of the cache at ``addrs`` are still being faulted in."""
        return not self._populating or not len(addrs) or int(addrs[0]) not in self._populating

    async def populated(self, addrs: np.ndarray) -> None:
        """Wait until the pages of the cache at ``addrs`` are faulted in (a transfer started
        right after registration then does not fight the population for them)."""
        ready = self._populating.get(int(addrs[0])) if len(addrs) else None
        if ready is not None:
            await ready.wait()

    def published_table(self) -> dict[str, Any]:
        """This endpoint's cache table, as a peer snapshots it (remote-accessible mode), a
        fresh dict (a link adds what its access tells only its peer: NIXL's metadata)."""
        # The registry's table is built once per change; only what varies is added to a copy.
        table = dict(self.registry.published_table())
        if self.epoch is not None:
            # Where a peer reading our caches one-sidedly checks that its snapshot still holds.
            table["epoch"] = [self.epoch.base, self.epoch.value]
        return table

    def identity_for_link(self) -> dict[str, Any]:
        """What the handshake tells a peer about this endpoint."""
        return self.links.identity()

    def reachable_by_peer(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """Whether the initiator that sent ``caps`` (a peer's claim, already limited to what
        its link's kind allows) may copy these ranges of ours itself."""
        endpoint = self.transport_endpoint
        if endpoint is not None:
            # Caps that ask for the endpoint's transport (NIXL) are its to judge: it may reach
            # device memory too.
            served = endpoint.serves(caps, ranges, nbytes)
            if served is not None:
                return served
        return self.host_reachable(ranges) and self.links.reachable_by_peer(caps, ranges, nbytes)

    def request_caps(self, link: Link, entry: CacheEntry) -> dict[str, bool]:
        """How the initiator of a request from/to ``entry`` can reach the peer's memory (sent
        with the request): the link's access, unless ``entry`` is memory that access cannot
        use (device memory; for NIXL, a cache not registered with the agent)."""
        return link.caps.for_entry(entry, self.host_reachable(entry.addrs))

    def host_reachable(self, addrs: np.ndarray) -> bool:
        """False for device memory of an adapter the CPU cannot address directly."""
        return self.adapter.host_addressable or not self.adapter.owns(addrs)

    def make_stream(
        self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None = None
    ) -> StreamPlan:
        """The stream view of local ranges: direct for host memory, staged for device memory.
        Over many ranges, its frames go through ``staging`` (a link's buffers and threads)."""
        if self.host_reachable(addrs):
            if len(nbytes) > VIEWS_INLINE:
                return ManyRangesStream(addrs, nbytes, staging)
            return StreamPlan(addrs, nbytes)
        return StagedStream(addrs, nbytes, self.adapter, staging)

    async def open_stream(
        self, addrs: np.ndarray, nbytes: np.ndarray, staging: LinkStaging | None = None
    ) -> StreamPlan:
        """:meth:`make_stream` for async callers: a staging buffer (pinned memory, slow to
        allocate) or a stream over many ranges is made in a worker thread (of the link's)."""
        if self.host_reachable(addrs) and len(nbytes) <= VIEWS_INLINE:
            return self.make_stream(addrs, nbytes, staging)
        threads = staging.threads if staging is not None else None
        return await anyio.to_thread.run_sync(
            self.make_stream, addrs, nbytes, staging, limiter=threads
        )

    def threadsafe_event(self) -> tuple[LoopEvent, Callable[[], None]]:
        """An event and a setter that may be called from any thread, without blocking it."""
        event = self.new_event()
        call = self._threadsafe
        loop_thread = self._thread

        def wake() -> None:
            if threading.get_ident() == loop_thread:
                event.set()
            elif call is not None:
                call(event.set)  # a loop callback, not a task (nothing once the loop is gone)

        return event, wake

    def wakeup(self) -> Wakeup:
        """A one-shot wake-up of one waiter, woken from any thread without blocking it (a
        model's layer signal): cheaper than :meth:`threadsafe_event`.

        Raises:
            RuntimeError: the engine is not running.
        """
        if self._new_wakeup is None:
            raise RuntimeError("the engine is not running")
        return self._new_wakeup()

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` soon on the loop; safe from any thread and from ``__del__``."""
        if self._tg is None:
            return

        async def run() -> None:
            fn()

        if threading.get_ident() == self._thread:
            self.spawn(run)
        elif self._portal is not None:
            with contextlib.suppress(RuntimeError):
                self._portal.start_task_soon(self._guarded, run, ())

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a user's blocking callback in a daemon thread and await its result.

        If the awaiting task is cancelled the callback is left to finish on its own; being a
        daemon thread it never keeps the process alive.

        Raises:
            BaseException: whatever the callback raised.
        """
        event, wake = self.threadsafe_event()
        box: dict[str, Any] = {}

        def runner() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as exc:
                box["error"] = exc
            finally:
                wake()

        threading.Thread(target=runner, daemon=True, name="llmdd-callback").start()
        await event.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def check_thread(self) -> None:
        """Raises RuntimeError when called off the engine's event-loop thread."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "llmdd_async engine calls must be made from the event loop thread that runs "
                "it; from other threads use llmdd_async.sync"
            )

    def loop_callback(self) -> Callable[[Callable[[], None]], None] | None:
        """A function that, from any thread, has the loop run ``fn()`` in a loop callback (no
        task; it must not raise): on asyncio and uvloop. None on trio, whose callbacks run
        outside any task, where the library does not spawn tasks or take locks, and when the
        engine is not running."""
        return self._threadsafe if self._soon is not None else None

    def soon(self, fn: Callable[[], None]) -> bool:
        """On the loop thread: run ``fn()`` in a loop callback once what is ready to run now
        has run (no task); it must not raise. False, with nothing scheduled, where the
        backend has no cheap way (trio: :func:`._drivers.soon_caller`) or the engine is not
        running."""
        return self._soon is not None and self._soon(fn)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the engine's task group; a crash is logged, never propagated
        (one failing background job must not take the endpoint down)."""
        if self._tg is None:
            raise RuntimeError("llm datadist is not initialized")
        self._tg.start_soon(self._guarded, fn, args)

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception:
            self.log.exception("engine.job_crashed", job=getattr(fn, "__qualname__", repr(fn)))

    @property
    def timeout_code(self) -> LLMStatusCode:
        """The code of transfer timeouts: LLM_TIMEOUT, or upstream's legacy
        LLM_WAIT_PROCESS_TIMEOUT when cache-manager mode is off."""
        if self.options.cache_manager:
            return LLMStatusCode.LLM_TIMEOUT
        return LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT

    def new_task(
        self, kind: str, slots: Any = (0,), peer_cluster_ids: tuple[int, ...] = ()
    ) -> CacheTask:
        return CacheTask(
            kind,
            slots,
            timeout_code=self.timeout_code,
            log=self.log,
            observers=self.observers,
            task_id=next(self._task_ids),
            peer_cluster_ids=peer_cluster_ids,
            schedule_points=self._schedule_points,
            new_event=self.new_event,
        )

    def start_task(
        self,
        task: CacheTask,
        body: Callable[[TaskControl], Awaitable[None]],
        deadline_s: float | None = None,
    ) -> CacheTask:
        """Schedule ``body`` as ``task`` and return it (already running)."""
        self.check_thread()
        if self._tg is None:
            raise RuntimeError("llm datadist is not initialized")
        self._tg.start_soon(task.run_body, body, deadline_s)
        return task
