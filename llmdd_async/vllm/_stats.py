"""Per-request transfer statistics in vLLM's KV-connector stats (logs and Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["LlmddStats"]


@dataclass
class LlmddStats(KVConnectorStats):
    """``data["transfers"]``: one dict per finished transfer: ``req``, ``role`` (send/recv),
    ``mode``, ``bytes``, ``seconds``, ``gbps`` and, for a layer-wise push, ``hidden_pct`` (the
    share of the transfer's busy time that overlapped the prefill forward) and
    ``after_forward_s`` (how long the push ran after the forward ended)."""

    def __post_init__(self) -> None:
        self.data.setdefault("transfers", [])

    def reset(self) -> None:
        self.data.clear()
        self.data["transfers"] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data.setdefault("transfers", []).extend(other.data.get("transfers", []))
        return self

    def is_empty(self) -> bool:
        return not self.data.get("transfers")

    def reduce(self) -> dict[str, int | float]:
        ts: list[dict[str, Any]] = self.data.get("transfers", [])
        if not ts:
            return {"Num transfers": 0}
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
        return out
