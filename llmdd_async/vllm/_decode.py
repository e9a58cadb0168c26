"""The decode side of a worker: load each request's KV from its prefill.

``pull`` mode reads the prefill's blocks over the link and then tells it ``done``;
``layerwise`` mode sends the prefill our block ids (``ids``) and waits for ``pushed``. A load
that fails leaves vLLM to recompute (its blocks are reported as load errors); one that is
cancelled (the request was aborted) only ends. Either way, before vLLM may reuse the blocks,
the prefill must have stopped pushing into them, or the link to it goes. Runs on the worker's
loop thread; what vLLM's thread reads goes through :class:`~._handoff.Handoff`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._enums import LLMStatusCode
from .._errors import ControlError, LLMException
from .._log import get_logger
from ._config import ConnectorConfig
from ._control import quietly
from ._endpoint import Endpoint, cache_key
from ._handoff import Handoff, transfer_record
from ._meta import CAPABILITY_KEY, RecvSpec, valid_capability
from ._remotes import Remote, Remotes

__all__ = ["DecodeSide"]

log = get_logger("vllm")


class DecodeSide:
    """The loads in flight, and the prefill ranks they come from."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        endpoint: Endpoint,
        handoff: Handoff,
        key: str,
        key_file: Path | None,
        cluster_id: int,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        self._cfg = cfg
        self._ep = endpoint
        self._handoff = handoff
        self._cluster_id = cluster_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self.remotes = Remotes(cfg, endpoint, key, key_file, tp_size)
        #: request id -> its load (read by vLLM's thread only for "any in flight")
        self.loads: dict[str, asyncio.Task[None]] = {}
        self._bg: set[asyncio.Future[Any]] = set()

    def start(self, recv: dict[str, RecvSpec], release: Iterable[tuple[str, int, str]]) -> None:
        """Start the step's loads (once each), and free the prefill blocks of requests
        aborted before they loaded."""
        for req_id, spec in recv.items():
            if req_id not in self.loads:
                self.loads[req_id] = asyncio.ensure_future(self._load(req_id, spec))
        for host, port, cap in release:
            t = asyncio.ensure_future(self._release_remote(host, port, cap))
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    def cancel(self, req_ids: set[str]) -> None:
        """Cancel the loads of these (finished, so aborted) requests."""
        for req_id in req_ids:
            t = self.loads.get(req_id)
            if t is not None:
                t.cancel()

    def close(self) -> None:
        """Cancel every load and close every side channel (shutdown)."""
        for t in list(self.loads.values()):
            t.cancel()
        self.remotes.close()

    def _address(self, params: dict[str, Any]) -> tuple[str, int]:
        """This rank's prefill side channel: its own port of ``llmdd_ports``, else the
        prefill's base port plus our TP rank."""
        host = str(params["remote_host"])
        ports = params.get("llmdd_ports")
        if isinstance(ports, list) and len(ports) > self._tp_rank:
            return host, int(ports[self._tp_rank])
        return host, int(params["remote_port"]) + self._tp_rank

    async def _load(self, req_id: str, spec: RecvSpec) -> None:
        """Load one request; never raises (a failure is logged and reported to vLLM)."""
        params = spec.params
        remote_req = str(params.get("remote_request_id", ""))
        cap = str(params.get(CAPABILITY_KEY, ""))
        mode = "layerwise" if self._cfg.mode == "layerwise" else "pull"
        layout = self._ep.layout
        r: Remote | None = None
        t0 = time.monotonic()
        ok = cancelled = False
        try:
            if int(params.get("tp_size", 1)) != self._tp_size:
                raise ValueError(f"prefill TP {params.get('tp_size')} != decode TP {self._tp_size}")
            if not valid_capability(cap):
                raise ValueError(f"kv_transfer_params without a valid {CAPABILITY_KEY}")
            host, port = self._address(params)
            r = await self.remotes.get(host, port)
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
                task = self._ep.dd.cache_manager.pull_blocks(
                    cache_key(r.cluster_id),
                    self._ep.cache,
                    src,
                    dst,
                    tensor_num_per_layer=layout.tensors_per_layer,
                )
                await task
                st = task.statistics()
                rec = transfer_record(req_id, "recv", "pull", st.bytes, st.seconds)
            else:
                fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
                r.waiters[cap] = fut
                await r.client.send(
                    {
                        "op": "ids",
                        "req": remote_req,
                        "cap": cap,
                        "cluster": self._cluster_id,
                        "blocks": dst,
                        "skip": spec.skip_blocks,
                        "layout": layout.to_wire(),
                    }
                )
                res = await asyncio.wait_for(fut, self._cfg.lease_s + self._cfg.transfer_timeout_s)
                if not res.get("ok"):
                    raise RuntimeError(f"prefill could not push: {res.get('why')}")
                n = int(res.get("bytes") or len(dst) * layout.block_bytes)
                rec = transfer_record(
                    req_id, "recv", "layerwise", n, float(res.get("seconds") or 0.0)
                )
                rec["wall_s"] = time.monotonic() - t0  # ids sent -> last layer landed
            ok = True
            self._handoff.add_record(rec)
            log.info(
                "vllm.loaded", request_id=req_id, **{k: v for k, v in rec.items() if k != "req"}
            )
        except asyncio.CancelledError:  # the request was aborted: vLLM frees its blocks
            cancelled = True
            log.info("vllm.load_cancelled", request_id=req_id)
        except Exception as e:  # any failure: vLLM recomputes, the engine carries on
            log.warning("vllm.load_failed", request_id=req_id, reason=repr(e))
            self._handoff.add_failure("recv", mode)
            link_down = isinstance(e, LLMException) and e.status_code in (
                LLMStatusCode.LLM_LINK_FAILED,
                LLMStatusCode.LLM_NOT_YET_LINK,
            )
            if r is not None and (link_down or isinstance(e, ControlError)):
                await self.remotes.drop(r)
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
            await self.remotes.drop(r)
        if not ok and not cancelled:
            self._handoff.load_failed(spec.local_blocks)
        if mode == "pull" and r is not None and r.dead is None:
            await quietly(r.client.send({"op": "done", "req": remote_req, "cap": cap}))
        self.loads.pop(req_id, None)
        self._handoff.load_ended(req_id)

    async def _stop_remote_push(self, r: Remote, remote_req: str, cap: str) -> bool:
        """Ask the prefill to stop (or never start) pushing ``remote_req``; True once it
        confirmed that no more bytes come."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        r.waiters[cap] = fut
        try:
            await r.client.send({"op": "cancel", "req": remote_req, "cap": cap})
            await asyncio.wait_for(fut, self._cfg.transfer_timeout_s)
            return True
        except Exception as e:
            log.warning("vllm.cancel_unconfirmed", request_id=remote_req, reason=repr(e))
            return False
        finally:
            r.waiters.pop(cap, None)

    async def _release_remote(self, host: str, port: int, cap: str) -> None:
        """A decode request aborted before loading: free the prefill's blocks now."""
        try:
            r = await self.remotes.get(*self._address({"remote_host": host, "remote_port": port}))
            await r.client.send({"op": "done", "cap": cap})
        except Exception as e:
            log.info("vllm.release_failed", host=host, port=port, reason=repr(e))
