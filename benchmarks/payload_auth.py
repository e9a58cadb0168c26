"""What ``llm.PayloadAuth`` costs: a 256 MiB shuffled-blocks pull over TCP between two
processes, without a key, with ``llm.AuthKey`` (frames authenticated, payload not: the
default) and with ``llm.AuthKey`` + ``llm.PayloadAuth=1`` (a MAC over every DATA payload).

The three variants run in the same run, alternating pull by pull (A, B, C, A, B, C, ...), each
against its own peer process, so a noisy machine slows them alike; a raw blocking loopback
socket stream of 256 MiB and one HMAC-SHA256 pass over 256 MiB are measured in the same run
as the machine's limits. The table gives each variant's median GB/s, its ratio to the raw
socket and to the keyed default.

Run: ``python benchmarks/payload_auth.py [--repeat N] [--loop asyncio|uvloop] [--json PATH]``
(about 20 s with the defaults).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import time
from typing import Any

import anyio
import numpy as np
from _common import parser, positive_int, print_table, raw_socket_gbps, write_json

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, encode_key

BLOCKS, BLOCK_BYTES = 4096, 64 << 10
TOTAL = BLOCKS * BLOCK_BYTES
TENSORS = 8  # K and V of 4 layers, as a framework registers them
SHAPE = [BLOCKS // TENSORS, BLOCK_BYTES]
KEY = dd.BlocksCacheKey(1, 0)
VARIANTS = {
    "keyless": {},
    "keyed (default)": {"llm.AuthKey": "bench-key"},
    "keyed + PayloadAuth": {"llm.AuthKey": "bench-key", "llm.PayloadAuth": "1"},
}


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "payload_auth")
    p.add_argument("--repeat", type=positive_int, default=5, help="pulls per variant (alternating)")
    p.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help="event loop of both ends"
    )
    return p


def options(extra: dict[str, str], listen: bool) -> dict[str, str]:
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.Transport": "tcp",
        "llm.SyncKvCacheWaitTime": "60000",
        **extra,
    }
    if listen:
        opts["llm.listenIpInfo"] = "127.0.0.1:0"
    return opts


def hmac_gbps(nbytes: int) -> float:
    """One HMAC-SHA256 pass over ``nbytes`` (what each end adds per byte, at best)."""
    data = memoryview(np.ones(nbytes, np.uint8)).cast("B")
    mac = hmac.new(b"k" * 32, b"", hashlib.sha256)
    t0 = time.perf_counter()
    mac.update(data)
    mac.digest()
    return nbytes / (time.perf_counter() - t0) / 1e9


async def run(repeat: int, loop: str) -> list[dict[str, Any]]:
    order = np.random.default_rng(0).permutation(SHAPE[0]).tolist()
    local = list(range(SHAPE[0]))
    speeds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    raw: list[float] = []
    async with (
        PeerProcess.start(
            dd.LLMRole.PROMPT, 1, options(VARIANTS["keyless"], True), loop, fork=False
        ) as p0,
        PeerProcess.start(
            dd.LLMRole.PROMPT, 1, options(VARIANTS["keyed (default)"], True), loop, fork=False
        ) as p1,
        PeerProcess.start(
            dd.LLMRole.PROMPT, 1, options(VARIANTS["keyed + PayloadAuth"], True), loop, fork=False
        ) as p2,
        dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(options(VARIANTS["keyless"], False)) as d0,
        dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            options(VARIANTS["keyed (default)"], False)
        ) as d1,
        dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            options(VARIANTS["keyed + PayloadAuth"], False)
        ) as d2,
    ):
        ends = dict(zip(VARIANTS, [(p0, d0), (p1, d1), (p2, d2)], strict=True))
        caches = {}
        for name, (peer, d) in ends.items():
            await peer.request(
                "register",
                kind="blocks",
                num_tensors=TENSORS,
                shape=SHAPE,
                blocks_key=encode_key(KEY),
                seed=3,
            )
            code, _ = await d.link_clusters([peer.cluster_info()])
            assert code == dd.LLMStatusCode.LLM_SUCCESS, (name, code)
            assert d.link_statistics(1).transport == "tcp"
            arrays = [np.full(SHAPE, 1, np.uint8) for _ in range(TENSORS)]
            caches[name] = d.cache_manager.register_blocks_cache(
                dd.CacheDesc(TENSORS, SHAPE, dd.DataType.DT_UINT8), arrays
            )
            await d.cache_manager.pull_blocks(KEY, caches[name], order, local)  # warm-up
        for _ in range(repeat):
            raw.append(raw_socket_gbps(TOTAL, repeat=1))
            for name, (_, d) in ends.items():
                t0 = time.perf_counter()
                await d.cache_manager.pull_blocks(KEY, caches[name], order, local)
                speeds[name].append(TOTAL / (time.perf_counter() - t0) / 1e9)
        # The last pull of each variant must have the peer's bytes.
        first = [caches[name].tensors[0][:4].copy() for name in VARIANTS]
        assert all(np.array_equal(first[0], f) for f in first[1:])
    mac = hmac_gbps(TOTAL)
    raw_gbps = statistics.median(raw)
    keyed = statistics.median(speeds["keyed (default)"])
    rows = []
    for name in VARIANTS:
        gbps = statistics.median(speeds[name])
        rows.append(
            {
                "variant": name,
                "loop": loop,
                "GB/s": gbps,
                "min GB/s": min(speeds[name]),
                "max GB/s": max(speeds[name]),
                "x raw socket": gbps / raw_gbps,
                "x keyed": gbps / keyed,
                "raw socket GB/s": raw_gbps,
                "hmac-sha256 GB/s": mac,
            }
        )
    return rows


def main() -> None:
    args = build_parser().parse_args()
    backend_options = {"use_uvloop": True} if args.loop == "uvloop" else {}
    rows = anyio.run(
        run, args.repeat, args.loop, backend="asyncio", backend_options=backend_options
    )
    print_table(
        f"256 MiB shuffled pull_blocks over TCP ({TENSORS} x {SHAPE} user tensors, "
        f"median of {args.repeat}, alternating)",
        rows,
        ["variant", "loop", "GB/s", "min GB/s", "max GB/s", "x raw socket", "x keyed"],
    )
    print(
        f"\nmachine: raw loopback socket {rows[0]['raw socket GB/s']:.2f} GB/s, "
        f"one HMAC-SHA256 pass {rows[0]['hmac-sha256 GB/s']:.2f} GB/s"
    )
    out = write_json("payload_auth", {"rows": rows}, args.json)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
