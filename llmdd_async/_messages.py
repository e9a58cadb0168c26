"""What the frames of a link mean, above the sans-IO framer of :mod:`._protocol`.

Readers of a peer's words: a frame's status, the published table's remote-accessible
regions. Malformed fields read as the safest answer (a failure, no regions).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._enums import LLMStatusCode
from ._protocol import Message

__all__ = ["regions_of_table", "wire_status"]


def wire_status(msg: Message) -> LLMStatusCode:
    """The ``status`` field of a peer's frame; missing, malformed or unknown is LLM_FAILED."""
    raw = msg.fields.get("status")
    return LLMStatusCode.from_wire(raw) if type(raw) is int else LLMStatusCode.LLM_FAILED


def _no_regions() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)


def regions_of_table(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``(starts, ends)`` of the tensors of the remote-accessible caches a peer's table
    (or proof message) lists; malformed entries count as nothing."""
    starts: list[int] = []
    ends: list[int] = []
    caches = table.get("caches") if isinstance(table, dict) else None
    for c in caches if isinstance(caches, list) else []:
        if not isinstance(c, dict) or c.get("remote_accessible") is not True:
            continue
        size, addrs = c.get("tensor_bytes"), c.get("addrs")
        if not isinstance(size, int) or not isinstance(addrs, list):
            continue
        for a in addrs:
            if isinstance(a, int) and a > 0 and size > 0 and a + size < 2**64:
                starts.append(a)
                ends.append(a + size)
    if not starts:
        return _no_regions()
    order = np.argsort(np.array(starts, dtype=np.uint64), kind="stable")
    return (
        np.array(starts, dtype=np.uint64)[order],
        np.array(ends, dtype=np.uint64)[order],
    )
