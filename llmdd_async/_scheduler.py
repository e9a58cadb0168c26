"""The scheduler: every per-link turn and every deadline of a data movement.

A pull or push (:func:`run_request`) waits for its link's phase lock (shared with the other
pulls and pushes, FIFO with layer-wise sends) and its deadline starts once the link is its.

The layer-wise ``transfer_cache_async`` (:func:`run_transfer`): one producer awaits the
synchronizer for layer ``i`` and hands the layer to every destination whose range holds it;
each destination sends its layers in order, holding its link's phase lock alone (FIFO with
pulls and pushes, which share it), while the producer already awaits layer ``i + 1``. The
layers a destination has been handed and not yet sent go in one request: one layer per
request while the link keeps up with the synchronizer, all that became ready meanwhile when
it does not (a request costs round trips whatever its size). A bounded channel per
destination (the *window*) stops the producer from running more than ``window`` layers ahead
of the slowest destination, which keeps staging memory flat. Different destinations (links)
move in parallel.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from ._enums import LLMStatusCode
from ._errors import (
    CopyCancelled,
    LLMException,
    SynchronizerAborted,
    is_caller_facing,
    status_from_exception,
)
from ._net.addressing import resolve_in_table, with_table
from ._net.exchange import Exchange
from ._net.grants import TransferRequest
from ._net.initiator import initiate, may_pull_directly, pull_direct_now
from ._net.link import Link
from ._options import DEFAULT_LAYER_SYNC_TIMEOUT_MS, DEFAULT_LAYER_WINDOW
from ._synchronizer import AsyncLayerSynchronizer, LayerEvents
from ._task import CacheTask, LayerTiming, TaskControl

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = [
    "Destination",
    "run_layerwise",
    "run_request",
    "run_transfer",
    "start_request_now",
    "wait_for_layer",
]


@dataclasses.dataclass
class Destination:
    """One transfer config: where its layers go and which result slot it reports into."""

    index: int
    slot: int
    link: Link
    layers: list[int]
    #: the request of a run of consecutive layers
    make_spec: Callable[[range], TransferRequest]


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
        with anyio.fail_after(bound_ms / 1000):
            if isinstance(sync, LayerEvents):
                event, wake = engine.threadsafe_event()
                if not sync.add_waker(layer, wake):
                    with anyio.move_on_after(LAYER_WAIT_WARN_S):
                        await event.wait()
                    if not event.is_set():
                        _warn_waiting(engine, layer, t0, bound_ms)
                        await event.wait()
                ok = sync.result(layer)
            else:
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


async def run_request(
    engine: Engine,
    ctl: TaskControl,
    link: Link,
    spec: TransferRequest,
    timeout_s: float,
    steps: int,
    remote_accessible: bool,
) -> None:
    """Run one pull or push: ``timeout_s`` per step (layer) once the link is ours.

    In remote-accessible mode the first transfer of a link fetches the peer's table (within
    ``timeout_s``) and the target is resolved in it.

    Raises:
        LLMException: as :func:`._net.addressing.resolve_in_table`, a broken link
            (LLM_NOT_YET_LINK / LLM_LINK_FAILED), or what the peer answered.
    """
    if remote_accessible:
        table = link.view.table
        if table is None:  # the first transfer of the link fetches it
            ctl.set_deadline(timeout_s)
            table = await link.view.fetch_table(timeout_s)
            ctl.set_deadline(None)
        spec.target = resolve_in_table(table, spec.target, link.peer_cluster_id)
    async with link.transfer_lock.hold(exclusive=False):
        # The deadline runs from when the link is ours, not while queueing.
        ctl.set_deadline(timeout_s * steps)
        link.check_alive()
        ctl.add(*await initiate(engine, link, spec, ctl.token, ctl.deadline))


def start_request_now(
    engine: Engine,
    task: CacheTask,
    link: Link,
    spec: TransferRequest,
    timeout_s: float,
    steps: int,
    remote_accessible: bool,
    on_end: Callable[[], None],
) -> bool:
    """Start ``task`` as one pull or push with no task of its own, when nothing has to be
    awaited first: the link's phase lock is free for it (nobody queues), the peer's table is
    known (remote-accessible mode), the local cache is populated, and no one-sided copy may
    apply. The request is sent now and the link's reader finishes it (:class:`Exchange`); a
    timer of the engine bounds it by ``timeout_s`` per step, as :func:`run_request` does;
    ``on_end`` runs once it ended (fenced), before the task completes. Returns False, with
    nothing started, when :func:`run_request` must run it.
    """
    if remote_accessible:
        table = link.view.table
        if table is None:
            return False
        try:
            spec.target = resolve_in_table(table, spec.target, link.peer_cluster_id)
        except LLMException:
            return False  # the task reports it
    if not link.alive or not engine.is_populated(spec.local.addrs):
        return False
    if may_pull_directly(engine, link, spec):
        return _pull_direct_now(engine, task, link, spec, on_end)
    if not link.transfer_lock.try_take(False):
        return False
    budget = timeout_s * steps
    ctl = task.begin(None)
    ctl.set_deadline(budget)  # the link is ours: the deadline runs from now
    expired = False
    current: list[Exchange] = []

    def launch(key_reads: bool) -> None:
        try:
            req = link.open_pending(ctl.deadline)
        except LLMException as exc:  # the link went down: a retry ends here
            finish(None, exc)
            return
        # A first try that may copy what a key grants has a token of its own: stopping it
        # after a failed copy does not stop the retry over the stream.
        req.token = ctl.token.child() if key_reads else ctl.token
        exchange = Exchange(engine, link, spec, req, key_reads, ended)
        current[:] = [exchange]
        exchange.start()

    def ended(exchange: Exchange) -> None:
        if (
            exchange.read_failed
            and not task.cancel_requested
            and not expired
            and link.alive
            and ctl.deadline is not None
            and time.monotonic() < ctl.deadline
        ):
            # A copy of what a key grants failed (memory the kernel cannot pin): the request
            # was aborted there, unconsumed; stream it.
            reason = f"reading the peer failed: {exchange.error}"
            engine.log.info("transfer.fallback", reason=reason)
            launch(False)
            return
        finish(exchange.result, exchange.error)

    def finish(result: tuple[int, int] | None, error: BaseException | None) -> None:
        link.transfer_lock.give(False)
        engine.timers.cancel(timer)
        task.on_cancel(None)
        if result is not None:
            ctl.add(*result)
        on_end()
        task.conclude(ctl, error, expired)

    def stop() -> None:
        if current:
            current[0].stop(CopyCancelled())

    def expire() -> None:
        nonlocal expired
        expired = True
        stop()

    timer = engine.timers.call_at(anyio.current_time() + budget, expire)
    task.on_cancel(stop)
    try:
        launch(True)
    except Exception as exc:  # a bug: the task reports it, nothing stays held
        if current and not current[0].ended:
            current[0].stop(exc)
        else:
            finish(None, exc)
    return True


def _pull_direct_now(
    engine: Engine,
    task: CacheTask,
    link: Link,
    spec: TransferRequest,
    on_end: Callable[[], None],
) -> bool:
    """:func:`start_request_now` for a one-sided pull: copied and concluded here when it is
    small enough to copy on the loop (:func:`pull_direct_now`), else False with nothing
    started (nothing copied that the task would not copy again)."""
    if not link.transfer_lock.try_take(False):
        return False
    try:
        done = pull_direct_now(engine, link, spec)
    except LLMException:
        done = None  # the task reports it (the same check fails there)
    finally:
        link.transfer_lock.give(False)
    if done is None:
        return False
    ctl = task.begin(None)
    ctl.add(*done)
    on_end()
    task.conclude(ctl, None)
    return True


async def run_transfer(
    engine: Engine,
    ctl: TaskControl,
    sync: Any,
    dests: list[Destination],
    timeout_s: float,
    sync_timeout_ms: int | None,
    window: int,
    remote_accessible: bool,
) -> None:
    """Run a layer-wise transfer: in remote-accessible mode each destination's key is first
    resolved in its peer's table (a control round trip, not payload: it needs no turn on the
    link), then :func:`run_layerwise`.

    Raises:
        LLMException: as :func:`run_layerwise`, or an unresolvable destination.
    """
    if remote_accessible:
        for d in dests:
            table = await d.link.view.fetch_table(timeout_s)
            d.make_spec = with_table(d.make_spec, table, d.link.peer_cluster_id)
    await run_layerwise(engine, ctl, sync, dests, timeout_s, sync_timeout_ms, window)


async def run_layerwise(
    engine: Engine,
    ctl: TaskControl,
    sync: Any,
    dests: list[Destination],
    timeout_s: float,
    sync_timeout_ms: int | None,
    window: int = DEFAULT_LAYER_WINDOW,
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
            async for first in receive:
                # Every layer already handed over goes in the same request: a request costs
                # a round trip or two whatever its size, so layers that are ready while the
                # link is busy must not each pay for one (consecutive layers, by the
                # producer's order; at most the window plus one).
                layers = [first]
                while True:
                    try:
                        layers.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                for run in _runs(layers):
                    await send_layers(d, run)

    async def send_layers(d: Destination, run: range) -> None:
        ctl.start_slot(d.slot)
        spec = d.make_spec(run)
        budget = timeout_s * len(run)
        try:
            async with d.link.transfer_lock.hold(exclusive=True):
                # The budget starts once the link is ours, sync_kv_timeout per layer (upstream:
                # one engine call per layer, each bounded by it).
                deadline = time.monotonic() + budget
                token = ctl.token.child(deadline)
                now = ctl.now()
                for layer in run:
                    started_at.setdefault(layer, now)
                d.link.check_alive()
                try:
                    with anyio.fail_after(budget):
                        moved, descs = await initiate(engine, d.link, spec, token, deadline)
                except TimeoutError:
                    what = f"layer {run.start}" if len(run) == 1 else f"layers {_span(run)}"
                    raise LLMException(
                        f"{what} to cluster {d.link.peer_cluster_id} did not finish within "
                        f"{budget:.3f} s (sync_kv_timeout per layer)",
                        status_code=LLMStatusCode.LLM_TIMEOUT,
                    ) from None
        except LLMException as exc:
            # A stopped copy (CopyCancelled: a cancel, a deadline) is the task's to report,
            # not this slot's.
            if is_caller_facing(exc):
                ctl.set_result(d.slot, exc.status_code)
            raise
        ctl.add(moved, descs)
        # The layers of one cache are alike (the same tensors per layer and blocks), so each
        # moved an equal share.
        share, extra = divmod(moved, len(run))
        finished = ctl.now()
        for i, layer in enumerate(run):
            nbytes_at[layer] = nbytes_at.get(layer, 0) + share + (extra if i == 0 else 0)
            remaining[layer] -= 1
            if remaining[layer] == 0:  # the layer landed everywhere
                timing = LayerTiming(
                    layer, ready_at[layer], started_at[layer], finished, nbytes_at[layer]
                )
                ctl.layer_done(timing)
        if last[d.index] in run:
            ctl.set_result(d.slot, LLMStatusCode.LLM_SUCCESS)

    members = {d.index: set(d.layers) for d in dests}

    async def produce(sends: dict[int, Any]) -> None:
        try:
            for layer in all_layers:
                try:
                    await wait_for_layer(engine, sync, layer, sync_timeout_ms)
                except SynchronizerAborted as exc:
                    # Like upstream's sequential loop: layers that were already ready still
                    # go out (the channels drain), nothing after this one does.
                    for d in dests:
                        if layer in members[d.index]:
                            ctl.set_result(d.slot, exc.status_code)
                    if not failure:
                        failure.append(exc)
                    return
                ready_at[layer] = ctl.now()
                for d in dests:
                    if layer in members[d.index]:
                        send = sends[d.index]
                        try:
                            # No loop turn while the window has room: a consumer that wakes
                            # then finds every layer that was ready, for one request.
                            send.send_nowait(layer)
                        except anyio.WouldBlock:
                            await send.send(layer)
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


def _runs(layers: list[int]) -> list[range]:
    """``layers`` (ascending) as runs of consecutive layers."""
    runs: list[range] = []
    start = prev = layers[0]
    for layer in layers[1:]:
        if layer != prev + 1:
            runs.append(range(start, prev + 1))
            start = layer
        prev = layer
    runs.append(range(start, prev + 1))
    return runs


def _span(run: range) -> str:
    return f"{run.start}-{run.stop - 1}"


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
