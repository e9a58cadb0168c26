"""The scheduler: every per-link turn and every deadline of a data movement.

A pull or push (:func:`run_request`) waits for its link's phase lock (shared with the other
pulls and pushes, FIFO with layer-wise sends) and its deadline starts once the link is its.

The layer-wise ``transfer_cache_async`` (:func:`run_transfer`): one producer awaits the
synchronizer for layer ``i`` and hands the layer to every destination whose range holds it,
while it already awaits layer ``i + 1``. Each destination is one request for all of its
layers, granted once: each layer's bytes leave as soon as the layer is handed over, holding
the link's phase lock alone for that layer (FIFO with pulls and pushes, which share it and so
go between layers), each bounded by ``sync_kv_timeout``; one RESULT ends it. A bounded
channel per destination (the *window*) stops the producer from running more than ``window``
layers ahead of the slowest destination. Different destinations (links) move in parallel.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from ._enums import LLMStatusCode
from ._errors import CopyCancelled, LLMException, SynchronizerAborted, is_caller_facing
from ._layer_channel import LayerChannel, request_size
from ._layer_gate import SignalPump, wait_for_layer
from ._net.addressing import resolve_in_table, with_table
from ._net.exchange import Exchange
from ._net.grants import TransferRequest
from ._net.initiator import initiate, may_pull_directly, pull_direct_now
from ._net.link import Link
from ._net.peer_view import fetch_tables
from ._options import DEFAULT_LAYER_WINDOW
from ._synchronizer import LayerEvents
from ._task import CacheTask, TaskControl

if TYPE_CHECKING:
    from ._drivers import LoopEvent
    from ._engine import Engine
    from ._timers import Timer

__all__ = [
    "Destination",
    "run_layerwise",
    "run_request",
    "run_transfer",
    "start_request_now",
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
    tensors_per_layer: int = 2


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
    run = _RunNow(engine, task, link, spec, ctl, on_end)
    try:
        run.launch(True)
    except Exception as exc:  # a bug: the task reports it, nothing stays held
        if run.exchange is not None and not run.exchange.ended:
            run.exchange.stop(exc)
        elif run.finished:  # after the task ended: only the log can say
            engine.log.exception("transfer.crashed")
        else:
            run.finish(None, exc)
    # Armed once the request left, while the peer serves it (nothing else runs before the
    # loop does); not for one that already ended (a link found down).
    if not run.finished:
        run.timer = engine.timers.call_later(budget, run.expire)
        task.on_cancel(run.stop)
    return True


class _RunNow:
    """A pull or push :func:`start_request_now` started: its :class:`Exchange` (retried over
    the stream after a failed copy of what a key grants), deadline and end. Not closures: they
    would name each other, a cycle only the garbage collector frees (finish drops ours)."""

    def __init__(
        self,
        engine: Engine,
        task: CacheTask,
        link: Link,
        spec: TransferRequest,
        ctl: TaskControl,
        on_end: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.task = task
        self.link = link
        self.spec = spec
        self.ctl = ctl
        self.on_end = on_end
        self.expired = self.finished = False
        self.exchange: Exchange | None = None
        self.timer: Timer | None = None

    def launch(self, key_reads: bool) -> None:
        link, ctl = self.link, self.ctl
        try:
            req = link.open_pending(ctl.deadline)
        except LLMException as exc:  # the link went down: a retry ends here
            self.finish(None, exc)
            return
        # A first try that may copy what a key grants has a token of its own: stopping it
        # after a failed copy does not stop the retry over the stream.
        req.token = ctl.token.child() if key_reads else ctl.token
        self.exchange = Exchange(self.engine, link, self.spec, req, key_reads, self.ended)
        self.exchange.start()

    def ended(self, exchange: Exchange) -> None:
        ctl = self.ctl
        if (
            exchange.read_failed
            and not self.task.cancel_requested
            and not self.expired
            and self.link.alive
            and ctl.deadline is not None
            and time.monotonic() < ctl.deadline
        ):
            # A copy of what a key grants failed (memory the kernel cannot pin): the request
            # was aborted there, unconsumed; stream it.
            reason = f"reading the peer failed: {exchange.error}"
            self.engine.log.info("transfer.fallback", reason=reason)
            self.launch(False)
            return
        self.finish(exchange.result, exchange.error)

    def finish(self, result: tuple[int, int] | None, error: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        task, ctl = self.task, self.ctl
        try:
            self.link.transfer_lock.give(False)
            if self.timer is not None:
                self.engine.timers.cancel(self.timer)
            self.timer = self.exchange = None
            task.on_cancel(None)
            if result is not None:
                ctl.add(*result)
            self.on_end()
        except BaseException as exc:  # a bug: the task still ends, failing with it
            error = error or exc
            raise
        finally:
            task.conclude(ctl, error, self.expired)

    def stop(self) -> None:
        if self.exchange is not None:
            self.exchange.stop(CopyCancelled())

    def expire(self) -> None:
        self.expired = True
        self.stop()


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
    except Exception:
        done = None  # the task reports it (the same check fails there), or runs it
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
    resolved in its peer's table (:func:`fetch_tables`: those of the links that have none yet,
    at once), then :func:`run_layerwise`.

    Raises:
        LLMException: as :func:`run_layerwise` and :func:`fetch_tables` (the result of each
            destination of a link whose fetch failed says so), or an unresolvable destination.
    """
    if remote_accessible:
        links = list({id(d.link): d.link for d in dests}.values())

        def failed(i: int, exc: Exception) -> None:
            for d in dests:
                if d.link is links[i] and isinstance(exc, LLMException) and is_caller_facing(exc):
                    ctl.set_result(d.slot, exc.status_code)

        tables = await fetch_tables([link.view for link in links], timeout_s, failed)
        by_link = {id(link): table for link, table in zip(links, tables, strict=True)}
        for d in dests:
            d.make_spec = with_table(d.make_spec, by_link[id(d.link)], d.link.peer_cluster_id)
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
    ready_at: dict[int, float] = {}
    started_at: dict[int, float] = {}
    nbytes_at: dict[int, int] = {}
    members = {d.index: set(d.layers) for d in dests}
    #: how many destinations each layer still goes to
    remaining = collections.Counter(layer for d in dests for layer in d.layers)
    failure: list[BaseException] = []
    #: when the layers that had to be waited for became ready (the model's pace)
    waited: list[float] = []

    def known_ready(layer: int) -> bool:
        return isinstance(sync, LayerEvents) and sync.is_layer_ready(layer)

    async def consume(d: Destination, handed: LayerChannel) -> None:
        def bound(layers: int) -> float:  # the target's bound on a request of that many
            return engine.serve_budget_s(layers * d.tensors_per_layer)

        try:
            pos = 0  # the index in d.layers of the next layer to send
            while pos < len(d.layers):
                if not await handed.wait():
                    return  # the transfer failed before this layer
                ready = handed.ready()
                n = request_size(d.layers, pos, ready, known_ready, waited, ctl.now(), bound)
                run = range(d.layers[pos], d.layers[pos + n - 1] + 1)
                feed = _Feed(d, handed, run, timeout_s, ctl, started_at, sent, engine.new_event)
                await send_layers(d, feed)
                pos += n
            ctl.set_result(d.slot, LLMStatusCode.LLM_SUCCESS)
        finally:
            handed.leave()

    async def send_layers(d: Destination, feed: _Feed) -> None:
        ctl.start_slot(d.slot)
        spec = d.make_spec(feed.run)
        # The link is taken for each layer once the request is granted, never while the
        # GRANT is awaited: the target may hold the request until other layer-wise requests
        # of this link, which need the link for their next layers, let go of its slots.
        try:
            d.link.check_alive()
            _, descs = await initiate(engine, d.link, spec, ctl.token.child(None), None, feed)
        except TimeoutError:
            ctl.set_result(d.slot, LLMStatusCode.LLM_TIMEOUT)
            raise LLMException(
                f"layer {feed.layer} to cluster {d.link.peer_cluster_id} did not finish within "
                f"{timeout_s:.3f} s (sync_kv_timeout per layer)",
                status_code=LLMStatusCode.LLM_TIMEOUT,
            ) from None
        except CopyCancelled:
            if feed.ended_early and failure:
                return  # the synchronizer failed: already reported, nothing more goes out
            raise
        except LLMException as exc:
            # A stopped copy (CopyCancelled: a cancel, a deadline) is the task's to report,
            # not this slot's.
            if is_caller_facing(exc):
                ctl.set_result(d.slot, exc.status_code)
            raise
        finally:
            feed.close()
        ctl.add(0, descs)  # (the bytes were counted as each layer left)

    def sent(layers: range, nbytes: int) -> None:
        # The layers of one cache are alike (the same tensors per layer and blocks), so each
        # moves an equal share.
        ctl.add(nbytes * len(layers), 0)
        now = ctl.now()
        for layer in layers:
            nbytes_at[layer] = nbytes_at.get(layer, 0) + nbytes
            remaining[layer] -= 1
            if remaining[layer] == 0:  # the layer left for everywhere
                ctl.layer_done(layer, ready_at[layer], started_at[layer], now, nbytes_at[layer])

    async def produce(channels: dict[int, LayerChannel]) -> None:
        def hand_on(layer: int, t_wait: float) -> list[LayerChannel]:
            # A layer ready: handed to each destination's channel; those whose window is
            # full. No loop turn while the windows have room: a consumer that wakes then finds
            # every layer that was ready, for one request. A layer that came at the model's
            # pace may leave at once, from here (LayerChannel.direct); layers ready early
            # queue, to leave together.
            if failure:
                return []  # (a signal's callback as the transfer fails: nothing goes out)
            ready_at[layer] = now = ctl.now()
            paced = now - t_wait > _WAITED_S
            if paced:
                waited.append(now)  # the model's pace, not a layer ready early
            return [c for c in targets_of[layer] if not c.hand_nowait(layer, paced)]

        targets_of = {  # each layer's destinations' channels
            n: [channels[d.index] for d in dests if n in members[d.index]] for n in all_layers
        }

        # Layers signalled at the model's pace are handed on from the signal's loop callback;
        # this task goes on where that needs a wait (a full window, an abort, a long wait).
        pump = SignalPump.of(engine, sync, all_layers, sync_timeout_ms, hand_on, ctl.now)
        try:
            i = 0
            while i < len(all_layers):
                since = t_wait = None
                if pump is not None:
                    i, full = await pump.run(i)
                    for channel in full:
                        await channel.hand(all_layers[i - 1])
                    if full or i == len(all_layers):
                        continue
                    t_wait, since = pump.t_wait, pump.since
                layer = all_layers[i]
                i += 1
                ready_at[layer] = t_wait = ctl.now() if t_wait is None else t_wait
                try:
                    if not known_ready(layer):
                        await wait_for_layer(engine, sync, layer, sync_timeout_ms, since)
                except SynchronizerAborted as exc:
                    # Like upstream's sequential loop: layers that were already ready still
                    # go out (the channels drain), nothing after this one does.
                    for d in dests:
                        if layer in members[d.index]:
                            ctl.set_result(d.slot, exc.status_code)
                    if not failure:
                        failure.append(exc)
                    return
                for channel in hand_on(layer, t_wait):
                    await channel.hand(layer)
        finally:
            for channel in channels.values():
                channel.finish()

    async with anyio.create_task_group() as tg:
        channels = {d.index: LayerChannel(window, engine.new_event) for d in dests}
        for d in dests:
            tg.start_soon(_first_failure, consume, (d, channels[d.index]), failure, tg)
        tg.start_soon(_first_failure, produce, (channels,), failure, tg)
    if failure:
        raise failure[0]


_WAITED_S = 50e-6  # a layer whose synchronizer took longer was being computed (the pace)


class _Feed:
    """The layers ``run`` of one request of a destination, as its :class:`LayerFeed`: the
    layers handed over once the link's phase lock is ours for them (FIFO with pulls and
    pushes: they go between two), given back once they left."""

    def __init__(
        self,
        d: Destination,
        handed: LayerChannel,
        run: range,
        timeout_s: float,
        ctl: TaskControl,
        started_at: dict[int, float],
        sent: Callable[[range, int], None],
        new_event: Callable[[], LoopEvent],
    ) -> None:
        self.timeout_s = timeout_s
        # As when a request's budget covered its GRANT: sync_kv_timeout per layer it carries.
        self.grant_timeout_s = timeout_s * len(run)
        self.run = run
        self._d = d
        self._handed = handed
        self._ctl = ctl
        self._started_at = started_at
        self._sent = sent
        #: the link's phase lock is ours (for the layers due)
        self._holding = False
        #: the first layer being sent (or last sent)
        self.layer = run.start
        #: the next layer to leave
        self._due = run.start
        #: the sender's way to send a layer at once while it waits (see next)
        self._now: Callable[[int], bool] | None = None
        self._new_event = new_event
        #: set once a layer sent at once, still going out when it was handed to the socket,
        #: is all out (it holds the link until then)
        self._out: LoopEvent | None = None
        #: the producer stopped before this request's last layer
        self.ended_early = False

    def close(self) -> None:
        """Give the link back if a layer still holds it (the request ended early)."""
        if self._holding:
            self._holding = False
            self._d.link.transfer_lock.give(True)

    async def next(self, now: Callable[[int], bool] | None = None) -> range | None:
        handed = self._handed
        if now is not None and not self._holding and not handed.ready():
            # Nothing is due yet: a layer handed over while we wait may leave at once from
            # there (_at_once), with no wake-up of this task for it.
            self._now, handed.direct = now, self._at_once
            try:
                arrived = await handed.wait()
            finally:
                self._now = handed.direct = None
        else:
            arrived = await handed.wait()
        if self._due >= self.run.stop:
            return range(0)  # the request's last layers left at once (later ones wait)
        if not handed.ready():
            if not arrived:
                self.ended_early = True
                return None
            return range(0)
        first = handed.take_nowait()
        if self._out is not None:
            await self._out.wait()  # a layer sent at once is still going out: its turn first
        if not self._holding:
            await self._d.link.transfer_lock.acquire(True)
            self._holding = True
        # Every layer of the request handed over meanwhile goes too (in order).
        last = self._handed.take_through(self.run.stop - 1)
        last = first if last is None else last
        self.layer = first
        self._due = last + 1
        now_s = self._ctl.now()
        for layer in range(first, last + 1):
            self._started_at.setdefault(layer, now_s)
        base = self.run.start
        return range(first - base, last + 1 - base)

    def _at_once(self, layer: int) -> bool:
        """The producer hands ``layer`` over while :meth:`next` waits with nothing due: send
        it from here if it is the one due and the link is free for it (FIFO: not while a pull
        queues for the link), with ``now``. True: it is on its way (it holds the link until
        it is reported sent, once it is all out)."""
        now = self._now
        if now is None or layer != self._due or layer >= self.run.stop or self._out is not None:
            return False
        if not self._d.link.transfer_lock.try_take(True):
            return False
        self._holding = True  # (given back once it is reported sent, or here)
        self.layer = layer
        fresh = layer not in self._started_at
        if fresh:
            self._started_at[layer] = self._ctl.now()  # (read where it is reported sent)
        try:
            sent = now(layer - self.run.start)
        except BaseException:
            self.close()
            raise
        if not sent:
            self.close()
            if fresh:
                del self._started_at[layer]
            return False
        if self._holding:  # still going out: sent() gives the link back once it is out
            self._out = self._new_event()
        self._due = layer + 1
        if self._due >= self.run.stop:
            self._handed.nudge()  # the request's last layer left: its sender goes on
        return True

    def sent(self, layers: range, nbytes: int | None) -> None:
        self.close()
        out, self._out = self._out, None
        if out is not None:
            out.set()
        if nbytes is not None:
            base = self.run.start
            self._sent(range(base + layers.start, base + layers.stop), nbytes)


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
