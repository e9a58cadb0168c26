"""Prometheus metrics: counted from real transfers and links of real endpoints, read back by
scraping the HTTP endpoint ``PrometheusMetrics.serve`` starts on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import anyio
import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async.testing import DEFAULT_OPTIONS, linked_pair

prom = pytest.importorskip("prometheus_client", reason="prometheus_client (the metrics extra)")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from llmdd_async.metrics import PrometheusMetrics  # noqa: E402

pytestmark = pytest.mark.anyio


def _scrape(address: tuple[str, int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_transfers_and_links_are_counted_and_scraped() -> None:
    metrics = PrometheusMetrics(prom.CollectorRegistry())
    address = metrics.serve(0, "127.0.0.1")
    opts = {**DEFAULT_OPTIONS, "llm.Transport": "tcp"}
    async with linked_pair(opts) as (prompt, decoder):
        # Watched after the link came up: links count from their next change on.
        metrics.watch(decoder)
        desc = dd.CacheDesc(1, [8, 4096], dd.DataType.DT_UINT8)
        src = np.full((8, 4096), 3, np.uint8)
        prompt.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
        cache = decoder.cache_manager.register_blocks_cache(desc, [np.zeros((8, 4096), np.uint8)])
        for s, d in [(0, 1), (2, 3), (4, 5)]:
            await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [s], [d])
        with pytest.raises(dd.LLMException):  # no such blocks key on the prompt
            await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 9), cache, [0], [0])
        got = await anyio.to_thread.run_sync(_scrape, address)
        ok = ("llmdd_transfers_total", (("op", "pull_blocks"), ("status", "LLM_SUCCESS")))
        assert got[ok] == 3
        missing = (
            "llmdd_transfers_total",
            (("op", "pull_blocks"), ("status", "LLM_KV_CACHE_NOT_EXIST")),
        )
        assert got[missing] == 1
        assert got[("llmdd_transfer_bytes_total", (("op", "pull_blocks"),))] == 3 * 4096
        assert got[("llmdd_transfer_seconds_count", (("op", "pull_blocks"),))] == 4
        assert got[("llmdd_transfers_in_flight", (("op", "pull_blocks"),))] == 0
        # A link that comes up while watched is counted, and counted out when it goes down.
        metrics.watch(prompt)
        code, _ = await decoder.unlink_clusters([_cluster(prompt)], 3000)
        assert code == dd.LLMStatusCode.LLM_SUCCESS
        code, _ = await decoder.link_clusters([_cluster(prompt)], 3000)
        assert code == dd.LLMStatusCode.LLM_SUCCESS
        got = await anyio.to_thread.run_sync(_scrape, address)
        assert got[("llmdd_links_up", (("transport", "tcp"),))] == 2  # both ends of the link
        assert got[("llmdd_link_changes_total", (("event", "up"), ("transport", "tcp")))] == 2
        await decoder.unlink_clusters([_cluster(prompt)], 3000)
        up = ("llmdd_links_up", (("transport", "tcp"),))
        with anyio.fail_after(10):  # the prompt hears of the unlink
            while (got := await anyio.to_thread.run_sync(_scrape, address))[up] != 0:
                await anyio.sleep(0.05)
        assert got[("llmdd_link_changes_total", (("event", "down"), ("transport", "tcp")))] == 2


def _cluster(prompt: dd.LLMDataDist) -> dd.LLMClusterInfo:
    address = prompt.listen_address
    assert address is not None
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = prompt.cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*address)
    return info


def test_one_set_of_metrics_per_registry() -> None:
    registry = prom.CollectorRegistry()
    PrometheusMetrics(registry)
    with pytest.raises(ValueError):
        PrometheusMetrics(registry)
