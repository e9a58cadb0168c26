"""The layer-wise scheduler behind ``transfer_cache_async``.

One producer awaits the synchronizer for layer ``i`` and hands the layer to every destination
whose range holds it; each destination sends its layers in order, one request per layer,
holding its link's phase lock alone (FIFO with pulls and pushes, which share it), while the
producer already awaits layer ``i + 1``. A bounded channel per
destination (the *window*) stops the producer from running more than ``window`` layers ahead
of the slowest destination, which keeps staging memory flat. Different destinations (links)
move in parallel.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import anyio

from ._enums import LLMStatusCode
from ._errors import LLMException, status_from_exception
from ._net.link import Link
from ._net.transfer import XferSpec, initiate
from ._synchronizer import AsyncLayerSynchronizer, LayerEvents
from ._task import LayerTiming, TaskControl

__all__ = ["Destination", "run_layerwise", "wait_for_layer"]

DEFAULT_WINDOW = 4


@dataclasses.dataclass
class Destination:
    """One transfer config: where its layers go and which result slot it reports into."""

    index: int
    slot: int
    link: Link
    layers: list[int]
    make_spec: Callable[[int], XferSpec]


class SynchronizerAborted(LLMException):
    """The synchronizer said no (False), raised, or timed out for a layer."""


async def wait_for_layer(engine: Any, sync: Any, layer: int, timeout_ms: int | None) -> None:
    """Await ``sync`` for ``layer`` without blocking the loop: ``LayerEvents`` natively,
    ``AsyncLayerSynchronizer`` on the loop, blocking synchronizers in a daemon thread (left
    behind, harmlessly, if the task is cancelled while the callback still blocks).

    Raises:
        SynchronizerAborted: False (LLM_PARAM_INVALID, as upstream), an exception (its code,
            LLM_FAILED by default) or a timeout (LLM_TIMEOUT).
    """
    try:
        with anyio.fail_after(None if timeout_ms is None else timeout_ms / 1000):
            if isinstance(sync, LayerEvents):
                event, wake = engine.threadsafe_event()
                if not sync.add_waker(layer, wake):
                    await event.wait()
                ok = sync.result(layer)
            elif isinstance(sync, AsyncLayerSynchronizer):
                ok = await sync.synchronize_layer(layer, timeout_ms)
            else:
                ok = await engine.run_blocking(sync.synchronize_layer, layer, timeout_ms)
    except TimeoutError:
        raise SynchronizerAborted(
            f"layer {layer} was not ready within {timeout_ms} ms",
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


async def run_layerwise(
    engine: Any,
    ctl: TaskControl,
    sync: Any,
    dests: list[Destination],
    timeout_s: float,
    sync_timeout_ms: int | None,
    window: int = DEFAULT_WINDOW,
) -> None:
    """Run every destination's layers; raises the first failure (after recording it)."""
    all_layers = sorted({layer for d in dests for layer in d.layers})
    last = {d.index: d.layers[-1] for d in dests}
    ready_at: dict[int, float] = {}
    started_at: dict[int, float] = {}
    nbytes_at: dict[int, int] = {}
    remaining = {layer: sum(layer in d.layers for d in dests) for layer in all_layers}
    failure: list[BaseException] = []

    async def consume(d: Destination, receive: Any) -> None:
        async with receive:
            async for layer in receive:
                ctl.start_slot(d.slot)
                spec = d.make_spec(layer)
                try:
                    async with d.link.transfer_lock.hold(exclusive=True):
                        # Each layer's budget starts once the link is ours (upstream: one
                        # engine call per layer, each bounded by sync_kv_timeout).
                        deadline = time.monotonic() + timeout_s
                        token = ctl.token.child(deadline)
                        started_at.setdefault(layer, ctl.now())
                        d.link.check_alive()
                        try:
                            with anyio.fail_after(timeout_s):
                                moved, descs = await initiate(engine, d.link, spec, token, deadline)
                        except TimeoutError:
                            raise LLMException(
                                f"layer {layer} to cluster {d.link.peer_cluster_id} did not "
                                f"finish within {timeout_s:.3f} s (sync_kv_timeout)",
                                status_code=LLMStatusCode.LLM_TIMEOUT,
                            ) from None
                except LLMException as exc:
                    ctl.set_result(d.slot, exc.status_code)
                    raise
                ctl.add(moved, descs)
                nbytes_at[layer] = nbytes_at.get(layer, 0) + moved
                remaining[layer] -= 1
                if remaining[layer] == 0:  # the layer landed everywhere
                    ctl.layer_done(
                        LayerTiming(
                            layer, ready_at[layer], started_at[layer], ctl.now(), nbytes_at[layer]
                        )
                    )
                if layer == last[d.index]:
                    ctl.set_result(d.slot, LLMStatusCode.LLM_SUCCESS)

    async def produce(sends: dict[int, Any]) -> None:
        try:
            for layer in all_layers:
                try:
                    await wait_for_layer(engine, sync, layer, sync_timeout_ms)
                except SynchronizerAborted as exc:
                    # Like upstream's sequential loop: layers that were already ready still
                    # go out (the channels drain), nothing after this one does.
                    for d in dests:
                        if layer in d.layers:
                            ctl.set_result(d.slot, exc.status_code)
                    if not failure:
                        failure.append(exc)
                    return
                ready_at[layer] = ctl.now()
                for d in dests:
                    if layer in d.layers:
                        await sends[d.index].send(layer)
        finally:
            for s in sends.values():
                await s.aclose()

    async with anyio.create_task_group() as tg:
        sends = {}
        for d in dests:
            send, receive = anyio.create_memory_object_stream[int](window)
            sends[d.index] = send
            tg.start_soon(_first_failure, consume, (d, receive), failure, tg)
        tg.start_soon(_first_failure, produce, (sends,), failure, tg)
    if failure:
        raise failure[0]


async def _first_failure(
    fn: Callable[..., Any], args: tuple[Any, ...], failure: list[BaseException], tg: Any
) -> None:
    # The first failure stops everything; it is re-raised once every worker is fenced.
    try:
        await fn(*args)
    except Exception as exc:
        if not failure:
            failure.append(exc)
        tg.cancel_scope.cancel()
