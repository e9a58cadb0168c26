"""``LlmddConnector``: vLLM's KV connector v1 over llmdd_async."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .._log import get_logger
from ._config import ConnectorConfig, check_vllm_version
from ._logging import route_to_vllm
from ._meta import LlmddHandshake, LlmddMetadata
from ._scheduler import SchedulerSide
from ._stats import LlmddPromMetrics, LlmddStats
from ._worker import WorkerEngine

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )

__all__ = ["LlmddConnector"]

log = get_logger("vllm")


class LlmddConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer for vLLM through llmdd_async.

    Load it with ``kv_connector="LlmddConnector"`` (and
    ``kv_connector_module_path="llmdd_async.vllm"`` unless the ``vllm.general_plugins`` entry
    point registered it). ``kv_connector_extra_config``: ``mode`` (``pull`` | ``layerwise``),
    ``side_channel_host``, ``side_channel_port`` (0: any free), ``transport``, ``auth_key``
    (or ``$LLMDD_AUTH_KEY``), ``lease_s``, ``transfer_timeout_s``. See README, "vLLM".
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        check_vllm_version(vllm.__version__)
        route_to_vllm()  # our events in vLLM's logs (vllm serve), at vLLM's level
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg, warnings = ConnectorConfig.parse(ktc.kv_connector_extra_config)
        for w in warnings:
            log.warning("vllm.config", detail=w)
        self.engine_id = str(ktc.engine_id)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerEngine | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, vllm_config, self.engine_id)
            if ktc.kv_load_failure_policy != "recompute":
                log.warning(
                    "vllm.config",
                    detail="kv_load_failure_policy is 'fail': a failed load ends the request "
                    "with an error; set it to 'recompute' to have vLLM recompute instead",
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            pc = vllm_config.parallel_config
            self._worker = WorkerEngine(
                self.cfg,
                self.engine_id,
                int(get_tensor_model_parallel_rank()),
                int(pc.tensor_parallel_size),
            )
            self._block_size = int(vllm_config.cache_config.block_size)
        log.info("vllm.connector", role=role.name, engine_id=self.engine_id, config=repr(self.cfg))

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._block_size)

    def get_handshake_metadata(self) -> LlmddHandshake | None:
        w = self._worker
        if w is None or w.layout is None:
            return None
        return LlmddHandshake(
            self.cfg.side_channel_host, w.side_channel_port, w.cluster_id, w.tp_rank
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Bound before the forward pass (vLLM 0.32 calls start_load_kv after it when no load
        # is synchronous): hand the step's work over here, so layer-wise saves see this
        # forward and loads start as early as possible.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, LlmddMetadata):
            self._worker.on_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # started from bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request (load_async); nothing to wait for per layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_of_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        recs = self._worker.take_stats()
        if not recs:
            return None
        return LlmddStats(
            data={
                "transfers": [r for r in recs if not r.get("failed")],
                "failures": [r for r in recs if r.get("failed")],
            }
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return LlmddStats(data=dict(data or {"transfers": []}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """``vllm:llmdd_*`` metrics on vLLM's ``/metrics`` (see :class:`LlmddPromMetrics`)."""
        return LlmddPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._sched is not None:
            self._sched.set_handshake(metadata)
