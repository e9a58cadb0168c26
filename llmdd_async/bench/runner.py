"""``llmdd-async bench``: pulls and pushes against a real peer process, swept over block size,
blocks per request, requests in flight, operation, transport and event loop.

Every row comes with the machine's limit measured in the same run (memcpy for same-host, a raw
two-process loopback socket for TCP), so figures are also ratios. Memory is what a framework
would register: user-allocated numpy arrays, blocks in shuffled order. The table goes to
stdout, progress to stderr, all rows to ``--json``; ``--plot`` draws requests/s (needs
matplotlib, the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

import llmdd_async as dd
from llmdd_async._childproc import run_on_loop
from llmdd_async.bench.limits import memcpy_gbps, raw_socket_gbps
from llmdd_async.testing import PeerProcess, encode_key

__all__ = ["build_parser", "run"]

_LOOPS = ("asyncio", "uvloop", "trio")
_TRANSPORTS = ("tcp", "same-host")
_OPS = ("pull", "push")


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _choices(*allowed: str) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items or any(t not in allowed for t in items):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}"
            )
        return items

    return parse


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The bench's options (on ``parser``, e.g. a subcommand's, or a new parser)."""
    p = parser or argparse.ArgumentParser(prog="llmdd-async bench")
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.description = p.description or (__doc__ or "").replace("``", "")  # plain --help
    p.add_argument("--block-kib", type=_ints, default=[64], help="block sizes (KiB, K+V)")
    p.add_argument("--blocks", type=_ints, default=[1, 16], help="blocks per request")
    p.add_argument("--concurrency", type=_ints, default=[1, 64], help="requests in flight")
    p.add_argument("--ops", type=_choices(*_OPS), default=list(_OPS), help="operations")
    p.add_argument(
        "--transports", type=_choices(*_TRANSPORTS), default=list(_TRANSPORTS), help="transports"
    )
    p.add_argument(
        "--loops", type=_choices(*_LOOPS), default=["asyncio", "uvloop"], help="event loops"
    )
    p.add_argument(
        "--requests", type=_ints, default=[200], help="requests per measurement (first value)"
    )
    p.add_argument("--json", metavar="PATH", default="llmdd-bench.json", help="results file")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw requests/s (matplotlib)")
    return p


async def _measure(
    transport: str, loop: str, args: argparse.Namespace, progress: Any
) -> list[dict[str, Any]]:
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.Transport": transport,
        "llm.SyncKvCacheWaitTime": "60000",
    }
    rows: list[dict[str, Any]] = []
    nreq = args.requests[0]
    for kib in args.block_kib:
        block = kib << 10
        nblocks = max(args.blocks) * max(args.concurrency)
        shape = [nblocks, block // 2]  # K and V: two tensors of half a block each
        peer_opts = {
            **opts,
            "llm.listenIpInfo": "127.0.0.1:0",
            "llm.MemPoolConfig": json.dumps({"memory_size": nblocks * block + (16 << 20)}),
        }
        async with PeerProcess.start(dd.LLMRole.PROMPT, 1, peer_opts, loop) as peer:
            await peer.request(
                "alloc",
                kind="blocks",
                num_tensors=2,
                shape=shape,
                blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
                seed=1,
            )
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
                info = dd.LLMClusterInfo()
                info.remote_cluster_id = 1
                info.append_local_ip_info("127.0.0.1", 0)
                assert peer.listen is not None  # it was started with llm.listenIpInfo
                info.append_remote_ip_info(*peer.listen)
                code, _ = await d.link_clusters([info], 10000)
                if code != dd.LLMStatusCode.LLM_SUCCESS:
                    raise RuntimeError(f"could not link to the bench peer: {code!r}")
                cm = d.cache_manager
                # Memory the "framework" allocated itself: numpy arrays, registered.
                arrays = [np.zeros(shape, np.uint8) for _ in range(2)]
                cache = cm.register_blocks_cache(
                    dd.CacheDesc(2, shape, dd.DataType.DT_UINT8), arrays
                )
                rng = np.random.default_rng(0)
                for op in args.ops:
                    for per in args.blocks:
                        for conc in args.concurrency:
                            rows.append(
                                await _point(cm, cache, op, per, conc, nreq, nblocks, block, rng)
                            )
                            rows[-1].update(transport=transport, loop=loop, block_kib=kib)
                            progress()
    return rows


async def _point(
    cm: Any,
    cache: Any,
    op: str,
    per: int,
    conc: int,
    nreq: int,
    nblocks: int,
    block: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    key = dd.BlocksCacheKey(1, 0)
    lat: list[float] = []

    async def one(slot: int) -> None:
        # Disjoint shuffled blocks per slot, so requests in flight never share a block.
        pool = np.arange(slot * per, (slot + 1) * per)
        blocks = rng.permutation(pool).tolist()
        t0 = time.perf_counter()
        if op == "pull":
            await cm.pull_blocks(key, cache, blocks, blocks)
        else:
            await cm.push_blocks(key, cache, blocks, blocks)
        lat.append(time.perf_counter() - t0)

    for slot in range(min(conc, nblocks // per)):  # warm-up, and the first touch of memory
        await one(slot)
    lat.clear()
    waves = max(1, nreq // conc)
    t0 = time.perf_counter()
    for _ in range(waves):
        async with anyio.create_task_group() as tg:
            for slot in range(conc):
                tg.start_soon(one, slot)
    elapsed = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    return {
        "op": op,
        "blocks": per,
        "concurrency": conc,
        "requests": n,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[min(n - 1, int(n * 0.99))] * 1e6,
        "req_per_s": n / elapsed,
        "gbps": n * per * block / elapsed / 1e9,
    }


def run(args: argparse.Namespace) -> int:
    """Run the sweep; returns the exit status.

    Raises:
        SystemExit: ``--plot`` without matplotlib (checked before anything runs).
    """
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("--plot needs matplotlib: pip install 'llmdd-async[demo]'", file=sys.stderr)
        return 2
    combos = [(t, lp) for t in args.transports for lp in args.loops]
    total = len(combos) * len(args.block_kib) * len(args.ops) * len(args.blocks)
    total *= len(args.concurrency)
    done = [0]

    def progress() -> None:
        done[0] += 1
        bar = "#" * (30 * done[0] // total)
        print(f"\r[{bar:<30}] {done[0]}/{total}", end="", file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    for transport, loop in combos:
        rows += run_on_loop(loop, _measure, transport, loop, args, progress)
    print(file=sys.stderr)
    # The limits, measured in this run: what one memcpy and one raw socket stream move.
    limit_bytes = max(r["blocks"] for r in rows) * max(args.block_kib) * 1024 * 64
    limits = {
        "memcpy_gbps": statistics.median(memcpy_gbps(limit_bytes) for _ in range(3)),
        "raw_socket_gbps": raw_socket_gbps(max(limit_bytes, 16 << 20)),
    }
    for r in rows:
        lim = limits["memcpy_gbps"] if r["transport"] == "same-host" else limits["raw_socket_gbps"]
        r["limit_gbps"] = lim
        r["ratio"] = r["gbps"] / lim
    cols = ["loop", "transport", "op", "block_kib", "blocks", "concurrency"]
    cols += ["p50_us", "p99_us", "req_per_s", "gbps", "limit_gbps", "ratio"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in rows:
        print("  ".join(_cell(r[c]) for c in cols))
    with open(args.json, "w") as f:
        json.dump({"limits": limits, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cell(v: Any) -> str:
    return f"{v:>11.3f}" if isinstance(v, float) else f"{v!s:>11}"


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        name = f"{r['loop']} {r['transport']} {r['op']} {r['blocks']}x{r['block_kib']}KiB"
        series.setdefault(name, []).append((r["concurrency"], r["req_per_s"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("requests / s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
