"""The prefill side of a worker: hold finished requests' blocks for their decode, push them.

A prefill request with a remote decode carries a capability (``llmdd_capability``); every
side-channel message names its request by that capability, never by request id, and the
prefill files it under the capability's hash (:func:`cap_key`). Once the request finished
here, its blocks are *held* until the decode says ``done`` (pull mode), a push into the
decode's blocks (``ids``, layer-wise mode) ends, or the lease runs out. A layer-wise push
starts as soon as both the decode's ids and our blocks are known, and moves each layer as the
forward pass computes it. Runs on the worker's loop thread; what vLLM's thread reads goes
through :class:`~._handoff.Handoff`.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from .._log import get_logger
from .._synchronizer import LayerEvents
from .._types import TransferWithCacheKeyConfig
from ._config import ConnectorConfig
from ._control import ServerPeer, quietly
from ._endpoint import Endpoint, cache_key
from ._handoff import Handoff, transfer_record
from ._layout import incompatibility
from ._meta import LlmddMetadata, valid_capability

__all__ = ["PrefillSide", "cap_key"]

log = get_logger("vllm")

#: ``ids`` for requests the prefill does not hold (yet), kept at most: count, and blocks of
#: all of them together (8 bytes each)
_PENDING_IDS_MAX = 1024
_PENDING_BLOCKS_MAX = 1 << 20
#: ``done`` messages for capabilities not held yet (a decode faster than this step)
_EARLY_DONE_MAX = 4096


def cap_key(cap: str) -> str:
    """What the prefill files a capability under: its hash (dict lookups on the secret itself
    would time-leak its prefix)."""
    return hashlib.sha256(cap.encode()).hexdigest()


@dataclass
class _Push:
    """A layer-wise push of one prefill request."""

    key: str  # the capability's key (:func:`cap_key`)
    events: LayerEvents
    req_id: str | None = None  # internal id, once the scheduler named it
    local_blocks: list[int] | None = None
    dst: dict[str, Any] | None = None  # the decode's ids message
    peer: ServerPeer | None = None
    task: asyncio.Task[None] | None = None
    forward_end: float | None = None
    result: dict[str, Any] = field(default_factory=dict)
    done: bool = False


class PrefillSide:
    """Held blocks, pending decode ids and pushes, by capability key."""

    def __init__(self, cfg: ConnectorConfig, endpoint: Endpoint, handoff: Handoff) -> None:
        self._cfg = cfg
        self._ep = endpoint
        self._handoff = handoff
        self._pushes: dict[str, _Push] = {}
        #: decodes' ids for capabilities not held yet: cap key -> (message, peer)
        self.pending_ids: OrderedDict[str, tuple[dict[str, Any], ServerPeer]] = OrderedDict()
        self._pending_blocks = 0
        #: request id -> its capability's key (prefill requests with a remote decode)
        self._cap_of: dict[str, str] = {}
        #: finished prefill requests whose blocks are held: cap key -> (request id, blocks)
        self._held: dict[str, tuple[str, list[int]]] = {}
        #: ``done`` for caps not held yet: cap key -> when
        self._early_done: OrderedDict[str, float] = OrderedDict()
        self._bg: set[asyncio.Future[Any]] = set()

    # ---------------------------------------------------------------- from vLLM's steps

    def on_step(self, meta: LlmddMetadata, events: dict[str, LayerEvents]) -> None:
        """The step's prefill work: capabilities, layer-wise saves (fed ``events``),
        finished requests to hold, aborts; then start every push that can."""
        for req_id, cap in meta.caps.items():
            if valid_capability(cap):
                self._cap_of.setdefault(req_id, cap_key(cap))
        for req_id, blocks in meta.save.items():
            ck = self._cap_of.get(req_id)
            if ck is None:  # no capability: nobody may take it (the decode recomputes)
                continue
            saving = self._push_for(req_id, ck)
            saving.events = events[req_id]
            saving.local_blocks = list(blocks)
        for req_id, (_, blocks) in meta.send.items():
            ck = self._cap_of.get(req_id)
            if req_id in meta.aborted or ck is None:
                continue
            held = self._held.get(ck)
            if held is not None and held[0] != req_id:
                continue  # a capability used twice: the first request keeps it
            self._held[ck] = (req_id, list(blocks))
            if self._early_done.pop(ck, None) is not None:
                self._handoff.release(req_id)
                continue
            p = self._pushes.get(ck)
            if p is None and (self._cfg.mode == "layerwise" or ck in self.pending_ids):
                p = self._ready_push(req_id, ck)
            if p is not None and p.local_blocks is None:
                p.local_blocks = list(blocks)
        for req_id in meta.aborted:
            p = self._find_push(req_id)
            if p is not None and p.task is not None:
                p.task.cancel()
            elif p is not None:
                self._finish_push(p, False, "prefill request aborted")
        for req_id in list(meta.save) + list(meta.send):
            p = self._find_push(req_id)
            if p is not None:
                self._maybe_start_push(p)

    def forward_ended(self, req_ids: list[str], when: float) -> None:
        """The forward pass that computed these requests' prompts ended at ``when``
        (``perf_counter``: the clock of ``TaskStatistics.started``)."""
        for req_id in req_ids:
            p = self._find_push(req_id)
            if p is not None and p.forward_end is None:
                p.forward_end = when

    def forget(self, req_ids: set[str]) -> None:
        """vLLM freed (or is about to free) these requests' blocks: stop holding them, stop
        their pushes (whose end releases them again); drop stale pending ids and dones."""
        for req_id in req_ids:
            ck = self._cap_of.get(req_id)
            if ck is None:
                continue
            held = self._held.get(ck)
            if held is not None and held[0] == req_id:
                del self._held[ck]
            p = self._pushes.get(ck)
            if p is not None and p.req_id == req_id:
                if p.task is not None and not p.task.done():
                    p.task.cancel()
                    continue  # its end releases it again, then it is forgotten
                if not p.done and p.peer is not None and p.dst is not None:
                    self._finish_push(p, False, "lease expired before the push")
                self._pushes.pop(ck, None)
            self._cap_of.pop(req_id, None)
        now = time.monotonic()
        lease = self._cfg.lease_s
        while self.pending_ids:
            k, (msg, _) = next(iter(self.pending_ids.items()))
            if now - float(msg.get("_at", now)) < lease:
                break
            self._pop_pending(k)
        while self._early_done and next(iter(self._early_done.values())) < now - lease:
            self._early_done.popitem(last=False)

    def close(self) -> None:
        """Cancel every push (shutdown)."""
        for p in list(self._pushes.values()):
            if p.task is not None:
                p.task.cancel()

    # ---------------------------------------------------------------- pushes

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _push_for(self, req_id: str, ck: str) -> _Push:
        p = self._pushes.get(ck)
        if p is None:
            p = _Push(ck, LayerEvents())
            self._pushes[ck] = p
        p.req_id = req_id
        # ids older than a decode waits for them belong to a decode that gave up
        stale = time.monotonic() - self._cfg.lease_s - self._cfg.transfer_timeout_s
        pending = self._pop_pending(ck)
        if pending is not None and float(pending[0].get("_at", 0.0)) >= stale:
            p.dst, p.peer = pending
        return p

    def _pop_pending(self, ck: str) -> tuple[dict[str, Any], ServerPeer] | None:
        pending = self.pending_ids.pop(ck, None)
        if pending is not None:
            self._pending_blocks -= len(pending[0]["blocks"])
        return pending

    def _ready_push(self, req_id: str, ck: str) -> _Push:
        """A push whose layers are all computed already (push after the prefill)."""
        p = self._push_for(req_id, ck)
        for i in range(self._ep.layout.num_layers):
            p.events.layer_ready(i)
        return p

    def _find_push(self, req_id: str) -> _Push | None:
        ck = self._cap_of.get(req_id)
        return self._pushes.get(ck) if ck is not None else None

    def _maybe_start_push(self, p: _Push) -> None:
        if p.task is not None or p.done or p.dst is None or p.local_blocks is None:
            return
        if p.req_id is not None:
            with self._handoff.lock:
                self._handoff.pushing.add(p.req_id)
        p.task = asyncio.ensure_future(self._run_push(p))

    async def _run_push(self, p: _Push) -> None:
        """Push ``p``'s blocks into the decode's, layer by layer; never raises (a failure
        is answered ``pushed`` with ``ok: false``, and the decode recomputes)."""
        assert p.dst is not None
        assert p.local_blocks is not None
        layout = self._ep.layout
        log.debug(
            "vllm.push_start",
            request_id=p.req_id,
            layers_ready=sum(p.events.result(i) for i in range(layout.num_layers)),
            blocks=len(p.local_blocks),
        )
        dst = [int(b) for b in p.dst["blocks"]]
        skip = int(p.dst.get("skip", 0))
        src = p.local_blocks[skip : skip + len(dst)]
        req = str(p.dst.get("req"))
        ok, why = False, ""
        try:
            if p.dst.get("layout") and (bad := incompatibility(layout, p.dst["layout"])):
                raise ValueError(f"KV layouts differ: {bad}")
            if len(src) != len(dst) or not dst:
                raise ValueError(f"{len(dst)} decode blocks for {len(src)} prompt blocks")
            peer_cid = int(p.dst["cluster"])
            dd = self._ep.dd
            await dd.wait_for_link(peer_cid, 2000)
            cfg = TransferWithCacheKeyConfig(
                cache_key(peer_cid),
                range(layout.num_layers),
                range(layout.num_layers),
            )
            task = dd.cache_manager.transfer_cache_async(
                self._ep.cache,
                p.events,
                [cfg],
                src,
                dst,
                tensor_num_per_layer=layout.tensors_per_layer,
            )
            await task
            ok = True
            st = task.statistics()
            # transfer time: while bytes moved (not waiting for the decode's ids or a layer)
            rec = transfer_record(req, "send", "layerwise", st.bytes, st.busy_seconds)
            rec["wall_s"] = st.seconds
            p.result = {"bytes": st.bytes, "seconds": st.busy_seconds}
            # The prefill's KV is complete when its last layer is ready (save_kv_layer of the
            # last layer): transfer time before that hid behind the forward pass, the rest
            # is exposed. A push after the prefill (ids late) hides nothing.
            busy = sum(max(0.0, t.finished - t.started) for t in st.layers)
            if st.layers and busy > 0:
                end = max(t.ready for t in st.layers)  # on the task's clock
                if p.forward_end is not None:  # the step's end, if known by now
                    end = max(end, p.forward_end - st.started)
                hidden = sum(max(0.0, min(t.finished, end) - t.started) for t in st.layers)
                rec["hidden_pct"] = round(100.0 * hidden / busy, 1)
                rec["after_forward_s"] = max(0.0, st.seconds - end)
            self._handoff.add_record(rec)
            log.info("vllm.pushed", request_id=req, **{k: v for k, v in rec.items() if k != "req"})
        except asyncio.CancelledError:
            why = "cancelled"
        except Exception as e:  # any failure: the decode recomputes
            why = repr(e)
            log.warning("vllm.push_failed", request_id=req, reason=why)
            self._handoff.add_failure("send", "layerwise")
        self._finish_push(p, ok, why)

    def _finish_push(self, p: _Push, ok: bool, why: str) -> None:
        if p.done:
            return
        p.done = True
        if p.req_id is not None:
            with self._handoff.lock:
                self._handoff.pushing.discard(p.req_id)
        if p.peer is not None and p.dst is not None and not p.peer.closed:
            msg = {
                "op": "pushed",
                "req": p.dst.get("req"),
                "cap": p.dst.get("cap"),
                "ok": ok,
                "why": why,
                **p.result,
            }
            self._spawn(quietly(p.peer.send(msg)))
        if p.req_id is not None:
            self._handoff.release(p.req_id)

    # ---------------------------------------------------------------- side channel

    async def on_message(self, peer: ServerPeer, msg: dict[str, Any]) -> None:
        """A decode's message. Each acts on the request whose capability it presents, and
        only on that one: a request id alone names nothing here."""
        op = msg["op"]
        req = str(msg.get("req", ""))[:512]  # the decode's label, for its logs and ours
        cap = msg.get("cap")
        if not valid_capability(cap):
            log.info("vllm.no_capability", op=op, request_id=req, by=peer.address)
            if op in ("ids", "cancel"):
                await peer.send(
                    {"op": "pushed", "req": req, "cap": None, "ok": False, "why": "no capability"}
                )
            return
        ck = cap_key(cap)
        reply: dict[str, Any] = {"op": "pushed", "req": req, "cap": cap, "ok": False}
        if op == "done":
            self._on_done(peer, ck)
        elif op == "cancel":
            p = self._pushes.get(ck)
            self._pop_pending(ck)
            if p is not None and p.task is not None and not p.task.done():
                p.task.cancel()  # fenced; its end answers "pushed"
                return
            if p is not None and not p.done:
                p.dst, p.peer = None, None  # never push into the cancelled blocks
            await peer.send({**reply, "why": "cancelled"})
        elif op == "ids":
            await self._on_ids(peer, msg, req, cap, ck, reply)

    def _on_done(self, peer: ServerPeer, ck: str) -> None:
        held = self._held.get(ck)
        if held is None:  # not finished here yet, or unknown: remembered for one lease
            self._early_done[ck] = time.monotonic()
            while len(self._early_done) > _EARLY_DONE_MAX:
                self._early_done.popitem(last=False)
            return
        peer.proved()
        p = self._pushes.get(ck)
        if p is not None and p.task is not None and not p.task.done():
            return  # the push finishes it
        self._handoff.release(held[0])
        log.debug("vllm.released", request_id=held[0], by=peer.address)

    async def _on_ids(
        self,
        peer: ServerPeer,
        msg: dict[str, Any],
        req: str,
        cap: str,
        ck: str,
        reply: dict[str, Any],
    ) -> None:
        blocks = msg.get("blocks")
        cid = msg.get("cluster")
        skip = msg.get("skip", 0)
        most = self._ep.layout.num_blocks
        if (
            not isinstance(blocks, list)
            or not 0 < len(blocks) <= most
            or not all(type(b) is int and 0 <= b < 2**31 for b in blocks)
            or type(cid) is not int
            or type(skip) is not int
            or not 0 <= skip <= most
        ):
            await peer.send({**reply, "why": "bad ids"})
            return
        layout = msg.get("layout")
        if layout is not None and (not isinstance(layout, dict) or len(repr(layout)) > 4096):
            await peer.send({**reply, "why": "bad ids"})
            return
        # what is kept, and nothing else of the frame: 8 bytes a block while it waits
        kept = {
            "req": req,
            "cap": cap,
            "cluster": cid,
            "skip": skip,
            "layout": layout,
            "blocks": array.array("q", blocks),
            "_at": time.monotonic(),
        }
        p = self._pushes.get(ck)
        held = self._held.get(ck)
        if p is None and held is not None:  # finished already: push after the prefill
            p = self._ready_push(held[0], ck)
            p.local_blocks = held[1]
        if p is not None and (p.dst is not None or p.done):
            await peer.send({**reply, "why": "capability already used"})
            return
        if p is None:  # the prefill request is not here yet (concurrent flow)
            old_pending = self._pop_pending(ck)
            if old_pending is not None:
                self._spawn(quietly(old_pending[1].send({**reply, "why": "replaced"})))
            self.pending_ids[ck] = (kept, peer)
            self._pending_blocks += len(blocks)
            while (
                len(self.pending_ids) > _PENDING_IDS_MAX
                or self._pending_blocks > _PENDING_BLOCKS_MAX
            ):
                k = next(iter(self.pending_ids))
                old, old_peer = self._pop_pending(k) or ({}, peer)
                gone = {**reply, "req": old.get("req"), "cap": old.get("cap")}
                self._spawn(quietly(old_peer.send({**gone, "why": "evicted"})))
            return
        peer.proved()
        p.dst, p.peer = kept, peer
        self._maybe_start_push(p)
