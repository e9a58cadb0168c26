"""What the worker's loop thread hands back to vLLM's model-runner thread, under one lock.

The loop thread finishes loads, fences pushes and learns which prefill blocks may be freed;
vLLM's thread collects that in ``get_finished``, ``get_block_ids_with_load_errors`` and
``get_kv_connector_stats``. Nothing here blocks for longer than a set operation.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

__all__ = ["Handoff", "transfer_record"]

#: released prefill requests remembered at most (a request freed before vLLM asked for it)
_RELEASED_MAX = 65536


class Handoff:
    """The sets both threads touch; every access is under :attr:`lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: decode requests whose load ended (well or not): vLLM may schedule or recompute them
        self.recv_done: set[str] = set()
        #: decode blocks a failed load left unfilled
        self.load_errors: set[int] = set()
        #: prefill requests whose blocks a push is reading (not freed before it is fenced)
        self.pushing: set[str] = set()
        #: prefill requests whose blocks may be freed now -> when that was learnt
        self.released: OrderedDict[str, float] = OrderedDict()
        #: finished transfers' records (:func:`transfer_record`), for vLLM's stats
        self.stats: list[dict[str, Any]] = []
        #: set by the loop thread when a load finished or blocks were released (wakes an
        #: idle step's wait)
        self.progress = threading.Event()

    def release(self, req_id: str) -> None:
        """The prefill request's blocks may be freed (its decode took them, or gave up)."""
        with self.lock:
            self.released[req_id] = time.monotonic()
            self.released.move_to_end(req_id)
            while len(self.released) > _RELEASED_MAX:
                self.released.popitem(last=False)
        self.progress.set()

    def load_failed(self, blocks: list[int]) -> None:
        """A decode load failed: vLLM recomputes what ``blocks`` should have held."""
        with self.lock:
            self.load_errors.update(blocks)

    def load_ended(self, req_id: str) -> None:
        """The decode request's load ended (well or not): vLLM may go on with it."""
        with self.lock:
            self.recv_done.add(req_id)
        self.progress.set()

    def add_record(self, rec: dict[str, Any]) -> None:
        with self.lock:
            self.stats.append(rec)

    def add_failure(self, role: str, mode: str) -> None:
        """A transfer failed (not cancelled): counted in vLLM's stats as a failure."""
        self.add_record({"role": role, "mode": mode, "failed": True})

    def take_load_errors(self) -> set[int]:
        with self.lock:
            out = self.load_errors
            self.load_errors = set()
        return out

    def take_stats(self) -> list[dict[str, Any]]:
        with self.lock:
            out = self.stats
            self.stats = []
        return out


def transfer_record(req: str, role: str, mode: str, nbytes: int, seconds: float) -> dict[str, Any]:
    """One finished transfer as :class:`~._stats.LlmddStats` reports it."""
    return {
        "req": req,
        "role": role,
        "mode": mode,
        "bytes": int(nbytes),
        "seconds": float(seconds),
        "gbps": (nbytes / seconds / 1e9) if seconds > 0 else 0.0,
    }
