"""One small request at a time, through the public API, against a peer process (issue 21).

Each case pulls (or pushes) ``--blocks`` blocks of a blocks cache between this process and a
peer process, one request after the other, the blocks of every request drawn scattered over a
pool of ``--pool`` blocks (source and destination independent, as a serving engine's
allocators hand them out), over ``llm.Transport=tcp`` or ``same-host``, in remote-accessible
mode. The cases differ in what makes a request cost more than the easy case: more blocks,
more tensors (a KV block is a range per tensor), a keyed link (``llm.AuthKey``). Per case and
loop: p50/p99 latency, the CPU time one request costs this process and the peer's, and the
floor: a raw blocking request/response of the same size between two processes, measured in
the same run (``ratio`` = p50 over it).

Run: ``python benchmarks/small_requests.py [--loops uvloop,asyncio,trio] [--cases ...]
[--requests N] [--repeat N] [--json PATH]`` (about 10 s per case, loop and round).
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
from llmdd_async.testing import PeerProcess, encode_key

#: name -> (transport, op, blocks per request, tensors, block KiB (all tensors), keyed)
CASES: dict[str, tuple[str, str, int, int, int, bool]] = {
    "tcp-1": ("tcp", "pull", 1, 2, 64, False),
    "tcp-16": ("tcp", "pull", 16, 2, 64, False),
    "tcp-160-tensors": ("tcp", "pull", 1, 160, 640, False),
    "tcp-keyed": ("tcp", "pull", 1, 2, 64, True),
    "tcp-push": ("tcp", "push", 1, 2, 64, False),
    "same-host-1": ("same-host", "pull", 1, 2, 64, False),
}


async def _case(name: str, loop: str, requests: int, pool: int) -> dict[str, Any]:
    transport, op, per, tensors, kib, keyed = CASES[name]
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
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
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, peer_opts, loop) as peer:
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
        "requests": n,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[min(n - 1, int(n * 0.99))] * 1e6,
        "cpu_us": cpu / n * 1e6,
        "peer_cpu_us": peer_cpu / n * 1e6,
    }


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "small_requests")
    loops = ("uvloop", "asyncio", "trio")
    p.add_argument("--loops", type=csv_of(*loops), default=list(loops), help="event loops")
    p.add_argument("--cases", type=csv_of(*CASES), default=list(CASES), help="cases")
    p.add_argument("--requests", type=positive_int, default=2000, help="requests per case")
    p.add_argument("--pool", type=positive_int, default=1024, help="blocks in each cache")
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
            _, _, per, _, kib, _ = CASES[name]
            size = per * (kib << 10)
            floors.setdefault(size, []).append(raw_rpc_us(size)[0])
            for loop in args.loops:
                row = run_on_loop(loop, _case, name, loop, args.requests, args.pool)
                runs.setdefault((name, loop), []).append(row)
                print(f"{name} {loop}: p50 {row['p50_us']:.0f} us", file=sys.stderr)
    rows = []
    for (name, _), got in runs.items():
        row = dict(got[0])
        for k in ("p50_us", "p99_us", "cpu_us", "peer_cpu_us"):
            row[k] = statistics.median(r[k] for r in got)
        _, _, per, _, kib, _ = CASES[name]
        row["floor_us"] = statistics.median(floors[per * (kib << 10)])
        row["ratio"] = row["p50_us"] / row["floor_us"]
        rows.append(row)
    cols = ["case", "loop", "p50_us", "p99_us", "cpu_us", "peer_cpu_us", "floor_us", "ratio"]
    print_table("One request at a time (µs; floor: raw request/response, same run)", rows, cols)
    print(f"wrote {write_json('small_requests', {'rows': rows}, args.json)}")


if __name__ == "__main__":
    main()
