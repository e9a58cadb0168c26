"""Per-request transfer statistics in vLLM's KV-connector stats (logs and Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..metrics import DEFAULT_BUCKETS

__all__ = ["PROM_METRICS", "LlmddPromMetrics", "LlmddStats"]

#: the metrics :class:`LlmddPromMetrics` adds to vLLM's ``/metrics`` (name as exposed: help)
PROM_METRICS = {
    "vllm:llmdd_transfers_total": "KV transfers of LlmddConnector that finished well",
    "vllm:llmdd_transfer_bytes_total": "Bytes LlmddConnector's finished KV transfers moved",
    "vllm:llmdd_transfer_failures_total": "KV transfers of LlmddConnector that failed",
    "vllm:llmdd_transfer_seconds": "Transfer time of LlmddConnector's KV transfers",
}


@dataclass
class LlmddStats(KVConnectorStats):
    """``data["transfers"]``: one dict per finished transfer: ``req``, ``role`` (send/recv),
    ``mode``, ``bytes``, ``seconds``, ``gbps`` and, for a layer-wise push, ``hidden_pct`` (the
    share of the transfer's busy time that overlapped the prefill forward) and
    ``after_forward_s`` (how long the push ran after the forward ended).
    ``data["failures"]``: one dict (``role``, ``mode``) per transfer that failed."""

    def __post_init__(self) -> None:
        self.data.setdefault("transfers", [])
        self.data.setdefault("failures", [])

    def reset(self) -> None:
        self.data.clear()
        self.data["transfers"] = []
        self.data["failures"] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data.setdefault("transfers", []).extend(other.data.get("transfers", []))
        self.data.setdefault("failures", []).extend(other.data.get("failures", []))
        return self

    def is_empty(self) -> bool:
        return not self.data.get("transfers") and not self.data.get("failures")

    def reduce(self) -> dict[str, int | float]:
        ts: list[dict[str, Any]] = self.data.get("transfers", [])
        failed = len(self.data.get("failures", []))
        if not ts:
            return {"Num transfers": 0, "Num failed": failed} if failed else {"Num transfers": 0}
        nbytes = sum(int(t["bytes"]) for t in ts)
        secs = [float(t["seconds"]) for t in ts]
        out: dict[str, int | float] = {
            "Num transfers": len(ts),
            "Bytes": nbytes,
            "Avg transfer time (ms)": round(1000 * sum(secs) / len(secs), 3),
            "Avg GB/s": round(sum(float(t["gbps"]) for t in ts) / len(ts), 3),
        }
        hidden = [float(t["hidden_pct"]) for t in ts if "hidden_pct" in t]
        if hidden:
            out["Avg hidden behind forward (%)"] = round(sum(hidden) / len(hidden), 1)
        if failed:
            out["Num failed"] = failed
        return out


class LlmddPromMetrics(KVConnectorPromMetrics):
    """The connector's metrics on vLLM's Prometheus registry (``vllm serve``'s ``/metrics``),
    fed from :class:`LlmddStats` data each time the engine reports its stats. Labels: vLLM's
    own (``model_name``, ``engine``) plus ``role`` (``send``: the prefill's layer-wise push;
    ``recv``: the decode's load) and ``mode`` (``pull`` | ``layerwise``), nothing per request.

    - ``vllm:llmdd_transfers_total``, ``vllm:llmdd_transfer_bytes_total``: finished transfers
      and the bytes they moved;
    - ``vllm:llmdd_transfer_failures_total``: transfers that failed (vLLM recomputes);
    - ``vllm:llmdd_transfer_seconds``: transfer time, a histogram (buckets of
      :data:`llmdd_async.metrics.DEFAULT_BUCKETS`).
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "role", "mode"]
        counter, histogram = metric_types[Counter], metric_types[Histogram]
        self.transfers = counter(
            name="vllm:llmdd_transfers",
            documentation=PROM_METRICS["vllm:llmdd_transfers_total"],
            labelnames=names,
        )
        self.bytes = counter(
            name="vllm:llmdd_transfer_bytes",
            documentation=PROM_METRICS["vllm:llmdd_transfer_bytes_total"],
            labelnames=names,
        )
        self.failures = counter(
            name="vllm:llmdd_transfer_failures",
            documentation=PROM_METRICS["vllm:llmdd_transfer_failures_total"],
            labelnames=names,
        )
        self.seconds = histogram(
            name="vllm:llmdd_transfer_seconds",
            documentation=PROM_METRICS["vllm:llmdd_transfer_seconds"],
            labelnames=names,
            buckets=list(DEFAULT_BUCKETS),
        )

    def _labels(self, engine_idx: int, rec: dict[str, Any]) -> list[object]:
        base = self.per_engine_labelvalues.get(engine_idx, [])
        return [*base, str(rec.get("role", "")), str(rec.get("mode", ""))]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for t in transfer_stats_data.get("transfers", []):
            labels = self._labels(engine_idx, t)
            self.transfers.labels(*labels).inc()
            self.bytes.labels(*labels).inc(int(t.get("bytes", 0)))
            self.seconds.labels(*labels).observe(float(t.get("seconds", 0.0)))
        for f in transfer_stats_data.get("failures", []):
            self.failures.labels(*self._labels(engine_idx, f)).inc()
