"""The host adapter: DEVICE memory is ordinary host memory; a worker thread is the "stream"."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import numpy as np

from .._errors import raise_if_false
from .._memory import (
    INLINE_RANGES,
    CancelToken,
    MemoryPool,
    PoolConfig,
    copy_inline,
    copy_ranges,
    resolve_host_memory,
    run_parts,
)
from .._planner import Plan, split_plan

__all__ = ["HostAdapter", "create"]


#: Plans up to this size are copied on the calling thread (the event loop): a MiB is 100-200
#: us of memmove, far below the loop's 50 ms bound, and a thread hop per request costs more
#: than it saves when many are in flight (64 one-sided 1 MiB pulls: about 1900 -> 2400 req/s
#: when they stopped hopping; the bound was 256 KiB).
INLINE_MAX_BYTES = 1 << 20
#: Only plans at least this big are worth extra threads.
PARALLEL_MIN_BYTES = 16 << 20
#: Copies this big run with non-temporal stores on one thread at full speed.
_HUGE_COPY = 64 << 20


def wants_threads(plan: Plan) -> bool:
    """True when one memmove thread would stay well below the memory bandwidth.

    Measured here (machine_limits.md and this module's history): one thread copies 64 KiB
    blocks at ~7 GB/s and two at ~10 GB/s, while a single huge memmove reaches ~12 GB/s on one
    thread (glibc switches to non-temporal stores above ~100 MiB) and gains nothing from two.
    glibc's "4K aliasing" fallback also runs at a third of the bandwidth when
    ``(dst - src) mod 4096`` is in (0, 1024) -- malloc'd numpy arrays against page-aligned
    pools -- and two threads recover most of it.
    """
    if plan.total_bytes < PARALLEL_MIN_BYTES:
        return False
    if int(plan.nbytes.max()) < _HUGE_COPY:
        return True
    rel = (plan.dst - plan.src) & np.uint64(4095)
    bad = (rel > 0) & (rel < 1024)
    return int(plan.nbytes[bad].sum(dtype=np.uint64)) * 2 > plan.total_bytes


async def copy_plan(
    plan: Plan, token: CancelToken, threads: int, limiter: anyio.CapacityLimiter | None = None
) -> int:
    """Run ``plan`` with memmove on up to ``threads`` worker threads (drawn from ``limiter``,
    default anyio's); returns bytes copied.

    Raises:
        CopyCancelled: ``token`` was cancelled (every thread has stopped when this returns).
    """
    if len(plan) == 0:
        return 0
    if plan.total_bytes <= INLINE_MAX_BYTES and len(plan) <= INLINE_RANGES:
        # A thread hop costs more than this copy (tens of microseconds at most).
        return copy_inline(plan.src.tolist(), plan.dst.tolist(), plan.nbytes.tolist(), token)
    parts = split_plan(plan, threads if wants_threads(plan) else 1)
    return await run_parts(
        [functools.partial(copy_ranges, p.src, p.dst, p.nbytes, token) for p in parts], limiter
    )


class HostAdapter:
    """Runs on any machine: numpy/ctypes memory, copies in worker threads."""

    name = "host"
    host_addressable = True

    def __init__(self, copy_threads: int = 2) -> None:
        self.copy_threads = copy_threads
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The threads copies run on: as many as ``llm.CopyThreads``. Many concurrent copies
        then queue instead of thrashing the cores (memcpy never waits on a peer)."""
        if self._limiter is None:  # made on first use: it needs the running loop's backend
            self._limiter = anyio.CapacityLimiter(self.copy_threads)
        return self._limiter

    def resolve(self, obj: Any, nbytes: int, name: str) -> tuple[int, Any]:
        return resolve_host_memory(obj, nbytes, name)

    def create_pool(self, config: PoolConfig, name: str) -> MemoryPool:
        return MemoryPool(config, name)

    async def copy(self, plan: Plan, token: CancelToken) -> int:
        return await copy_plan(plan, token, self.copy_threads, self.limiter)

    def owns(self, addrs: Any) -> bool:
        return False

    def close(self) -> None:
        pass


def create(options: dict[str, str]) -> HostAdapter:
    """Raises LLMException(LLM_PARAM_INVALID) for a bad ``llm.CopyThreads``."""
    threads = options.get("llm.CopyThreads", "2")
    raise_if_false(
        threads.isdigit() and 1 <= int(threads) <= 64, f"llm.CopyThreads must be 1..64: {threads!r}"
    )
    return HostAdapter(int(threads))
