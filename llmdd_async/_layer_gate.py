"""Waiting for a layer's signal before it is sent: ``LayerEvents`` on the loop (bounded by
the endpoint's timers), other synchronizers on the loop or in a thread (bounded by a cancel
scope); a wait that runs long says so once (``transfer.layer_wait``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from ._enums import LLMStatusCode
from ._errors import LLMException, SynchronizerAborted, status_from_exception
from ._options import DEFAULT_LAYER_SYNC_TIMEOUT_MS
from ._synchronizer import AsyncLayerSynchronizer, LayerEvents

if TYPE_CHECKING:
    from ._engine import Engine
    from ._timers import Timer

__all__ = ["LAYER_WAIT_WARN_S", "wait_for_layer"]


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


async def wait_for_layer(engine: Engine, sync: Any, layer: int, timeout_ms: int | None) -> None:
    """Await ``sync`` for ``layer`` without blocking the loop: ``LayerEvents`` natively,
    ``AsyncLayerSynchronizer`` on the loop, blocking synchronizers in a daemon thread (left
    behind, harmlessly, if the task is cancelled while the callback still blocks).

    Raises:
        SynchronizerAborted: False (LLM_PARAM_INVALID, as upstream), an exception (its code,
            LLM_FAILED by default) or a timeout (LLM_TIMEOUT).
    """
    if isinstance(sync, LayerEvents) and sync.is_layer_ready(layer):
        return  # signalled already: no event, no scope (the usual case when the link lags)
    t0 = time.monotonic()
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
                end = timers.now() + bound_ms / 1000
                # One timer at a time: the warning's, which then sets the bound's (a wait
                # seldom lasts that long, and each timer is a heap push and a cancel).
                timer: list[Timer] = []

                def warn() -> None:
                    timer[0] = timers.call_at(end, wakeup.expire)  # (first: logging may raise)
                    _warn_waiting(engine, layer, t0, bound_ms)

                if bound_ms >= LAYER_WAIT_WARN_S * 1000:
                    timer.append(timers.call_later(LAYER_WAIT_WARN_S, warn))
                else:
                    timer.append(timers.call_at(end, wakeup.expire))
                try:
                    woken = await wakeup.wait()
                finally:
                    timers.cancel(timer[0])
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
