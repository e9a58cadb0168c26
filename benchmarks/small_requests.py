"""One small request at a time, through the public API, against a peer process (issue 21).

Each case pulls (or pushes) ``--blocks`` blocks of a blocks cache between this process and a
peer process, one request after the other, the blocks of every request drawn scattered over a
pool of ``--pool`` blocks (source and destination independent, as a serving engine's
allocators hand them out), over ``llm.Transport=tcp`` or ``same-host``, in remote-accessible
mode unless the case says ``default``. The cases differ in what makes a request cost more than
the easy case: more blocks, more tensors (a KV block is a range per tensor), a keyed link
(``llm.AuthKey``), default mode (the target grants each pull). Per case and
loop: p50/p99 latency, the CPU time one request costs this process and the peer's, and the
floor: a raw blocking request/response of the same size between two processes, measured in
the same run (``ratio`` = p50 over it).

With ``--timeline`` each case runs its requests a second time with every socket call of both
processes stamped (``llmdd_async.bench.timeline``), and a second table splits a request's wall
time into phases: this process's work before its send, the send, the peer's wake-up, the
peer's work, its send, our wake-up, and our work after our first read (medians, µs). A
one-sided same-host pull sends nothing and is not split; a same-host default-mode one's
``receive`` holds the grant's checks, the copy and the DONE; a reply of many frames
(``tcp-16``) overlaps its phases.

Run: ``python benchmarks/small_requests.py [--loops uvloop,asyncio,trio] [--cases ...]
[--requests N] [--repeat N] [--timeline] [--json PATH]`` (about 10 s per case, loop and
round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from _common import csv_of, parser, positive_int, print_table, write_json

import llmdd_async as dd
from llmdd_async._childproc import run_on_loop
from llmdd_async.bench.limits import raw_rpc_us
from llmdd_async.bench.peers import wave_blocks
from llmdd_async.bench.timeline import PHASES, SocketStamps, phases
from llmdd_async.testing import PeerProcess, encode_key

#: name -> (transport, op, blocks per request, tensors, block KiB (all tensors), keyed,
#: remote-accessible)
CASES: dict[str, tuple[str, str, int, int, int, bool, bool]] = {
    "tcp-1": ("tcp", "pull", 1, 2, 64, False, True),
    "tcp-16": ("tcp", "pull", 16, 2, 64, False, True),
    "tcp-160-tensors": ("tcp", "pull", 1, 160, 640, False, True),
    "tcp-keyed": ("tcp", "pull", 1, 2, 64, True, True),
    "tcp-push": ("tcp", "push", 1, 2, 64, False, True),
    "same-host-1": ("same-host", "pull", 1, 2, 64, False, True),
    "tcp-default-1": ("tcp", "pull", 1, 2, 64, False, False),
    "same-host-default-1": ("same-host", "pull", 1, 2, 64, False, False),
}


async def _case(name: str, loop: str, requests: int, pool: int, timeline: bool) -> dict[str, Any]:
    transport, op, per, tensors, kib, keyed, accessible = CASES[name]
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1" if accessible else "0",
        "llm.Transport": transport,
        "llm.SyncKvCacheWaitTime": "60000",
    }
    if keyed:
        opts["llm.AuthKey"] = "small-requests-benchmark-key"
    block = kib << 10
    shape = [pool, block // tensors]
    peer_opts = {
        **opts,
        "llm.listenIpInfo": "127.0.0.1:0",
        "llm.MemPoolConfig": json.dumps({"memory_size": pool * block + (16 << 20)}),
    }
    key = dd.BlocksCacheKey(1, 0)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, peer_opts, loop, fork=False) as peer:
        await peer.request(
            "alloc", kind="blocks", num_tensors=tensors, shape=shape, blocks_key=encode_key(key)
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            code, _ = await d.link_clusters([peer.cluster_info()], 10000)
            if code != dd.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"could not link to the peer: {code!r}")
            cm = d.cache_manager
            arrays = [np.full(shape, 1, np.uint8) for _ in range(tensors)]  # every page written
            desc = dd.CacheDesc(tensors, shape, dd.DataType.DT_UINT8)
            cache = cm.register_blocks_cache(desc, arrays)
            move = cm.pull_blocks if op == "pull" else cm.push_blocks
            rng = np.random.default_rng(0)
            for src, dst in wave_blocks(rng, pool, per, min(200, pool // per)):  # warm-up
                await move(key, cache, src, dst)
            lists = [wave_blocks(rng, pool, per, 1)[0] for _ in range(requests)]
            lat = []
            peer_cpu = await peer.request("cpu_seconds")
            cpu = time.process_time()
            for src, dst in lists:
                t0 = time.perf_counter()
                await move(key, cache, src, dst)
                lat.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu
            peer_cpu = await peer.request("cpu_seconds") - peer_cpu
            split = await _timeline(peer, move, key, cache, lists) if timeline else None
    lat.sort()
    n = len(lat)
    return {
        "case": name,
        "loop": loop,
        "transport": transport,
        "op": op,
        "blocks": per,
        "tensors": tensors,
        "bytes": per * block,
        "keyed": keyed,
        "remote_accessible": accessible,
        "requests": n,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[min(n - 1, int(n * 0.99))] * 1e6,
        "cpu_us": cpu / n * 1e6,
        "peer_cpu_us": peer_cpu / n * 1e6,
        **(split or {}),
    }


async def _timeline(
    peer: PeerProcess, move: Any, key: Any, cache: Any, lists: Any
) -> dict[str, Any]:
    """The same requests again, with both processes' socket calls stamped: each phase's
    median (µs), how many requests were left out (a stamp missing), and the p50 meanwhile."""
    stamps = SocketStamps()
    try:
        await peer.request("stamp_sockets", on=True)
        stamps.start()
        for src, dst in lists:
            stamps.mark("call>")
            await move(key, cache, src, dst)
            stamps.mark("call<")
    finally:
        ours = stamps.stop()
        theirs = await peer.request("stamp_sockets", on=False)
    split = phases(ours, [(t, what) for t, what in theirs])
    calls = sorted(split.calls_us)
    return {
        "phases_us": split.medians(),
        "phases_skipped": split.skipped,
        "stamped_p50_us": calls[len(calls) // 2] if calls else None,
    }


def _timeline_medians(got: list[dict[str, Any]]) -> dict[str, Any]:
    """The timeline of a case's rounds: each phase's median over them (None: no request was
    split), the requests left out in all, and the median stamped p50."""
    medians: dict[str, float | None] = {}
    for k in PHASES:
        counted = [r["phases_us"][k] for r in got if r["phases_us"][k] is not None]
        medians[k] = statistics.median(counted) if counted else None
    stamped = [r["stamped_p50_us"] for r in got if r["stamped_p50_us"] is not None]
    return {
        "phases_us": medians,
        "phases_skipped": sum(r["phases_skipped"] for r in got),
        "stamped_p50_us": statistics.median(stamped) if stamped else None,
    }


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "small_requests")
    loops = ("uvloop", "asyncio", "trio")
    p.add_argument("--loops", type=csv_of(*loops), default=list(loops), help="event loops")
    p.add_argument("--cases", type=csv_of(*CASES), default=list(CASES), help="cases")
    p.add_argument("--requests", type=positive_int, default=2000, help="requests per case")
    p.add_argument("--pool", type=positive_int, default=1024, help="blocks in each cache")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also split each request's time into phases (stamps at both sides' socket calls)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="rounds (each case and loop once per round, in turn; medians reported)",
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    floors: dict[int, list[float]] = {}
    for _ in range(args.repeat):
        for name in args.cases:
            _, _, per, _, kib, _, _ = CASES[name]
            size = per * (kib << 10)
            floors.setdefault(size, []).append(raw_rpc_us(size)[0])
            for loop in args.loops:
                row = run_on_loop(loop, _case, name, loop, args.requests, args.pool, args.timeline)
                runs.setdefault((name, loop), []).append(row)
                print(f"{name} {loop}: p50 {row['p50_us']:.0f} us", file=sys.stderr)
    rows = []
    for (name, _), got in runs.items():
        row = dict(got[0])
        for k in ("p50_us", "p99_us", "cpu_us", "peer_cpu_us"):
            row[k] = statistics.median(r[k] for r in got)
        _, _, per, _, kib, _, _ = CASES[name]
        row["floor_us"] = statistics.median(floors[per * (kib << 10)])
        row["ratio"] = row["p50_us"] / row["floor_us"]
        if args.timeline:
            row.update(_timeline_medians(got))
        rows.append(row)
    cols = ["case", "loop", "p50_us", "p99_us", "cpu_us", "peer_cpu_us", "floor_us", "ratio"]
    print_table("One request at a time (µs; floor: raw request/response, same run)", rows, cols)
    if args.timeline:
        split = [{**r, **r["phases_us"]} for r in rows]
        cols = ["case", "loop", *PHASES, "stamped_p50_us", "phases_skipped"]
        print_table("Where a request's time goes (median µs per phase)", split, cols)
    print(f"wrote {write_json('small_requests', {'rows': rows}, args.json)}")


if __name__ == "__main__":
    main()
