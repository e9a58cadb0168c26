"""Planning time of a 4096-block x 80-tensor request, and local copy speed against memcpy.

Run: ``python benchmarks/plan.py [--json PATH]``. Targets (benchmark, not test): planning under
50 ms; a local contiguous copy at >= 80 % of ``numpy.copyto`` of the same bytes, measured in the
same run.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import numpy as np
from _common import median_time, memcpy_gbps, parser, positive_int, print_table, write_json

import llmdd_async as dd
from llmdd_async._planner import Layout, plan_blocks

BLOCKS, TENSORS, BLOCK_BYTES = 4096, 80, 1024
COPY_BYTES = 256 << 20


def bench_planning(repeat: int) -> list[dict[str, object]]:
    tb = BLOCKS * BLOCK_BYTES
    src = Layout.of([0x10000 + i * tb for i in range(TENSORS)], tb, BLOCKS, True)
    dst = Layout.of([0x40000000 + i * (tb + 4096) for i in range(TENSORS)], tb, BLOCKS, True)
    idx = np.arange(TENSORS)
    rows = []
    for name, src_blocks in (
        ("contiguous", list(range(BLOCKS))),
        ("shuffled", np.random.default_rng(0).permutation(BLOCKS).tolist()),
    ):
        dst_blocks = list(range(BLOCKS))
        holder: dict[str, object] = {}

        def run(sb=src_blocks, db=dst_blocks, h=holder) -> None:
            # From Python lists, as clients pass them: conversion is part of the cost.
            h["plan"] = plan_blocks(
                src, dst, idx, idx, np.asarray(sb, np.int64), np.asarray(db, np.int64)
            )

        seconds = median_time(run, repeat)
        plan = holder["plan"]
        rows.append(
            {
                "case": f"plan {BLOCKS}x{TENSORS} {name}",
                "ms": seconds * 1e3,
                "descriptors": len(plan),  # type: ignore[arg-type]
                "target_ms": 50.0,
                "ok": seconds * 1e3 < 50,
            }
        )
    return rows


async def bench_copies(repeat: int, memcpy: float) -> list[dict[str, object]]:
    pool = json.dumps({"memory_size": 3 * COPY_BYTES + (64 << 20), "page_shift": 21})
    opts = {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": pool}
    rows = []
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as d:
        cm = d.cache_manager
        nblocks, bb = 4096, COPY_BYTES // 4096
        desc = dd.CacheDesc(1, [1, COPY_BYTES], dd.DataType.DT_UINT8)
        a, b = cm.allocate_cache(desc), cm.allocate_cache(desc)
        a.tensors[0][...] = 1
        b.tensors[0][...] = 0  # touch every page before timing
        host = np.zeros((nblocks, bb), np.uint8)
        dev = cm.allocate_blocks_cache(dd.CacheDesc(1, [nblocks, bb], dd.DataType.DT_UINT8))
        dev.tensors[0][...] = 2
        cpu = dd.Cache.create_cpu_cache(
            dd.CacheDesc(1, [nblocks, bb], dd.DataType.DT_UINT8, dd.Placement.HOST),
            [host.ctypes.data],
        )
        contiguous = {i: i for i in range(nblocks)}
        perm = np.random.default_rng(1).permutation(nblocks).tolist()
        shuffled = dict(zip(range(nblocks), perm, strict=True))
        dev_view, a_view, b_view = dev.tensors[0], a.tensors[0], b.tensors[0]

        def by_hand_blocks(mapping: dict[int, int]) -> None:
            for s, t in mapping.items():
                np.copyto(host[t], dev_view[s])

        cases = [
            (
                "copy_cache 256 MiB contiguous",
                lambda: cm.copy_cache(b, a),
                lambda: np.copyto(b_view, a_view),
            ),
            (
                "swap_blocks 4096x64KiB contiguous",
                lambda: cm.swap_blocks(dev, cpu, contiguous),
                lambda: np.copyto(host, dev_view),
            ),
            (
                "swap_blocks 4096x64KiB shuffled",
                lambda: cm.swap_blocks(dev, cpu, shuffled),
                lambda: by_hand_blocks(shuffled),
            ),
        ]
        for name, start, by_hand in cases:
            await start()
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                task = start()
                await task
                times.append(time.perf_counter() - t0)
            times.sort()
            gbps = COPY_BYTES / times[len(times) // 2] / 1e9
            # numpy.copyto over the very same buffers: the like-for-like limit (same page
            # offsets, so the same glibc copy path), next to the best-case memcpy figure.
            same = COPY_BYTES / median_time(by_hand, repeat) / 1e9
            rows.append(
                {
                    "case": name,
                    "GB/s": gbps,
                    "copyto same buffers": same,
                    "ratio": gbps / same,
                    "memcpy GB/s": memcpy,
                    "descriptors": task.statistics().descriptors,
                    "target": 0.8 if "contiguous" in name else None,
                    "ok": gbps / same >= 0.8 if "contiguous" in name else None,
                }
            )
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "plan")
    p.add_argument(
        "--repeat", type=positive_int, default=7, help="timed runs per case (median reported)"
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    plan_rows = bench_planning(args.repeat)
    memcpy = memcpy_gbps(COPY_BYTES, args.repeat)
    copy_rows = anyio.run(bench_copies, args.repeat, memcpy)
    print_table("Planning", plan_rows, ["case", "ms", "descriptors", "target_ms", "ok"])
    print_table(
        "Local copies (ratio = GB/s / numpy.copyto of the same buffers, same run)",
        copy_rows,
        [
            "case",
            "GB/s",
            "copyto same buffers",
            "ratio",
            "memcpy GB/s",
            "descriptors",
            "target",
            "ok",
        ],
    )
    out = write_json("plan", {"planning": plan_rows, "copies": copy_rows}, args.json)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
