"""The host adapter: DEVICE memory is ordinary host memory; a worker thread is the "stream"."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import numpy as np

from .._errors import raise_if_false
from .._memory import CancelToken, MemoryPool, copy_ranges, resolve_host_memory
from .._options import PoolConfig
from .._planner import Plan, split_plan

__all__ = ["HostAdapter", "create"]


#: Only plans at least this big are worth extra threads.
PARALLEL_MIN_BYTES = 16 << 20


def wants_threads(plan: Plan) -> bool:
    """True when one memmove thread would be slow for most of the plan's bytes.

    glibc's large-copy path avoids "4K aliasing" by falling back to a loop that runs at a third
    of memory bandwidth when ``(dst - src) mod 4096`` is in (0, 1024), which is exactly the
    case of malloc'd numpy arrays (16 bytes into a page) against page-aligned pools. Measured
    here: 3.4-6 GB/s on one thread, 10-11 GB/s on two; for other offsets one thread is as fast
    (11-14 GB/s) and two only add contention.
    """
    if plan.total_bytes < PARALLEL_MIN_BYTES:
        return False
    rel = (plan.dst - plan.src) & np.uint64(4095)
    bad = (rel > 0) & (rel < 1024)
    return int(plan.nbytes[bad].sum(dtype=np.uint64)) * 2 > plan.total_bytes


async def copy_plan(plan: Plan, token: CancelToken, threads: int) -> int:
    """Run ``plan`` with memmove on up to ``threads`` worker threads; returns bytes copied.

    Raises:
        CopyCancelled: ``token`` was cancelled (every thread has stopped when this returns).
    """
    if len(plan) == 0:
        return 0
    parts = split_plan(plan, threads if wants_threads(plan) else 1)
    if len(parts) == 1:
        return await anyio.to_thread.run_sync(copy_ranges, plan.src, plan.dst, plan.nbytes, token)
    done = [0] * len(parts)

    async def one(i: int, p: Plan) -> None:
        done[i] = await anyio.to_thread.run_sync(copy_ranges, p.src, p.dst, p.nbytes, token)

    async with anyio.create_task_group() as tg:
        for i, p in enumerate(parts):
            tg.start_soon(one, i, p)
    return sum(done)


class HostAdapter:
    """Runs on any machine: numpy/ctypes memory, copies in worker threads."""

    name = "host"
    host_addressable = True

    def __init__(self, copy_threads: int = 2) -> None:
        self.copy_threads = copy_threads

    def resolve(self, obj: Any, nbytes: int, name: str) -> tuple[int, Any]:
        return resolve_host_memory(obj, nbytes, name)

    def create_pool(self, config: PoolConfig, name: str) -> MemoryPool:
        return MemoryPool(config, name)

    async def copy(self, plan: Plan, token: CancelToken) -> int:
        return await copy_plan(plan, token, self.copy_threads)

    def close(self) -> None:
        pass


def create(options: dict[str, str]) -> HostAdapter:
    """Raises LLMException(LLM_PARAM_INVALID) for a bad ``llm.CopyThreads``."""
    threads = options.get("llm.CopyThreads", "2")
    raise_if_false(
        threads.isdigit() and 1 <= int(threads) <= 64, f"llm.CopyThreads must be 1..64: {threads!r}"
    )
    return HostAdapter(int(threads))
