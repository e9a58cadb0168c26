"""Worker side of :class:`LlmddConnector`: one llmdd_async endpoint per worker.

The endpoint, its links and the side channel run on a private asyncio loop in a daemon thread;
vLLM's model-runner thread only hands work to it and reads finished sets under a lock, so no
hook blocks the forward pass (``save_kv_layer`` is one ``set`` on an event). The connector never
touches CPU affinity or thread counts.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import contextlib
import contextvars
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .._datadist import LLMDataDist
from .._enums import LLMRole, LLMStatusCode, Placement
from .._errors import LLMException
from .._log import get_logger
from .._synchronizer import LayerEvents
from .._types import BlocksCacheKey, CacheDesc, LLMClusterInfo, TransferWithCacheKeyConfig
from ._config import ConnectorConfig, host_key
from ._control import ControlClient, ControlError, ControlServer, ServerPeer
from ._layout import KVLayout, derive_layout, incompatibility
from ._meta import CAPABILITY_KEY, LlmddMetadata, RecvSpec, valid_capability

__all__ = ["WorkerEngine"]

log = get_logger("vllm")

_MODEL_ID = 0  # every engine registers its KV as BlocksCacheKey(own cluster id, 0)
#: ``ids`` for requests the prefill does not hold (yet), kept at most: count, and blocks of
#: all of them together (8 bytes each)
_PENDING_IDS_MAX = 1024
_PENDING_BLOCKS_MAX = 1 << 20
#: ``done`` messages for capabilities not held yet (a decode faster than this step)
_EARLY_DONE_MAX = 4096
#: how long an idle step (nothing scheduled, loads in flight) waits for a load to finish
_IDLE_WAIT_S = 0.002


def _cap_key(cap: str) -> str:
    """What the prefill files a capability under: its hash (dict lookups on the secret itself
    would time-leak its prefix)."""
    return hashlib.sha256(cap.encode()).hexdigest()


class _Loop:
    """A private asyncio loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="llmdd-vllm", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        # a fresh context: the caller's (its sniffio library, say) must not leak into the
        # loop's tasks, which anyio inspects
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coro, self.loop)

    def call(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` on the loop, soon, in a fresh context (as :meth:`submit`)."""
        self.loop.call_soon_threadsafe(fn, *args, context=contextvars.Context())

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class _Remote:
    """A prefill rank this decode worker talks to: side channel + llmdd link, kept."""

    host: str
    port: int
    client: ControlClient
    cluster_id: int
    meta: dict[str, Any]
    waiters: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    dead: str | None = None


@dataclass
class _Push:
    """A layer-wise push of one prefill request (prefill side)."""

    key: str  # the capability's key (:func:`_cap_key`)
    events: LayerEvents
    req_id: str | None = None  # internal id, once the scheduler named it
    local_blocks: list[int] | None = None
    dst: dict[str, Any] | None = None  # the decode's ids message
    peer: ServerPeer | None = None
    task: asyncio.Task[None] | None = None
    forward_end: float | None = None
    result: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    created: float = field(default_factory=time.monotonic)


class WorkerEngine:
    """Everything the worker-side connector does, off vLLM's threads."""

    def __init__(self, cfg: ConnectorConfig, engine_id: str, tp_rank: int, tp_size: int) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        # vLLM seeds `random` alike in every engine: draw from the OS instead
        self.cluster_id = secrets.randbits(62) + 1
        #: side channel and data endpoint key: the configured one, else this user's host key
        #: (so a keyless engine still refuses every other process that reaches 127.0.0.1)
        self._key_file = None
        if cfg.auth_key:
            self._key = cfg.auth_key
        else:
            self._key, self._key_file = host_key()
        self._loop = _Loop()
        self._lock = threading.Lock()
        self.layout: KVLayout | None = None
        self._layer_index: dict[str, int] = {}
        self._keep: list[Any] = []
        self._dd: LLMDataDist | None = None
        self._cache: Any = None
        self._server: ControlServer | None = None
        # decode side (loop thread)
        self._remotes: dict[tuple[str, int], _Remote] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._loads: dict[str, asyncio.Task[None]] = {}
        # prefill side (loop thread)
        self._pushes: dict[str, _Push] = {}
        #: decodes' ids for capabilities not held yet: cap key -> (message, peer)
        self._pending_ids: OrderedDict[str, tuple[dict[str, Any], ServerPeer]] = OrderedDict()
        self._pending_blocks = 0
        #: request id -> its capability's key (prefill requests with a remote decode)
        self._cap_of: dict[str, str] = {}
        #: finished prefill requests whose blocks are held: cap key -> (request id, blocks)
        self._held: dict[str, tuple[str, list[int]]] = {}
        #: ``done`` for caps not held yet: cap key -> when
        self._early_done: OrderedDict[str, float] = OrderedDict()
        self._bg: set[asyncio.Future[Any]] = set()
        # shared with vLLM's thread, under _lock
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        #: prefill requests whose blocks a push is reading (not freed before it is fenced)
        self._pushing: set[str] = set()
        #: prefill requests whose blocks may be freed now -> when that was learnt
        self._released: OrderedDict[str, float] = OrderedDict()
        self._stats: list[dict[str, Any]] = []
        # vLLM thread only
        self._send: dict[str, float] = {}  # request id -> lease deadline
        self._step_saves: list[tuple[str, LayerEvents]] = []
        self._idle_step = False
        #: set by the loop thread when a load finished or blocks were released (wakes an
        #: idle step's wait)
        self._progress = threading.Event()
        #: on a GPU: layers count as ready once the compute stream passed their KV writes
        self._device_events: Any = None

    # ---------------------------------------------------------------- setup

    def register(self, kv_caches: dict[str, Any], block_size: int) -> None:
        """Derive the layout, start the endpoint and the side channel, register the KV.

        Raises:
            ValueError: an unsupported KV layout.
            RuntimeError: the endpoint or side channel could not start.
        """
        layout, names, tensors = derive_layout(kv_caches, block_size)
        self.layout = layout
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._keep = tensors
        if not layout.device.startswith("cpu"):
            from .._devices._torch import DeviceEventWaiter

            self._device_events = DeviceEventWaiter()
        self._loop.run(self._start(layout, tensors), timeout=120)
        log.info(
            "vllm.registered",
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            cluster_id=self.cluster_id,
            layout=layout.layout,
            layers=layout.num_layers,
            blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
            side_channel=f"{self.cfg.side_channel_host}:{self.side_channel_port}",
        )

    async def _start(self, layout: KVLayout, tensors: list[Any]) -> None:
        host = self.cfg.side_channel_host
        data_host = "127.0.0.1" if host == "localhost" else host
        options = {
            "llm.EnableCacheManager": "1",
            "llm.EnableRemoteCacheAccessible": "1",
            "llm.listenIpInfo": f"{data_host}:0",
            "llm.Transport": self.cfg.transport,
            "llm.SyncKvCacheWaitTime": str(int(self.cfg.transfer_timeout_s * 1000)),
        }
        options["llm.AuthKey"] = self._key
        on_device = not layout.device.startswith("cpu")
        if on_device:
            options["llm.DeviceAdapter"] = "torch"
            options["llm.TorchDevice"] = layout.device
        dd = LLMDataDist(LLMRole.MIX, self.cluster_id)
        await dd.init(options)
        self._dd = dd
        desc = CacheDesc(
            layout.num_tensors,
            [layout.num_blocks, layout.block_elems],
            layout.data_type,
            Placement.DEVICE,
        )
        addrs: list[Any] = tensors if on_device else [int(t.data_ptr()) for t in tensors]
        self._cache = dd.cache_manager.register_blocks_cache(
            desc, addrs, BlocksCacheKey(self.cluster_id, _MODEL_ID), remote_accessible=True
        )
        server = ControlServer(
            self._key, self._welcome_meta, self._on_message, self.cfg.transfer_timeout_s
        )
        port = self.cfg.side_channel_port
        await server.start(host, port + self.tp_rank if port else 0)
        self._server = server

    @property
    def side_channel_port(self) -> int:
        return self._server.port if self._server is not None else 0

    def _welcome_meta(self) -> dict[str, Any]:
        assert self._dd is not None
        assert self.layout is not None
        listen = self._dd.listen_address
        assert listen is not None
        return {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "cluster_id": self.cluster_id,
            "data_host": listen[0],
            "data_port": listen[1],
            "layout": self.layout.to_wire(),
        }

    def shutdown(self) -> None:
        async def stop() -> None:
            for t in list(self._loads.values()):
                t.cancel()
            for p in list(self._pushes.values()):
                if p.task is not None:
                    p.task.cancel()
            for r in list(self._remotes.values()):
                r.client.close()
            if self._server is not None:
                await self._server.close()
            if self._dd is not None:
                await self._dd.finalize()

        with contextlib.suppress(Exception):
            self._loop.run(stop(), timeout=30)
        self._loop.stop()

    # ---------------------------------------------------------------- per step (vLLM thread)

    def on_step(self, meta: LlmddMetadata) -> None:
        """Hand this step's work to the loop (never blocks)."""
        now = time.monotonic()
        for req_id, (lease, _) in meta.send.items():
            self._send[req_id] = now + lease
        # this step's layer-wise saves: their events are fed by save_layer on this thread
        events = {req_id: LayerEvents() for req_id in meta.save}
        self._step_saves = list(events.items())
        self._idle_step = meta.idle
        if meta.recv or meta.release or meta.save or meta.send or meta.aborted:
            self._loop.call(self._dispatch, meta, events)

    def save_layer(self, layer_name: str) -> None:
        """The forward pass launched ``layer_name``'s KV writes. On CPU they are done; on a
        GPU they are queued on the compute stream, so the layer counts as ready once the
        device passed an event recorded here (waited for in a helper thread)."""
        if not self._step_saves:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        targets = [events for _, events in self._step_saves]

        def ready() -> None:
            for events in targets:
                events.layer_ready(i)

        if self._device_events is not None:
            self._device_events.record(ready)
        else:
            ready()

    def end_of_step(self) -> None:
        if not self._step_saves:
            return
        ids = [req_id for req_id, _ in self._step_saves]
        self._step_saves = []
        # perf_counter: the clock of TaskStatistics.started
        self._loop.call(self._forward_ended, ids, time.perf_counter())

    def _forward_ended(self, req_ids: list[str], when: float) -> None:
        for req_id in req_ids:
            p = self._find_push(req_id)
            if p is not None and p.forward_end is None:
                p.forward_end = when

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self._idle_step and (self._loads or self._send):
            # Nothing scheduled: every request waits for its KV, or for its decode to take
            # the blocks. The engine loop would step without pause, spinning a core that the
            # transfer (or a prefill on the same host) needs: wait until a load finishes or
            # blocks are released instead, for at most _IDLE_WAIT_S.
            self._progress.wait(_IDLE_WAIT_S)
        elif self._loads:
            # While loads are in flight the engine loop steps without pause, holding the GIL
            # most of the time; the endpoint's loop thread must run to grant pushes and
            # finish pulls. A zero sleep hands it the GIL once per step (no added delay).
            time.sleep(0)
        self._progress.clear()
        now = time.monotonic()
        sending: set[str] = set()
        with self._lock:
            recv = self._recv_done
            self._recv_done = set()
            expired: set[str] = set()
            for req_id in list(self._send):
                if self._released.pop(req_id, None) is not None:
                    sending.add(req_id)
                elif self._send[req_id] <= now:
                    if req_id in self._pushing:
                        # a push still reads these blocks: stop it; its end releases them
                        expired.add(req_id)
                        self._send[req_id] = now + self.cfg.transfer_timeout_s
                        continue
                    sending.add(req_id)
                    log.warning("vllm.lease_expired", request_id=req_id, lease_s=self.cfg.lease_s)
            # releases of requests not (yet) finished here are kept for one lease at most
            while self._released and next(iter(self._released.values())) < now - self.cfg.lease_s:
                self._released.popitem(last=False)
        for req_id in sending:
            del self._send[req_id]
        if sending or expired:
            self._loop.call(self._forget_pushes, sending | expired)
        if finished_req_ids:  # aborted loads (checked on the loop, which owns them)
            self._loop.call(self._cancel_loads, set(finished_req_ids))
        return sending, recv

    def load_errors(self) -> set[int]:
        with self._lock:
            out = self._load_errors
            self._load_errors = set()
        return out

    def take_stats(self) -> list[dict[str, Any]]:
        with self._lock:
            out = self._stats
            self._stats = []
        return out

    # ---------------------------------------------------------------- loop thread

    def _dispatch(self, meta: LlmddMetadata, events: dict[str, LayerEvents]) -> None:
        for req_id, spec in meta.recv.items():
            if req_id not in self._loads:
                self._loads[req_id] = asyncio.ensure_future(self._load(req_id, spec))
        for host, port, cap in meta.release:
            self._spawn(self._release_remote(host, port, cap))
        for req_id, cap in getattr(meta, "caps", {}).items():
            if valid_capability(cap):
                self._cap_of.setdefault(req_id, _cap_key(cap))
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
                self._release(req_id)
                continue
            p = self._pushes.get(ck)
            if p is None and (self.cfg.mode == "layerwise" or ck in self._pending_ids):
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

    def _spawn(self, coro: Any) -> None:
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
        stale = time.monotonic() - self.cfg.lease_s - self.cfg.transfer_timeout_s
        pending = self._pop_pending(ck)
        if pending is not None and float(pending[0].get("_at", 0.0)) >= stale:
            p.dst, p.peer = pending
        return p

    def _pop_pending(self, ck: str) -> tuple[dict[str, Any], ServerPeer] | None:
        pending = self._pending_ids.pop(ck, None)
        if pending is not None:
            self._pending_blocks -= len(pending[0]["blocks"])
        return pending

    def _ready_push(self, req_id: str, ck: str) -> _Push:
        """A push whose layers are all computed already (push after the prefill)."""
        p = self._push_for(req_id, ck)
        for i in range(self.layout.num_layers if self.layout else 0):
            p.events.layer_ready(i)
        return p

    def _find_push(self, req_id: str) -> _Push | None:
        ck = self._cap_of.get(req_id)
        return self._pushes.get(ck) if ck is not None else None

    def _forget_pushes(self, req_ids: set[str]) -> None:
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
        while self._pending_ids:
            k, (msg, _) = next(iter(self._pending_ids.items()))
            if now - float(msg.get("_at", now)) < self.cfg.lease_s:
                break
            self._pop_pending(k)
        while self._early_done and next(iter(self._early_done.values())) < now - self.cfg.lease_s:
            self._early_done.popitem(last=False)

    # -------- side channel, prefill side

    async def _on_message(self, peer: ServerPeer, msg: dict[str, Any]) -> None:
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
        ck = _cap_key(cap)
        reply: dict[str, Any] = {"op": "pushed", "req": req, "cap": cap, "ok": False}
        if op == "done":
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
            self._release(held[0])
            log.debug("vllm.released", request_id=held[0], by=peer.address)
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
            blocks = msg.get("blocks")
            cid = msg.get("cluster")
            skip = msg.get("skip", 0)
            most = self.layout.num_blocks if self.layout is not None else 0
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
            msg = {
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
                    self._spawn(_quiet(old_pending[1].send({**reply, "why": "replaced"})))
                self._pending_ids[ck] = (msg, peer)
                self._pending_blocks += len(blocks)
                while (
                    len(self._pending_ids) > _PENDING_IDS_MAX
                    or self._pending_blocks > _PENDING_BLOCKS_MAX
                ):
                    k = next(iter(self._pending_ids))
                    old, old_peer = self._pop_pending(k) or ({}, peer)
                    gone = {**reply, "req": old.get("req"), "cap": old.get("cap")}
                    self._spawn(_quiet(old_peer.send({**gone, "why": "evicted"})))
                return
            peer.proved()
            p.dst, p.peer = msg, peer
            self._maybe_start_push(p)

    def _maybe_start_push(self, p: _Push) -> None:
        if p.task is not None or p.done or p.dst is None or p.local_blocks is None:
            return
        if p.req_id is not None:
            with self._lock:
                self._pushing.add(p.req_id)
        p.task = asyncio.ensure_future(self._run_push(p))

    async def _run_push(self, p: _Push) -> None:
        assert p.dst is not None
        assert p.local_blocks is not None
        assert self.layout is not None
        layout = self.layout
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
            assert self._dd is not None
            await self._dd.wait_for_link(peer_cid, 2000)
            cm = self._dd.cache_manager
            cfg = TransferWithCacheKeyConfig(
                BlocksCacheKey(peer_cid, _MODEL_ID),
                range(layout.num_layers),
                range(layout.num_layers),
            )
            task = cm.transfer_cache_async(
                self._cache,
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
            rec = _record(req, "send", "layerwise", st.bytes, st.busy_seconds)
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
            with self._lock:
                self._stats.append(rec)
            log.info("vllm.pushed", request_id=req, **{k: v for k, v in rec.items() if k != "req"})
        except asyncio.CancelledError:
            why = "cancelled"
        except Exception as e:  # any failure: the decode recomputes
            why = repr(e)
            log.warning("vllm.push_failed", request_id=req, reason=why)
        self._finish_push(p, ok, why)

    def _finish_push(self, p: _Push, ok: bool, why: str) -> None:
        if p.done:
            return
        p.done = True
        if p.req_id is not None:
            with self._lock:
                self._pushing.discard(p.req_id)
        if p.peer is not None and p.dst is not None and not p.peer.closed:
            msg = {
                "op": "pushed",
                "req": p.dst.get("req"),
                "cap": p.dst.get("cap"),
                "ok": ok,
                "why": why,
                **p.result,
            }
            self._spawn(_quiet(p.peer.send(msg)))
        if p.req_id is not None:
            self._release(p.req_id)

    def _release(self, req_id: str) -> None:
        with self._lock:
            self._released[req_id] = time.monotonic()
            self._released.move_to_end(req_id)
            while len(self._released) > 65536:
                self._released.popitem(last=False)
        self._progress.set()

    # -------- decode side

    async def _remote(self, host: str, port: int) -> _Remote:
        """The kept side channel + link to one prefill rank, made on first use."""
        key = (host, port)
        r = self._remotes.get(key)
        if r is not None and r.dead is None:
            return r
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            r = self._remotes.get(key)
            if r is not None and r.dead is None:
                return r
            if r is not None:
                await self._drop_remote(r)
            client = ControlClient(self._key)
            try:
                meta = await client.connect(host, port, self.cfg.transfer_timeout_s)
            except ControlError as e:
                if self._key_file is None:
                    raise
                raise ControlError(
                    f"{e} (no auth_key is set: this engine uses its user's host key "
                    f"{self._key_file}, which only engines of this user on this host share; "
                    "set the same auth_key on both engines otherwise)"
                ) from e
            try:
                assert self.layout is not None
                assert self._dd is not None
                bad = incompatibility(self.layout, dict(meta.get("layout") or {}))
                if bad:
                    raise ControlError(
                        f"prefill {meta.get('engine_id')} at {host}:{port} has another KV "
                        f"layout: {bad}"
                    )
                if int(meta.get("tp_size", 1)) != self.tp_size:
                    raise ControlError(
                        f"prefill {meta.get('engine_id')} runs TP {meta.get('tp_size')}, "
                        f"this engine TP {self.tp_size}: equal TP is required"
                    )
                cid = int(meta["cluster_id"])
                info = LLMClusterInfo()
                info.remote_cluster_id = cid
                info.append_local_ip_info(str(meta["data_host"]), 0)
                info.append_remote_ip_info(str(meta["data_host"]), int(meta["data_port"]))
                code, _ = await self._dd.link_clusters(
                    [info], timeout=int(self.cfg.transfer_timeout_s * 1000)
                )
                if code not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                    raise ControlError(
                        f"cannot link to prefill {meta.get('engine_id')}: "
                        f"{self._dd.link_failure(cid) or code.name}"
                    )
            except BaseException:
                client.close()
                raise
            r = _Remote(host, port, client, cid, meta)
            r.reader = asyncio.ensure_future(self._read_remote(r))
            self._remotes[key] = r
            log.info("vllm.remote_up", host=host, port=port, engine=meta.get("engine_id"))
            return r

    async def _read_remote(self, r: _Remote) -> None:
        try:
            while True:
                msg = await r.client.recv()
                if msg["op"] == "pushed":
                    fut = r.waiters.pop(str(msg.get("cap")), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except ControlError as e:
            r.dead = str(e)
        except asyncio.CancelledError:
            r.dead = "closed"
        for fut in r.waiters.values():
            if not fut.done():
                fut.set_exception(ControlError(f"prefill side channel lost: {r.dead}"))
        r.waiters.clear()

    async def _drop_remote(self, r: _Remote) -> None:
        r.dead = r.dead or "dropped"
        r.client.close()
        if r.reader is not None:
            r.reader.cancel()
        if self._remotes.get((r.host, r.port)) is r:
            del self._remotes[(r.host, r.port)]
        if self._dd is not None:
            with contextlib.suppress(Exception):
                info = LLMClusterInfo()
                info.remote_cluster_id = r.cluster_id
                info.append_local_ip_info(str(r.meta["data_host"]), 0)
                info.append_remote_ip_info(str(r.meta["data_host"]), int(r.meta["data_port"]))
                await self._dd.unlink_clusters([info], timeout=1000)

    def _address(self, params: dict[str, Any]) -> tuple[str, int]:
        host = str(params["remote_host"])
        ports = params.get("llmdd_ports")
        if isinstance(ports, list) and len(ports) > self.tp_rank:
            return host, int(ports[self.tp_rank])
        return host, int(params["remote_port"]) + self.tp_rank

    async def _load(self, req_id: str, spec: RecvSpec) -> None:
        params = spec.params
        remote_req = str(params.get("remote_request_id", ""))
        cap = str(params.get(CAPABILITY_KEY, ""))
        mode = "layerwise" if self.cfg.mode == "layerwise" else "pull"
        r: _Remote | None = None
        t0 = time.monotonic()
        ok = cancelled = False
        try:
            if int(params.get("tp_size", 1)) != self.tp_size:
                raise ValueError(f"prefill TP {params.get('tp_size')} != decode TP {self.tp_size}")
            if not valid_capability(cap):
                raise ValueError(f"kv_transfer_params without a valid {CAPABILITY_KEY}")
            host, port = self._address(params)
            r = await self._remote(host, port)
            assert self.layout is not None
            dst = list(spec.local_blocks)
            if mode == "pull":
                blocks = params.get("remote_block_ids")
                if blocks and isinstance(blocks[0], list):
                    blocks = blocks[0]
                if not isinstance(blocks, list):
                    raise ValueError("remote_block_ids missing")
                src = [int(b) for b in blocks[spec.skip_blocks : spec.skip_blocks + len(dst)]]
                if len(src) != len(dst):
                    raise ValueError(f"{len(src)} remote blocks for {len(dst)} local blocks")
                assert self._dd is not None
                task = self._dd.cache_manager.pull_blocks(
                    BlocksCacheKey(r.cluster_id, _MODEL_ID),
                    self._cache,
                    src,
                    dst,
                    tensor_num_per_layer=self.layout.tensors_per_layer,
                )
                await task
                st = task.statistics()
                rec = _record(req_id, "recv", "pull", st.bytes, st.seconds)
            else:
                fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
                r.waiters[cap] = fut
                await r.client.send(
                    {
                        "op": "ids",
                        "req": remote_req,
                        "cap": cap,
                        "cluster": self.cluster_id,
                        "blocks": dst,
                        "skip": spec.skip_blocks,
                        "layout": self.layout.to_wire(),
                    }
                )
                res = await asyncio.wait_for(fut, self.cfg.lease_s + self.cfg.transfer_timeout_s)
                if not res.get("ok"):
                    raise RuntimeError(f"prefill could not push: {res.get('why')}")
                n = int(res.get("bytes") or len(dst) * self.layout.block_bytes)
                rec = _record(req_id, "recv", "layerwise", n, float(res.get("seconds") or 0.0))
                rec["wall_s"] = time.monotonic() - t0  # ids sent -> last layer landed
            ok = True
            with self._lock:
                self._stats.append(rec)
            log.info(
                "vllm.loaded", request_id=req_id, **{k: v for k, v in rec.items() if k != "req"}
            )
        except asyncio.CancelledError:  # the request was aborted: vLLM frees its blocks
            cancelled = True
            log.info("vllm.load_cancelled", request_id=req_id)
        except Exception as e:  # any failure: vLLM recomputes, the engine carries on
            log.warning("vllm.load_failed", request_id=req_id, reason=repr(e))
            link_down = isinstance(e, LLMException) and e.status_code in (
                LLMStatusCode.LLM_LINK_FAILED,
                LLMStatusCode.LLM_NOT_YET_LINK,
            )
            if r is not None and (link_down or isinstance(e, ControlError)):
                await self._drop_remote(r)
        finally:
            if r is not None:
                r.waiters.pop(cap, None)
        # vLLM frees (and reuses) these blocks once this load is reported: first the prefill
        # must have stopped pushing into them, or the link to it must go
        if (
            not ok
            and mode == "layerwise"
            and r is not None
            and r.dead is None
            and not await self._stop_remote_push(r, remote_req, cap)
        ):
            await self._drop_remote(r)
        if not ok and not cancelled:
            with self._lock:
                self._load_errors.update(spec.local_blocks)
        if mode == "pull" and r is not None and r.dead is None:
            await _quiet(r.client.send({"op": "done", "req": remote_req, "cap": cap}))
        self._loads.pop(req_id, None)
        with self._lock:
            self._recv_done.add(req_id)
        self._progress.set()

    async def _stop_remote_push(self, r: _Remote, remote_req: str, cap: str) -> bool:
        """Ask the prefill to stop (or never start) pushing ``remote_req``; True once it
        confirmed that no more bytes come."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        r.waiters[cap] = fut
        try:
            await r.client.send({"op": "cancel", "req": remote_req, "cap": cap})
            await asyncio.wait_for(fut, self.cfg.transfer_timeout_s)
            return True
        except Exception as e:
            log.warning("vllm.cancel_unconfirmed", request_id=remote_req, reason=repr(e))
            return False
        finally:
            r.waiters.pop(cap, None)

    def _cancel_loads(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            t = self._loads.get(req_id)
            if t is not None:
                t.cancel()

    async def _release_remote(self, host: str, port: int, cap: str) -> None:
        """A decode request aborted before loading: free the prefill's blocks now."""
        try:
            r = await self._remote(*self._address({"remote_host": host, "remote_port": port}))
            await r.client.send({"op": "done", "cap": cap})
        except Exception as e:
            log.info("vllm.release_failed", host=host, port=port, reason=repr(e))


def _record(req: str, role: str, mode: str, nbytes: int, seconds: float) -> dict[str, Any]:
    return {
        "req": req,
        "role": role,
        "mode": mode,
        "bytes": int(nbytes),
        "seconds": float(seconds),
        "gbps": (nbytes / seconds / 1e9) if seconds > 0 else 0.0,
    }


async def _quiet(coro: Any) -> None:
    with contextlib.suppress(Exception):
        await coro
