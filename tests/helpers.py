"""Helpers shared by the tests (imported as a plain module)."""

from __future__ import annotations

import json


def pool_json(size: int, page_shift: int = 16) -> str:
    return json.dumps({"memory_size": size, "page_shift": page_shift})


def cm_options(**extra: str) -> dict[str, str]:
    """Cache-manager mode options with a small device and host pool."""
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": pool_json(64 << 20),
        "llm.HostMemPoolConfig": pool_json(16 << 20),
    }
    opts.update(extra)
    return opts
