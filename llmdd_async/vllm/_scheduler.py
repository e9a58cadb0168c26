"""Scheduler side of :class:`LlmddConnector` (NixlConnector's request flow and params)."""

from __future__ import annotations

import math
from typing import Any

from .._log import get_logger
from ._config import ConnectorConfig
from ._meta import (
    CAPABILITY_KEY,
    LlmddHandshake,
    LlmddMetadata,
    RecvSpec,
    new_capability,
    valid_capability,
)

__all__ = ["SchedulerSide"]

log = get_logger("vllm")

_REMOTE_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    CAPABILITY_KEY,
)


def _first_group(block_ids: Any) -> list[int]:
    if isinstance(block_ids, tuple) or (block_ids and isinstance(block_ids[0], list)):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids or [])


def _release_of(params: dict[str, Any]) -> tuple[str, int, str] | None:
    """Where to tell a prefill that a decode request is done with its blocks, or None when
    the params cannot say (missing or malformed keys: that prefill's lease frees them)."""
    if not all(k in params for k in _REMOTE_KEYS) or not valid_capability(params[CAPABILITY_KEY]):
        return None
    try:
        port = int(params["remote_port"])
    except (TypeError, ValueError):
        return None
    return str(params["remote_host"]), port, str(params[CAPABILITY_KEY])


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, engine_id: str) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        self._ranks: dict[int, LlmddHandshake] = {}
        self._recv: dict[str, RecvSpec] = {}
        self._release: list[tuple[str, int, str]] = []
        self._send: dict[str, tuple[float, list[int]]] = {}
        self._aborted: set[str] = set()
        self._lw_candidates: dict[str, int] = {}  # layer-wise prefill: id -> prompt tokens
        self._saved: set[str] = set()
        #: prefill: each remote-decode request's capability, from its first allocation on
        self._caps: dict[str, str] = {}
        #: prefill: capabilities of requests that finished since the last step's metadata
        self._step_caps: dict[str, str] = {}

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        for rank, m in metadata.items():
            if isinstance(m, LlmddHandshake):
                self._ranks[int(rank)] = m

    @property
    def port(self) -> int:
        if 0 in self._ranks:
            return self._ranks[0].port
        return self.cfg.side_channel_port

    # ------------------------------------------------------------------ decode

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        missing = [k for k in _REMOTE_KEYS if k not in params]
        if CAPABILITY_KEY in params and not valid_capability(params[CAPABILITY_KEY]):
            missing.append(f"{CAPABILITY_KEY} (malformed)")
        if self.cfg.mode == "pull" and not params.get("remote_block_ids"):
            missing.append("remote_block_ids")
        if missing:
            log.warning(
                "vllm.bad_params",
                request_id=request.request_id,
                missing=missing,
                note="computed locally",
            )
            return 0, False
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and request.request_id not in self._caps:
            # The prefill issues the capability; a proxy that must give it to the decode
            # before the prefill answers (concurrent flow) may choose it. One per request.
            cap = params.get(CAPABILITY_KEY)
            if not valid_capability(cap) or cap in self._caps.values():
                cap = new_capability()
            self._caps[request.request_id] = str(cap)
        if params.get("do_remote_decode") and self.cfg.mode == "layerwise":
            self._lw_candidates[request.request_id] = len(request.prompt_token_ids or [])
        if not params.get("do_remote_prefill"):
            return
        if num_external_tokens == 0 and (release := _release_of(params)) is not None:
            # nothing to load here (bad params, or the prompt is cached locally): the prefill
            # frees its blocks now instead of at the end of its lease
            self._release.append(release)
        if num_external_tokens > 0:
            group = blocks.blocks[0]
            skip = sum(1 for b in group if b.block_hash is not None and not b.is_null)
            local = blocks.get_unhashed_block_ids_all_groups()[0]
            self._recv[request.request_id] = RecvSpec(
                local_blocks=list(local),
                skip_blocks=skip,
                params={k: v for k, v in params.items() if k != "do_remote_prefill"},
            )
        params["do_remote_prefill"] = False

    # ------------------------------------------------------------------ both

    def build_connector_meta(self, scheduler_output: Any) -> LlmddMetadata:
        save: dict[str, list[int]] = {}
        if self._lw_candidates:
            for nr in scheduler_output.scheduled_new_reqs:
                n = self._lw_candidates.pop(nr.req_id, None)
                if n is None:
                    continue
                done = nr.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(
                    nr.req_id, 0
                )
                if done >= n:  # the whole prompt runs in this step: save it layer by layer
                    save[nr.req_id] = list(nr.block_ids[0][: math.ceil(n / self.block_size)])
                    self._saved.add(nr.req_id)
            # requests still chunking are pushed when they finish
            self._lw_candidates.clear()
        caps = self._step_caps
        for req_id in save:
            if req_id in self._caps:
                caps[req_id] = self._caps[req_id]
        meta = LlmddMetadata(
            recv=self._recv,
            release=self._release,
            send=self._send,
            aborted=self._aborted,
            save=save,
            caps=caps,
            idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1),
        )
        self._recv, self._release, self._send, self._aborted = {}, [], {}, set()
        self._step_caps = {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        saved = request.request_id in self._saved
        self._saved.discard(request.request_id)
        cap = self._caps.pop(request.request_id, None) or new_capability()
        self._lw_candidates.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # a decode request that ends before loading (aborted): free the prefill's blocks
            if (release := _release_of(params)) is not None:
                self._release.append(release)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        ids = _first_group(block_ids)
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            if saved and ids:  # a layer-wise push may be reading the blocks: fence it first
                self._aborted.add(request.request_id)
                self._send[request.request_id] = (self.cfg.lease_s, ids)
                self._step_caps[request.request_id] = cap
                return True, None
            return False, None
        n = math.ceil(len(request.prompt_token_ids or []) / self.block_size)
        ids = ids[:n] if n else ids
        delay = len(ids) > 0
        if delay:
            self._send[request.request_id] = (self.cfg.lease_s, ids)
            self._step_caps[request.request_id] = cap
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": len(request.prompt_token_ids or []),
            "transfer_mode": self.cfg.mode,
            # the only thing that lets a decode take (or free) these blocks
            CAPABILITY_KEY: cap,
        }
        if len(self._ranks) > 1:
            out["llmdd_ports"] = [self._ranks[r].port for r in sorted(self._ranks)]
        return delay, out
