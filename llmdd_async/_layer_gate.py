"""Waiting for a layer's signal before it is sent: ``LayerEvents`` on the loop (bounded by
the endpoint's timers), other synchronizers on the loop or in a thread (bounded by a cancel
scope); a wait that runs long says so once (``transfer.layer_wait``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ._enums import LLMStatusCode
from ._errors import LLMException, SynchronizerAborted, status_from_exception
from ._options import DEFAULT_LAYER_SYNC_TIMEOUT_MS
from ._synchronizer import AsyncLayerSynchronizer, LayerEvents

if TYPE_CHECKING:
    from ._drivers import LoopEvent
    from ._engine import Engine
    from ._timers import Timer

__all__ = ["LAYER_WAIT_WARN_S", "SignalPump", "wait_for_layer"]


#: a layer-wise transfer that waited this long for one layer's signal says so (once per
#: layer): a forward pass that never calls ``layer_ready`` is the usual cause of a hang
LAYER_WAIT_WARN_S = 5.0


def _warn_waiting(engine: Engine, layer: int, t0: float, timeout_ms: int | None) -> None:
    engine.log.warning(
        "transfer.layer_wait",
        layer=layer,
        waited_s=round(time.monotonic() - t0, 1),
        bound_ms=timeout_ms,
        hint="the synchronizer has not released this layer (is layer_ready called for it?); "
        "llm.LayerSyncTimeout bounds the wait",
    )


async def _warn_after(engine: Engine, layer: int, t0: float, timeout_ms: int | None) -> None:
    await anyio.sleep(LAYER_WAIT_WARN_S)
    _warn_waiting(engine, layer, t0, timeout_ms)


async def wait_for_layer(
    engine: Engine, sync: Any, layer: int, timeout_ms: int | None, since: float | None = None
) -> None:
    """Await ``sync`` for ``layer`` without blocking the loop: ``LayerEvents`` natively,
    ``AsyncLayerSynchronizer`` on the loop, blocking synchronizers in a daemon thread (left
    behind, harmlessly, if the task is cancelled while the callback still blocks).
    ``since``: when a wait for this ``LayerEvents`` layer began (``time.monotonic()``, a
    :class:`SignalPump`'s): its bound and warning count from then.

    Raises:
        SynchronizerAborted: False (LLM_PARAM_INVALID, as upstream), an exception (its code,
            LLM_FAILED by default) or a timeout (LLM_TIMEOUT).
    """
    if isinstance(sync, LayerEvents) and sync.is_layer_ready(layer):
        return  # signalled already: no event, no scope (the usual case when the link lags)
    t0 = time.monotonic() if since is None else since
    # The user's synchronizer gets the user's value (None unless set, as upstream passes it);
    # the wait itself is always bounded.
    bound_ms = DEFAULT_LAYER_SYNC_TIMEOUT_MS if timeout_ms is None else timeout_ms
    try:
        if isinstance(sync, LayerEvents):
            # Bounded by the endpoint's timers (a heap push each), not cancel scopes (a loop
            # timer each), and woken by a bare wake-up (a future on asyncio), not an event:
            # the model's layers are waited for one by one, each wait from a cold start.
            wakeup = engine.wakeup()
            if not sync.add_waker(layer, wakeup.wake):
                timers = engine.timers
                waited = 0.0 if since is None else time.monotonic() - since
                end = timers.now() + bound_ms / 1000 - waited
                # One timer at a time: the warning's, which then sets the bound's (a wait
                # seldom lasts that long, and each timer is a heap push and a cancel).
                timer: list[Timer] = []

                def warn() -> None:
                    timer[0] = timers.call_at(end, wakeup.expire)  # (first: logging may raise)
                    _warn_waiting(engine, layer, t0, bound_ms)

                if bound_ms < LAYER_WAIT_WARN_S * 1000:
                    timer.append(timers.call_at(end, wakeup.expire))
                else:  # (the warning from the timers: a logging failure fails no transfer)
                    timer.append(timers.call_later(max(0.0, LAYER_WAIT_WARN_S - waited), warn))
                try:
                    woken = await wakeup.wait()
                finally:
                    timers.cancel(timer[0])
                    # (bounded or cancelled: its waker would stay until the layer comes)
                    sync.remove_waker(layer, wakeup.wake)
                # (a signal or an abort may have come as the bound passed: then it counts)
                if not woken and not sync._settled(layer):
                    raise TimeoutError
            # (ready: no lock; else the abort, and its error, under the lock)
            ok = sync.is_layer_ready(layer) or sync.result(layer)
        else:
            with anyio.fail_after(bound_ms / 1000):
                async with anyio.create_task_group() as tg:
                    # A user's synchronizer cannot be asked twice: a watcher says it is slow.
                    tg.start_soon(_warn_after, engine, layer, t0, bound_ms)
                    if isinstance(sync, AsyncLayerSynchronizer):
                        ok = await sync.synchronize_layer(layer, timeout_ms)
                    else:
                        ok = await engine.run_blocking(sync.synchronize_layer, layer, timeout_ms)
                    tg.cancel_scope.cancel()
    except TimeoutError:
        raise SynchronizerAborted(
            f"layer {layer} was not ready within {bound_ms} ms (llm.LayerSyncTimeout)",
            status_code=LLMStatusCode.LLM_TIMEOUT,
        ) from None
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:
        code = status_from_exception(exc)
        if code == LLMStatusCode.LLM_PARAM_INVALID and not isinstance(exc, LLMException):
            code = LLMStatusCode.LLM_FAILED  # a bug in the callback is not a bad parameter
        raise SynchronizerAborted(
            f"synchronize_layer({layer}) raised {exc!r}", status_code=code
        ) from exc
    if ok is not True:
        raise SynchronizerAborted(
            f"synchronize_layer({layer}) returned {ok!r}: transfer aborted",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )


class SignalPump:
    """Hands a ``LayerEvents``' layers on as the model signals them, from the loop callback
    the signal schedules (``loop_callback``: asyncio and uvloop), instead of waking the
    producer's task once a layer: a task's wake-up costs the loop more than what it then
    does (about 18 µs of CPU on uvloop, measured, for a layer of a few blocks).

    :meth:`run` hands ``layers[i:]`` on with ``step(layer, t_wait)`` (``t_wait``: when
    the wait for it began, ``now()``'s clock) as each is ready, and returns, for the
    producer's task to go on itself, the index of the first layer it did not hand on: one
    whose wait ran long (the task then bounds it by ``timeout_ms`` and warns as
    :func:`wait_for_layer`, from the same start), an abort, the layer after one that
    ``step`` could not hand on to every destination (a full window: it returns those), or
    the end. ``step`` and ``now`` must not raise
    (one that does ends :meth:`run`, which raises it).
    """

    def __init__(
        self,
        engine: Engine,
        sync: LayerEvents,
        layers: list[int],
        timeout_ms: int | None,
        call: Callable[[Callable[[], None]], None],
        step: Callable[[int, float], Sequence[Any]],
        now: Callable[[], float],
    ) -> None:
        self._engine, self._sync, self._layers = engine, sync, layers
        self._call, self._step, self._now = call, step, now
        bound_ms = DEFAULT_LAYER_SYNC_TIMEOUT_MS if timeout_ms is None else timeout_ms
        #: a wait this long goes on in the task (:func:`wait_for_layer`: it warns, bounds)
        self._first_bound_s = min(LAYER_WAIT_WARN_S, bound_ms / 1000)
        self._i = 0
        #: when the wait for layers[_i] began: now()'s clock and time.monotonic()
        self.t_wait: float | None = None
        self.since: float | None = None
        self._waiting = False  # a waker for layers[_i] is registered
        self._timer: Timer | None = None
        self._due = 0.0  # when the wait for layers[_i] runs long (the timers' clock)
        self._back: LoopEvent | None = None  # set when the task goes on
        self._error: BaseException | None = None
        self._full: Sequence[Any] = ()

    @classmethod
    def of(
        cls,
        engine: Engine,
        sync: Any,
        layers: list[int],
        timeout_ms: int | None,
        step: Callable[[int, float], Sequence[Any]],
        now: Callable[[], float],
    ) -> SignalPump | None:
        """The pump of ``sync``'s ``layers``; None unless it is a ``LayerEvents`` and the
        loop has callbacks for it (``Engine.loop_callback``)."""
        call = engine.loop_callback() if isinstance(sync, LayerEvents) else None
        if call is None:
            return None
        return cls(engine, sync, layers, timeout_ms, call, step, now)

    async def run(self, i: int) -> tuple[int, Sequence[Any]]:
        """Hand ``layers[i:]`` on while nothing needs the task: ``(j, full)``, the task goes
        on at ``layers[j]``, once it handed ``layers[j - 1]`` to what ``step`` returned for
        it (``full``: the destinations whose window was full), if any.

        Raises:
            BaseException: what ``step`` or ``now`` raised.
        """
        self._i, self._error, self._full = i, None, ()
        self.t_wait = self.since = None
        back = self._back = self._engine.new_event()
        self._advance()
        try:
            await back.wait()
        finally:
            self._back = None  # (a late wake-up or expiry finds nobody: it does nothing)
            if self._waiting and self._i < len(self._layers):
                # (cancelled or expired: the waker would hold this transfer until the layer)
                self._sync.remove_waker(self._layers[self._i], self._wake)
            self._disarm()
        if self._error is not None:
            raise self._error
        return self._i, self._full

    def _advance(self) -> None:
        layers, sync = self._layers, self._sync
        try:
            while self._i < len(layers):
                layer = layers[self._i]
                if self.t_wait is None:
                    self.t_wait, self.since = self._now(), time.monotonic()
                if not sync.is_layer_ready(layer):
                    if not sync.add_waker(layer, self._wake):
                        self._waiting = True
                        # One timer for the run, not one per layer (a heap push and a cancel
                        # each): it goes on from a later layer's due time if it comes early.
                        timers = self._engine.timers
                        self._due = timers.now() + self._first_bound_s
                        if self._timer is None:
                            self._timer = timers.call_at(self._due, self._expired)
                        return
                    if not sync.is_layer_ready(layer):
                        break  # aborted: the task raises it (wait_for_layer)
                self._full = self._step(layer, self.t_wait)
                self._i += 1
                self.t_wait = self.since = None
                if self._full:
                    break
        except BaseException as exc:  # (a loop callback must not raise)
            self._error = exc
        self._go_on()

    def _wake(self) -> None:
        """From the thread that signalled (any): the rest on the loop."""
        self._call(self._woken)

    def _woken(self) -> None:
        if self._back is None or not self._waiting:
            return  # run() ended meanwhile (cancelled, or expired first)
        layer = self._layers[self._i]
        if not self._sync.is_layer_ready(layer) and not self._sync._settled(layer):
            return  # the wake-up of a wait that ended before (expired): this one goes on
        self._waiting = False
        self._advance()

    def _expired(self) -> None:
        self._timer = None
        if self._back is None or not self._waiting:
            return  # (a layer is being handed on, or the task goes on already)
        timers = self._engine.timers
        if timers.now() < self._due:  # (armed for an earlier layer's wait)
            self._timer = timers.call_at(self._due, self._expired)
            return
        self._go_on()

    def _disarm(self) -> None:
        self._waiting = False
        if self._timer is not None:
            self._engine.timers.cancel(self._timer)
            self._timer = None

    def _go_on(self) -> None:
        back = self._back
        if back is not None:
            back.set()
