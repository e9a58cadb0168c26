"""``CacheTask``: the awaitable handle of one scheduled data movement (DESIGN §2)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from ._checks import check_uint32
from ._enums import LLMStatusCode
from ._errors import (
    CopyCancelled,
    LLMException,
    TransferCancelled,
    is_caller_facing,
    status_from_exception,
)
from ._log import get_logger
from ._memory import CancelToken
from ._observe import Observers

if TYPE_CHECKING:
    from ._drivers import LoopEvent

__all__ = ["CacheTask", "LayerTiming", "SchedulePoints", "TaskStatistics", "busy_time"]

_log = get_logger("transfer")


class SchedulePoints:
    """When an endpoint's finished tasks last let other tasks run. Awaiting a task that is
    already done (a small one-sided copy finishes inside the call) raises at once for a cancel
    already made, and is a schedule point (a loop turn: about 10 µs, a tenth of such a pull)
    once ``slice_s`` passed since the last one: a loop of such awaits still lets every other
    task of the loop run at least that often, and a deadline that passes meanwhile is seen
    that much later at most."""

    __slots__ = ("_last", "slice_s")

    def __init__(self, slice_s: float = 1e-3) -> None:
        self.slice_s = slice_s
        self._last = time.perf_counter()

    def due(self) -> bool:
        """True (and the time noted) when the next await should yield to the loop."""
        now = time.perf_counter()
        if now - self._last < self.slice_s:
            return False
        self._last = now
        return True


@dataclasses.dataclass(frozen=True)
class LayerTiming:
    """When one layer became ready, started moving and landed (seconds on the task's clock)."""

    layer: int
    ready: float
    started: float
    finished: float
    nbytes: int


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclasses.dataclass(frozen=True)
class TaskStatistics:
    """What a task moved and how fast. ``descriptors`` counts copies after coalescing.

    ``seconds`` is wall time, from the task's start to its end. ``busy_seconds`` is the time
    bytes were moving: for a layer-wise transfer the union of its layers' transfer intervals
    (waiting for the synchronizer or for the link is not counted), else the wall time.
    """

    kind: str
    bytes: int
    descriptors: int
    seconds: float
    layers: tuple[LayerTiming, ...] = ()
    #: ``time.perf_counter()`` when the task started: layer times are relative to it
    started: float = 0.0
    #: seconds during which bytes were moving (see the class docstring); not given: ``seconds``
    busy_seconds: float = -1.0

    def __post_init__(self) -> None:
        if self.busy_seconds < 0:
            object.__setattr__(self, "busy_seconds", self.seconds)

    @property
    def gbps(self) -> float:
        """Decimal gigabytes per second while bytes were moving (``bytes / busy_seconds``)."""
        return self.bytes / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0

    @property
    def wall_gbps(self) -> float:
        """Decimal gigabytes per second over the whole task (``bytes / seconds``)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TaskControl:
    """What a running task body uses to report progress and observe cancellation."""

    def __init__(self, task: CacheTask, deadline: float | None) -> None:
        self._task = task
        self.token = task._token
        #: ``time.monotonic()`` at which the task times out, or None
        self.deadline = deadline
        self.t0 = time.perf_counter()
        task._t0 = self.t0

    def set_deadline(self, seconds: float | None) -> None:
        """(Re)start the deadline: ``seconds`` from now, or none. Applies to the task's scope
        and, through the token, to its worker threads."""
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.token.deadline = self.deadline
        scope = self._task._scope
        if scope is not None:
            scope.deadline = math.inf if seconds is None else anyio.current_time() + seconds

    def add(self, nbytes: int, descriptors: int) -> None:
        self._task._bytes += nbytes
        self._task._descriptors += descriptors

    def layer_done(
        self, layer: int, ready: float, started: float, finished: float, nbytes: int
    ) -> None:
        """A layer landed (the task's clock): a :class:`LayerTiming` of
        :meth:`CacheTask.statistics` (made only then: a frozen dataclass costs microseconds,
        once per layer)."""
        self._task._layers.append((layer, ready, started, finished, nbytes))

    def start_slot(self, slot: int) -> None:
        """A result slot (destination) started moving data."""
        self._task._started.add(slot)

    def set_result(self, slot: int, code: LLMStatusCode) -> None:
        self._task._started.add(slot)
        if self._task._results[slot] in (None, LLMStatusCode.LLM_SUCCESS):
            self._task._results[slot] = code

    def now(self) -> float:
        return time.perf_counter() - self.t0


class CacheTask:
    """A data movement that is already scheduled.

    ``await task`` returns on success and raises ``LLMException(status_code)`` on failure.
    Cancelling the scope that awaits it, or calling :meth:`cancel`, *fences* it: once the await
    returns, no worker of this task touches its buffers again. ``synchronize`` and
    ``get_results`` only observe: their timeouts do not cancel the task (as upstream).

    All methods must be called from the event loop thread that runs the engine.
    """

    def __init__(
        self,
        kind: str,
        result_slots: Sequence[int] = (0,),
        timeout_code: LLMStatusCode = LLMStatusCode.LLM_TIMEOUT,
        # ``timeout_code``: what timeouts report (LLM_WAIT_PROCESS_TIMEOUT in legacy mode)
        log: Any = None,
        observers: Observers | None = None,
        task_id: int = 0,
        peer_cluster_ids: Sequence[int] = (),
        schedule_points: SchedulePoints | None = None,
        new_event: Callable[[], LoopEvent] | None = None,
    ) -> None:
        self.kind = kind
        #: the loop's own event class (the engine's: an anyio.Event asks which library runs)
        self._new_event: Callable[[], LoopEvent] = new_event or anyio.Event
        #: the endpoint's (None: every await of a finished task yields to the loop)
        self._schedule_points = schedule_points
        self._task_id = task_id
        self._peers = tuple(peer_cluster_ids)
        self._observers = observers
        self._slots = list(result_slots)
        self._results: list[LLMStatusCode | None] = [None] * (max(self._slots, default=-1) + 1)
        self._started: set[int] = set()
        self._timeout_code = timeout_code
        # Made by the first wait that finds the task running: a task done before anyone waits
        # (a one-sided pull copied within the call) never makes one.
        self._done: LoopEvent | None = None
        self._finished = False
        self._token = CancelToken()
        self._scope: anyio.CancelScope | None = None
        self._canceller: Callable[[], None] | None = None
        self._cancel_requested = False
        self._status: LLMStatusCode | None = None
        self._error: BaseException | None = None
        self._bytes = 0
        self._descriptors = 0
        self._layers: list[tuple[int, float, float, float, int]] = []
        self._seconds = 0.0
        self._t0 = 0.0
        self._log = log if log is not None else _log
        # Every event of this task names it and its peer(s), to follow one request in logs.
        self._fields: dict[str, Any] = {"task_id": task_id, "kind": kind}
        if len(self._peers) == 1:
            self._fields["peer_cluster_id"] = self._peers[0]
        elif self._peers:
            self._fields["peer_cluster_ids"] = list(self._peers)

    # ------------------------------------------------------------------ running
    def begin(self, deadline_s: float | None) -> TaskControl:
        """Start the task's clock and deadline (its token carries the deadline to workers);
        the caller runs it and then calls :meth:`conclude`."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._token.deadline = deadline
        ctl = TaskControl(self, deadline)
        if self._observers is not None:
            self._observers.transfer_started(self.kind)
        # A filtered structlog call still runs its processor chain: ask the logger first.
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug("transfer.started", **self._fields)
        return ctl

    def on_cancel(self, fn: Callable[[], None] | None) -> None:
        """Call ``fn`` when :meth:`cancel` is called (a task run without a task body: its
        runner fences it and then concludes it)."""
        self._canceller = fn

    async def run_body(
        self, body: Callable[[TaskControl], Awaitable[None]], deadline_s: float | None
    ) -> None:
        """Run ``body`` as this task (the engine starts it in its task group) and record how
        it ended; never raises but the engine's own cancellation."""
        ctl = self.begin(deadline_s)
        cancelled_exc = anyio.get_cancelled_exc_class()
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if deadline_s is not None:
                    scope.deadline = anyio.current_time() + deadline_s
                if self._cancel_requested:
                    scope.cancel()
                await body(ctl)
        except cancelled_exc:
            # The engine itself is shutting down: record and let the cancellation go on.
            self._finish(LLMStatusCode.LLM_FAILED, TransferCancelled("engine finalized"), ctl)
            raise
        except Exception as exc:
            error = exc
        self.conclude(ctl, error, scope.cancelled_caught)

    def conclude(
        self, ctl: TaskControl, error: BaseException | None, timed_out: bool = False
    ) -> None:
        """Record how the task ended: ``error`` (None: success), ``timed_out`` when its
        deadline stopped it. A cancel or a passed deadline decides the status first."""
        if self._cancel_requested:
            status = LLMStatusCode.LLM_FAILED
            self._error = TransferCancelled(f"{self.kind} was cancelled")
        elif (
            ctl.deadline is not None
            and (timed_out or time.monotonic() >= ctl.deadline)
            and (error is None or isinstance(error, CopyCancelled | TimeoutError))
        ):
            status = self._timeout_code
            self._error = LLMException(
                f"{self.kind} did not finish within its deadline (the option "
                "llm.SyncKvCacheWaitTime, LLMConfig.sync_kv_timeout; default 1000 ms)",
                status_code=status,
            )
        elif error is not None:
            status = status_from_exception(error)
            self._error = (
                error
                if is_caller_facing(error)
                else LLMException(f"{self.kind} failed: {error!r}", status_code=status)
            )
        else:
            status = LLMStatusCode.LLM_SUCCESS
        self._finish(status, self._error, ctl)

    def _finish(self, status: LLMStatusCode, error: BaseException | None, ctl: TaskControl) -> None:
        if self._finished:
            return
        if status == LLMStatusCode.LLM_TIMEOUT and self._timeout_code != status:
            # Legacy mode reports transfer timeouts with its own code.
            status = self._timeout_code
            error = LLMException(str(error), status_code=status)
            for i, r in enumerate(self._results):
                if r == LLMStatusCode.LLM_TIMEOUT:
                    self._results[i] = status
        self._seconds = ctl.now()
        self._status = status
        self._error = error
        if len(set(self._slots)) == 1:
            self._started.add(self._slots[0])
        for slot in self._started:
            # Slots that were running when the task ended take its final status; slots whose
            # layers never started stay None (upstream's get_results contract).
            if self._results[slot] is None:
                self._results[slot] = status
        if status == LLMStatusCode.LLM_SUCCESS:
            if self._log.isEnabledFor(logging.DEBUG):
                self._log.debug(
                    "transfer.complete", **self._fields, bytes=self._bytes, seconds=self._seconds
                )
        else:
            self._log.info("transfer.failed", **self._fields, status=str(status), error=str(error))
        if self._observers is not None:
            self._observers.transfer_ended(self.kind, status, self._bytes, self._seconds)
        self._finished = True
        if self._done is not None:
            self._done.set()

    # ------------------------------------------------------------------ public API
    @property
    def task_id(self) -> int:
        """This task's number, unique within its endpoint: the ``task_id`` of its log events
        (``transfer.started``, ``transfer.complete``, ``transfer.failed``)."""
        return self._task_id

    @property
    def cancel_requested(self) -> bool:
        """:meth:`cancel` was called."""
        return self._cancel_requested

    def done(self) -> bool:
        """True once the task finished (successfully or not) and is fenced."""
        return self._finished

    def cancel(self) -> None:
        """Ask the task to stop. ``await task`` then waits for the fence and raises
        :class:`TransferCancelled`. Has no effect on a finished task."""
        if self._finished or self._cancel_requested:
            return
        self._cancel_requested = True
        self._token.cancel()
        if self._scope is not None:
            self._scope.cancel()
        if self._canceller is not None:
            self._canceller()

    async def wait(self) -> None:
        """Wait for completion; raise ``LLMException`` on failure.

        If the awaiting scope is cancelled, the task is cancelled and fenced before the
        cancellation propagates.
        """
        try:
            await self._wait_done()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                self.cancel()
                await self._wait_done()
            raise
        if self._error is not None:
            raise self._error

    async def _wait_done(self) -> None:
        """Until the task finished; if it already has, a check for a cancel already made,
        and a schedule point as :class:`SchedulePoints` says."""
        if self._finished:
            points = self._schedule_points
            if points is None or points.due():
                await anyio.lowlevel.checkpoint()
            else:
                await anyio.lowlevel.checkpoint_if_cancelled()
            return
        if self._done is None:
            self._done = self._new_event()
        await self._done.wait()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def _wait_for(self, timeout_in_millis: int | None) -> bool:
        check_uint32("timeout_in_millis", timeout_in_millis, optional=True)
        if timeout_in_millis is None:
            await self._wait_done()
            return True
        with anyio.move_on_after(timeout_in_millis / 1000):
            await self._wait_done()
        return self._finished

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait (forever when None) and return the first failing code, or SUCCESS.

        Returns the default timeout code if the task is still running after the timeout; the
        task keeps running.

        Raises:
            TypeError / ValueError: ``timeout_in_millis`` is not a uint32.
        """
        if not await self._wait_for(timeout_in_millis):
            return self._timeout_code
        for r in self._results:
            if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                return r
        return self._status or LLMStatusCode.LLM_SUCCESS

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """One code per transfer config, in order; None for configs whose layers never started.

        Raises:
            TypeError / ValueError: ``timeout_in_millis`` is not a uint32.
        """
        if not await self._wait_for(timeout_in_millis):
            return [self._timeout_code] * len(self._slots)
        return [self._results[s] for s in self._slots]

    @property
    def status(self) -> LLMStatusCode | None:
        """The final status, or None while running."""
        return self._status

    @property
    def layers_done(self) -> int:
        """How many layers have landed so far (layer-wise transfers)."""
        return len(self._layers)

    def statistics(self) -> TaskStatistics:
        """Bytes, descriptors, wall and busy time, per-layer timings (final once ``done()``)."""
        layers = tuple(LayerTiming(*timing) for timing in self._layers)
        if layers:
            busy = busy_time([(lt.started, lt.finished) for lt in layers])
            if self._seconds > 0:
                busy = min(busy, self._seconds)
        else:
            busy = self._seconds
        return TaskStatistics(
            kind=self.kind,
            bytes=self._bytes,
            descriptors=self._descriptors,
            seconds=self._seconds,
            layers=layers,
            started=self._t0,
            busy_seconds=busy,
        )

    def __repr__(self) -> str:
        state = "running" if self._status is None else str(self._status)
        return f"<CacheTask {self.kind} {state}>"
