"""Worker side of :class:`LlmddConnector`: one llmdd_async endpoint per worker.

The endpoint, its links and the side channel run on a private asyncio loop in a daemon thread
(:class:`~.._sync_loop.LoopThread`); vLLM's model-runner thread only hands work to it and
reads finished sets under a lock (:class:`~._handoff.Handoff`), so no hook blocks the forward
pass (``save_kv_layer`` is one ``set`` on an event). The connector never touches CPU affinity
or thread counts.

What runs on the loop is split by role: :class:`~._prefill.PrefillSide` holds and pushes a
prefill's blocks and answers the side channel; :class:`~._decode.DecodeSide` loads a decode's
KV from its prefill ranks (:class:`~._remotes.Remotes`). A ``kv_both`` worker runs both.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

from .._log import get_logger
from .._sync_loop import LoopThread
from .._synchronizer import LayerEvents
from ._config import ConnectorConfig, host_key
from ._control import ControlServer
from ._decode import DecodeSide
from ._endpoint import Endpoint, open_endpoint
from ._handoff import Handoff
from ._layout import KVLayout, derive_layout
from ._meta import LlmddMetadata
from ._prefill import PrefillSide

__all__ = ["WorkerEngine"]

log = get_logger("vllm")

#: how long an idle step (nothing scheduled, loads in flight) waits for a load to finish
_IDLE_WAIT_S = 0.002


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
        # plain asyncio (never uvloop) inside vLLM's process, as before LoopThread served here
        self.loop = LoopThread(name="llmdd-vllm", use_uvloop=False)
        self.layout: KVLayout | None = None
        self._layer_index: dict[str, int] = {}
        #: vLLM's KV tensors, kept referenced while the endpoint has them registered
        self._keep: list[Any] = []
        self.handoff = Handoff()
        # made by register(), used on the loop thread
        self.endpoint: Endpoint | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        self._server: ControlServer | None = None
        # vLLM thread only
        self._send: dict[str, float] = {}  # request id -> lease deadline
        self._step_saves: list[tuple[str, LayerEvents]] = []
        self._idle_step = False
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
        self.loop.submit(self._start(layout, tensors)).result(120)
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
        ep = await open_endpoint(self.cfg, self.cluster_id, self._key, layout, tensors)
        self.endpoint = ep
        self.prefill = PrefillSide(self.cfg, ep, self.handoff)
        self.decode = DecodeSide(
            self.cfg,
            ep,
            self.handoff,
            self._key,
            self._key_file,
            self.cluster_id,
            self.tp_rank,
            self.tp_size,
        )
        server = ControlServer(
            self._key, self._welcome_meta, self.prefill.on_message, self.cfg.transfer_timeout_s
        )
        port = self.cfg.side_channel_port
        await server.start(self.cfg.side_channel_host, port + self.tp_rank if port else 0)
        self._server = server

    @property
    def side_channel_port(self) -> int:
        return self._server.port if self._server is not None else 0

    def _welcome_meta(self) -> dict[str, Any]:
        assert self.endpoint is not None
        listen = self.endpoint.dd.listen_address
        assert listen is not None
        return {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "cluster_id": self.cluster_id,
            "data_host": listen[0],
            "data_port": listen[1],
            "layout": self.endpoint.layout.to_wire(),
        }

    def shutdown(self) -> None:
        """Stop every transfer, close the side channel, finalize the endpoint, end the loop
        (never raises)."""

        async def stop() -> None:
            if self.decode is not None:
                self.decode.close()
            if self.prefill is not None:
                self.prefill.close()
            if self._server is not None:
                await self._server.close()
            if self.endpoint is not None:
                await self.endpoint.dd.finalize()

        with contextlib.suppress(Exception):
            self.loop.submit(stop()).result(30)
        self.loop.stop()

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
            self.loop.call_soon(self._dispatch, meta, events)

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
        """The step's forward pass ended: its pushes learn when (for ``hidden_pct``)."""
        if not self._step_saves:
            return
        ids = [req_id for req_id, _ in self._step_saves]
        self._step_saves = []
        if self.prefill is not None:
            # perf_counter: the clock of TaskStatistics.started
            self.loop.call_soon(self.prefill.forward_ended, ids, time.perf_counter())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(prefill requests whose blocks may be freed, decode requests whose load
        ended)``; hands aborted loads (``finished_req_ids``) to the loop to cancel."""
        loading = self.decode is not None and bool(self.decode.loads)
        if self._idle_step and (loading or self._send):
            # Nothing scheduled: every request waits for its KV, or for its decode to take
            # the blocks. The engine loop would step without pause, spinning a core that the
            # transfer (or a prefill on the same host) needs: wait until a load finishes or
            # blocks are released instead, for at most _IDLE_WAIT_S.
            self.handoff.progress.wait(_IDLE_WAIT_S)
        elif loading:
            # While loads are in flight the engine loop steps without pause, holding the GIL
            # most of the time; the endpoint's loop thread must run to grant pushes and
            # finish pulls. A zero sleep hands it the GIL once per step (no added delay).
            time.sleep(0)
        h = self.handoff
        h.progress.clear()
        now = time.monotonic()
        sending: set[str] = set()
        with h.lock:
            recv = h.recv_done
            h.recv_done = set()
            expired: set[str] = set()
            for req_id in list(self._send):
                if h.released.pop(req_id, None) is not None:
                    sending.add(req_id)
                elif self._send[req_id] <= now:
                    if req_id in h.pushing:
                        # a push still reads these blocks: stop it; its end releases them
                        expired.add(req_id)
                        self._send[req_id] = now + self.cfg.transfer_timeout_s
                        continue
                    sending.add(req_id)
                    log.warning("vllm.lease_expired", request_id=req_id, lease_s=self.cfg.lease_s)
            # releases of requests not (yet) finished here are kept for one lease at most
            while h.released and next(iter(h.released.values())) < now - self.cfg.lease_s:
                h.released.popitem(last=False)
        for req_id in sending:
            del self._send[req_id]
        if (sending or expired) and self.prefill is not None:
            self.loop.call_soon(self.prefill.forget, sending | expired)
        if finished_req_ids and self.decode is not None:
            # aborted loads: checked on the loop, which owns them
            self.loop.call_soon(self.decode.cancel, set(finished_req_ids))
        return sending, recv

    def load_errors(self) -> set[int]:
        return self.handoff.take_load_errors()

    def take_stats(self) -> list[dict[str, Any]]:
        return self.handoff.take_stats()

    # ---------------------------------------------------------------- loop thread

    def _dispatch(self, meta: LlmddMetadata, events: dict[str, LayerEvents]) -> None:
        """The step's work, on the loop: the decode's loads first, then the prefill's."""
        if self.decode is None or self.prefill is None:
            log.warning("vllm.step_before_register", engine_id=self.engine_id)
            return
        self.decode.start(meta.recv, meta.release)
        self.prefill.on_step(meta, events)
