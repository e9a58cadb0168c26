"""A task's log events name the task and its peer, so one request can be followed in logs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import library_logs_enabled

import llmdd_async as dd
from llmdd_async.testing import DEFAULT_OPTIONS, linked_pair

pytestmark = pytest.mark.anyio


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(name + " ")]


async def test_transfer_events_carry_the_task_id_and_the_peer_cluster(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    library_logs_enabled(monkeypatch)
    async with linked_pair({**DEFAULT_OPTIONS, "llm.Transport": "tcp"}) as (prompt, decoder):
        desc = dd.CacheDesc(1, [4, 1024], dd.DataType.DT_UINT8)
        src = np.arange(4 * 1024, dtype=np.uint32).astype(np.uint8).reshape(4, 1024)
        prompt.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
        cache = decoder.cache_manager.register_blocks_cache(desc, [np.zeros_like(src)])
        key = dd.BlocksCacheKey(1, 0)
        with caplog.at_level(logging.DEBUG, logger="llmdd_async"):
            ok = decoder.cache_manager.pull_blocks(key, cache, [0, 1], [2, 3])
            await ok
            bad = decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 7), cache, [0], [0])
            with pytest.raises(dd.LLMException):
                await bad
        assert ok.task_id != bad.task_id
        started = _events(caplog, "transfer.started")
        complete = _events(caplog, "transfer.complete")
        failed = _events(caplog, "transfer.failed")
        for records, task in ((started, ok), (complete, ok), (failed, bad)):
            mine = [r for r in records if getattr(r, "task_id", None) == task.task_id]
            assert len(mine) == 1, [r.getMessage() for r in records]
            record = mine[0]
            assert getattr(record, "peer_cluster_id", None) == 1  # the prompt's cluster id
            assert f"task_id={task.task_id}" in record.getMessage()
            assert "peer_cluster_id=1" in record.getMessage()
