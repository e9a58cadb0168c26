"""Prometheus metrics of endpoints (the ``metrics`` extra: ``prometheus_client``).

::

    from prometheus_client import CollectorRegistry
    from llmdd_async.metrics import PrometheusMetrics

    metrics = PrometheusMetrics(CollectorRegistry())  # or the default registry
    metrics.watch(datadist)                           # before or after its init
    host, port = metrics.serve(9400)                  # or expose ``metrics.registry`` yourself

Metrics (labels of low cardinality only: the operation, the status code's name, the
transport):

- ``llmdd_transfers_total{op, status}``: transfers that ended, by how;
- ``llmdd_transfer_bytes_total{op}``: bytes they moved;
- ``llmdd_transfer_seconds{op}``: their wall time, a histogram;
- ``llmdd_transfers_in_flight{op}``: transfers running now;
- ``llmdd_links_up{transport}``: links up now; ``llmdd_link_changes_total{transport, event}``:
  links that came up or went down.

``op`` is the ``CacheManager`` method (``pull_blocks``, ``push_blocks``, ``pull_cache``,
``transfer_cache_async``, ...). Several endpoints may share one ``PrometheusMetrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._enums import LLMStatusCode

if TYPE_CHECKING:
    from ._datadist import LLMDataDist

__all__ = ["DEFAULT_BUCKETS", "PrometheusMetrics"]

#: seconds: from a small same-host pull (tens of µs) to a bulk transfer (seconds)
DEFAULT_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


class PrometheusMetrics:
    """Counters, a histogram and gauges of the endpoints it watches, on ``registry``
    (``prometheus_client``'s default registry when None).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message names the extra).
        ValueError: metrics of these names are already on ``registry`` (make one
            ``PrometheusMetrics`` per registry and watch every endpoint with it).
    """

    def __init__(
        self,
        registry: Any = None,
        namespace: str = "llmdd",
        buckets: tuple[float, ...] = DEFAULT_BUCKETS,
    ) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError(
                "llmdd_async.metrics needs prometheus_client: pip install 'llmdd-async[metrics]'"
            ) from exc
        self.registry = prom.REGISTRY if registry is None else registry
        reg, ns = self.registry, namespace
        self.transfers = prom.Counter(
            "transfers", "Transfers that ended", ["op", "status"], namespace=ns, registry=reg
        )
        self.bytes = prom.Counter(
            "transfer_bytes", "Bytes transfers moved", ["op"], namespace=ns, registry=reg
        )
        self.seconds = prom.Histogram(
            "transfer_seconds",
            "Wall time of transfers",
            ["op"],
            namespace=ns,
            registry=reg,
            buckets=buckets,
        )
        self.in_flight = prom.Gauge(
            "transfers_in_flight", "Transfers running", ["op"], namespace=ns, registry=reg
        )
        self.links = prom.Gauge("links_up", "Links up", ["transport"], namespace=ns, registry=reg)
        self.link_changes = prom.Counter(
            "link_changes",
            "Links that came up or went down",
            ["transport", "event"],
            namespace=ns,
            registry=reg,
        )
        self._up: dict[tuple[int, int], str] = {}  # (observer scope, peer) -> transport

    def watch(self, datadist: LLMDataDist) -> None:
        """Count the transfers and links of ``datadist`` from now on (its init included)."""
        datadist._observers.add(_Watched(self, id(datadist)))

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> tuple[str, int]:
        """Expose :attr:`registry` over HTTP (``/metrics``) on exactly ``addr:port``, in a
        daemon thread of ``prometheus_client``; returns the address it listens on (port 0:
        a free one).

        Raises:
            OSError: the address cannot be bound.
        """
        import prometheus_client as prom

        server, _thread = prom.start_http_server(port, addr, registry=self.registry)
        host, bound = server.server_address[:2]
        return str(host), int(bound)


class _Watched:
    """The observer of one endpoint (a link is told apart by its endpoint and its peer)."""

    def __init__(self, metrics: PrometheusMetrics, scope: int) -> None:
        self.m = metrics
        self.scope = scope

    def transfer_started(self, kind: str) -> None:
        self.m.in_flight.labels(kind).inc()

    def transfer_ended(self, kind: str, status: LLMStatusCode, nbytes: int, seconds: float) -> None:
        m = self.m
        m.in_flight.labels(kind).dec()
        m.transfers.labels(kind, status.name).inc()
        if nbytes:
            m.bytes.labels(kind).inc(nbytes)
        m.seconds.labels(kind).observe(seconds)

    def link_changed(self, peer_cluster_id: int, transport: str, up: bool) -> None:
        m, key = self.m, (self.scope, peer_cluster_id)
        if up:
            if key in m._up:  # replaced without a down (it was down already)
                m.links.labels(m._up.pop(key)).dec()
            m._up[key] = transport
            m.links.labels(transport).inc()
            m.link_changes.labels(transport, "up").inc()
        elif key in m._up:
            m.links.labels(m._up.pop(key)).dec()
            m.link_changes.labels(transport, "down").inc()
