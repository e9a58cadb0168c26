"""Misuses a typed program must be told about: each line's ``type: ignore`` must be needed
(mypy --strict --warn-unused-ignores fails on one that is not, so each line is a test)."""

from __future__ import annotations

import llmdd_async as dd


async def misuses(d: dd.LLMDataDist, cache: dd.Cache) -> None:
    cm = d.cache_manager
    key = dd.BlocksCacheKey(1, 0)
    cm.pull_blocks(key, cache, ["a"], [1])  # type: ignore[list-item]
    cm.pull_blocks(key, cache, [0], [1], made_up=True)  # type: ignore[call-arg]
    cm.pull_blocks(key, cache, [0], [1], src_layer_range=3)  # type: ignore[arg-type]
    cm.pull_cache(key, cache)  # type: ignore[arg-type]
    cm.pull_cache(dd.CacheKey(1, 2), cache, "0")  # type: ignore[arg-type]
    task = cm.pull_blocks(key, cache, [0], [1])
    task.statistics().no_such_field  # type: ignore[attr-defined]
    d.link_statistics(1).transferz  # type: ignore[attr-defined]
    d.link_statistics("1")  # type: ignore[arg-type]
    dd.CacheDesc("2", [4], dd.DataType.DT_UINT8)  # type: ignore[arg-type]
    dd.LayerEvents().layer_ready("1")  # type: ignore[arg-type]
    address: tuple[str, int] = d.listen_address  # type: ignore[assignment]
    print(address)
    await cm.push_blocks(key, cache, [0], [1], size=4)  # type: ignore[call-arg]
