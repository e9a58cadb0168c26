"""Layer-wise KV streaming: how much transfer time a prefill still sees.

A prefill of L layers runs real per-layer compute (numpy matmuls sized to a chosen time) in a
compute thread of this process and signals ``LayerEvents.layer_ready(i)`` after each layer;
``transfer_cache_async`` streams each layer's K and V to a decode process meanwhile. Measured:

* exposed (layer-wise): from the end of the last layer's compute to the last byte landing;
* one layer: the transfer time of a single layer on its own (median);
* after prefill: everything sent once the prefill finished (what a non-overlapping stack sees);
* transfer CPU per layer: this process's CPU time over the layer-wise run, less the compute
  thread's own, per layer (what streaming costs the prefill worker beside its model);
  ``--compute device`` makes each layer's compute a sleep (an accelerator's: the CPU is left
  to the transfer), ``cpu`` (the default) numpy matmuls that compete with it for the cores;
* its floor at that pace, measured in the same run: an asyncio loop that a thread sleeping
  as long as a layer's compute wakes once a layer (``call_soon_threadsafe``), sending the
  layer's bytes to another process over raw loopback TCP from the wake-up's callback; the
  loop thread's CPU per layer (a send after the loop slept costs more than back to back).

A second table takes every layer ready at the call (the per-layer cost of the transfer
itself): wall and this process's CPU per layer, against the copy of the same bytes measured in
the same run (a raw loopback TCP stream between two processes for tcp, memcpy for same-host),
and what is left beyond it.

Run: ``python benchmarks/layerwise.py [--layers 16] [--layer-mib 8] [--json PATH]``; 80 small
layers: ``--layers 80 --layer-kib 64``.
Targets (benchmark): exposed <= 1.5 x one layer's transfer time whenever per-layer compute >=
per-layer transfer; every layer ready, beyond the copy: <= 50 us of wall and <= 30 us of CPU
per layer.
"""

from __future__ import annotations

import os

# One BLAS thread: the "model" gets one core, the transfer the rest, as with a real
# accelerator where compute does not take the CPU away from the copy engine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import asyncio
import functools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
from _common import (
    csv_of,
    memcpy_gbps,
    parser,
    positive_floats,
    positive_int,
    print_table,
    raw_socket_gbps,
    write_json,
)

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, encode_key

BLOCK = 1 << 19  # 512 KiB blocks: K and V of a layer of n MiB are n blocks each
#: every layer ready, beyond the copy: wall and CPU per layer (issue #21's target)
ALL_READY_WALL_US, ALL_READY_CPU_US = 50.0, 30.0
#: timed all-ready transfers per transport (median reported)
ALL_READY_RUNS = 30


def layer_geometry(layer_bytes: int) -> tuple[int, int]:
    """``(blocks, block bytes)`` of each K (and V) tensor for ``layer_bytes`` of K+V per
    layer: ``BLOCK``-sized blocks, or one block per tensor for a layer smaller than that.

    Raises:
        ValueError: not a positive even size, or a large one that is no multiple of 2 blocks.
    """
    half, odd = divmod(layer_bytes, 2)
    if half < 1 or odd or (half > BLOCK and half % BLOCK):
        raise ValueError(f"no layer of {layer_bytes} bytes of K+V in blocks of {BLOCK} bytes")
    return (half // BLOCK, BLOCK) if half >= BLOCK else (1, half)


def layer_blocks(layer_mib: int) -> int:
    """Blocks per K (and per V) tensor for ``layer_mib`` MiB of K+V per layer.

    Raises:
        ValueError: ``layer_mib`` < 1.
    """
    if layer_mib < 1:
        raise ValueError(f"layer_mib must be >= 1, got {layer_mib}")
    return layer_geometry(layer_mib << 20)[0]


def hidden_percent(exposed: float, after_prefill: float) -> float:
    """How much of the after-prefill transfer time layer-wise streaming hid, in [0, 100].

    0 when streaming exposed as much as (or, through overheads on small runs, more than)
    sending everything after the prefill."""
    if after_prefill <= 0:
        return 0.0
    return 100 * min(1.0, max(0.0, 1 - exposed / after_prefill))


def calibrate(seconds: float) -> tuple[np.ndarray, int]:
    """A square matrix and a repeat count whose matmuls take about ``seconds``."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - t0) / 20
    return a, max(1, round(seconds / per))


def compute_layer(a: np.ndarray, reps: int) -> None:
    for _ in range(reps):
        a @ a


def make_compute(kind: str, seconds: float) -> Callable[[], None]:
    """One layer's compute of about ``seconds``: numpy matmuls on this process's CPU
    (``cpu``), or a sleep (``device``: an accelerator computes, the CPU stays free for the
    transfer, whose own CPU cost is then measured without a model competing for it).

    Raises:
        ValueError: another kind.
    """
    if kind == "device":
        return functools.partial(time.sleep, seconds)
    if kind != "cpu":
        raise ValueError(f"no compute kind {kind!r}")
    a, reps = calibrate(seconds)
    return functools.partial(compute_layer, a, reps)


def options(transport: str, listen: bool, pool: int) -> dict[str, str]:
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": pool, "page_shift": 21}),
        "llm.Transport": transport,
        "llm.SyncKvCacheWaitTime": "60000",
    }
    if listen:
        opts["llm.listenIpInfo"] = "127.0.0.1:0"
    return opts


def copy_us_per_layer(transport: str, layers: int, layer_bytes: int) -> tuple[str, float]:
    """The machine's copy of one layer's bytes, measured now over all of them: a raw
    loopback TCP stream between two processes (tcp), memcpy (same-host)."""
    nbytes = layers * layer_bytes
    if transport == "same-host":
        return "memcpy", layer_bytes / memcpy_gbps(nbytes) / 1e3
    return "raw_socket", layer_bytes / raw_socket_gbps(nbytes) / 1e3


_SINK = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as s:
    buf = bytearray(1 << 20)
    while s.recv_into(buf):
        pass
"""


def paced_floor_us(layer_bytes: int, gap_s: float, layers: int) -> float:
    """The floor of a layer sent at the model's pace, measured now: a thread sleeps
    ``gap_s`` then wakes an asyncio loop (``call_soon_threadsafe``), whose callback sends the
    layer's bytes to another process over raw loopback TCP; the loop thread's CPU per layer.
    Runs its own loop: call it from a thread of its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    sink = subprocess.Popen([sys.executable, "-c", _SINK, str(listener.getsockname()[1])])
    try:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = memoryview(np.ones(layer_bytes, np.uint8))
            return asyncio.run(_paced_sends(conn, payload, gap_s, layers))
    finally:
        listener.close()
        sink.wait(timeout=30)


async def _paced_sends(conn: socket.socket, payload: memoryview, gap_s: float, n: int) -> float:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    sent = 0

    def send() -> None:
        nonlocal sent
        conn.sendall(payload)
        sent += 1
        if sent == n:
            done.set_result(None)

    def model() -> None:
        for _ in range(n):
            time.sleep(gap_s)
            loop.call_soon_threadsafe(send)

    thread = threading.Thread(target=model)
    c0 = time.thread_time()
    thread.start()
    await done
    cpu = time.thread_time() - c0
    thread.join()
    return cpu / n * 1e6


def all_ready_row(
    transport: str, layers: int, layer_bytes: int, walls: list[float], cpus: list[float]
) -> dict[str, Any]:
    """The all-ready table's row: per layer, against the copy measured in the same run."""
    limit, copy_us = copy_us_per_layer(transport, layers, layer_bytes)
    wall = statistics.median(walls) / layers * 1e6
    cpu = statistics.median(cpus) / layers * 1e6
    return {
        "transport": transport,
        "layers": layers,
        "KiB/layer": layer_bytes >> 10,
        "wall us/layer": wall,
        "CPU us/layer": cpu,
        "limit": limit,
        "copy us/layer": copy_us,
        "wall beyond copy": wall - copy_us,
        "CPU beyond copy": cpu - copy_us,
        "target wall/CPU": f"{ALL_READY_WALL_US:g}/{ALL_READY_CPU_US:g}",
        "ok": wall - copy_us <= ALL_READY_WALL_US and cpu - copy_us <= ALL_READY_CPU_US,
    }


async def run(
    transport: str,
    layers: int,
    layer_bytes: int,
    ratios: list[float],
    repeat: int,
    compute_kind: str = "cpu",
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The overlap rows of one transport, and its all-ready row."""
    blocks, block = layer_geometry(layer_bytes)  # K and V of one layer: layer_bytes
    page = 1 << 21  # the pools' page (options): each tensor takes whole pages
    pool = 2 * layers * -(-blocks * block // page) * page + (64 << 20)
    shape = [blocks, block]
    rows = []
    async with PeerProcess.start(
        dd.LLMRole.DECODER, 2, options(transport, True, pool), fork=False
    ) as dec:
        await dec.request(
            "register",
            kind="blocks",
            num_tensors=2 * layers,
            shape=shape,
            blocks_key=encode_key(dd.BlocksCacheKey(2, 0)),
        )
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
            options(transport, False, pool)
        ) as prompt:
            code, _ = await prompt.link_clusters([dec.cluster_info()])
            assert code == dd.LLMStatusCode.LLM_SUCCESS
            used = prompt.link_statistics(2).transport
            cm = prompt.cache_manager
            src = cm.allocate_blocks_cache(dd.CacheDesc(2 * layers, shape, dd.DataType.DT_UINT8))
            for t in src.tensors:
                t[...] = 1
            idx = list(range(blocks))
            everything = dd.TransferWithCacheKeyConfig(
                dd.BlocksCacheKey(2, 0), range(0, layers), range(0, layers)
            )

            async def send_all_ready(cfg: Any) -> float:
                ev = dd.LayerEvents()
                for i in range(layers):
                    ev.layer_ready(i)
                t0 = time.perf_counter()
                await cm.transfer_cache_async(src, ev, [cfg], idx, idx)
                return time.perf_counter() - t0

            one = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 1), range(0, 1))
            await send_all_ready(everything)  # warm-up: first touch on both sides
            walls, cpus = [], []
            for _ in range(ALL_READY_RUNS):
                c0 = time.process_time()
                walls.append(await send_all_ready(everything))
                cpus.append(time.process_time() - c0)
            one_layer = statistics.median([await send_all_ready(one) for _ in range(5)])
            for ratio in ratios:
                compute_one = make_compute(compute_kind, ratio * one_layer)
                layer_compute = []
                exposed, after, prefill, cpu = [], [], [], []
                for _ in range(repeat):
                    # layer-wise: compute in a thread, stream meanwhile
                    ev = dd.LayerEvents()
                    task = cm.transfer_cache_async(src, ev, [everything], idx, idx)

                    def forward(
                        ev: dd.LayerEvents = ev, compute_one: Callable[[], None] = compute_one
                    ) -> tuple[float, list[float], float]:
                        times = []
                        c0 = time.thread_time()
                        for i in range(layers):
                            t = time.perf_counter()
                            compute_one()
                            times.append(time.perf_counter() - t)
                            ev.layer_ready(i)
                        return time.perf_counter(), times, time.thread_time() - c0

                    t_start = time.perf_counter()
                    c_start = time.process_time()
                    t_end, times, compute_cpu = await anyio.to_thread.run_sync(forward)
                    await task
                    t_land = time.perf_counter()
                    # what the transfer cost this process beside the model's own compute
                    cpu.append((time.process_time() - c_start - compute_cpu) / layers)
                    exposed.append(t_land - t_end)
                    prefill.append(t_end - t_start)
                    layer_compute.extend(times)
                    # after prefill: compute everything, then send everything
                    await anyio.to_thread.run_sync(
                        lambda c=compute_one: [c() for _ in range(layers)]
                    )
                    after.append(await send_all_ready(everything))
                compute = statistics.median(layer_compute)
                exp = statistics.median(exposed)
                floor = await anyio.to_thread.run_sync(
                    paced_floor_us, layer_bytes, compute, max(layers, 20)
                )
                transfer_cpu = statistics.median(cpu) * 1e6
                rows.append(
                    {
                        "transport": used,
                        "compute": compute_kind,
                        "layers": layers,
                        "KiB/layer": layer_bytes >> 10,
                        "compute ms/layer": compute * 1e3,
                        "transfer ms/layer": one_layer * 1e3,
                        "compute/transfer": compute / one_layer,
                        "exposed ms (layer-wise)": exp * 1e3,
                        "exposed ms (after prefill)": statistics.median(after) * 1e3,
                        "exposed / one layer": exp / one_layer,
                        "hidden %": hidden_percent(exp, statistics.median(after)),
                        "transfer CPU us/layer": transfer_cpu,
                        "paced floor CPU us/layer": floor,
                        "CPU / floor": transfer_cpu / floor,
                        "target": 1.5 if compute >= one_layer else None,
                        "ok": exp / one_layer <= 1.5 if compute >= one_layer else None,
                    }
                )
    return rows, all_ready_row(used, layers, layer_bytes, walls, cpus)


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "layerwise")
    p.add_argument("--layers", type=positive_int, default=16, help="layers of the prefill")
    p.add_argument("--layer-mib", type=positive_int, default=8, help="K+V bytes per layer, MiB")
    p.add_argument(
        "--layer-kib",
        type=positive_int,
        default=0,
        help="K+V bytes per layer, KiB, instead of --layer-mib (default 0: use that), e.g. 64 for "
        "80 small layers",
    )
    p.add_argument(
        "--ratios",
        type=positive_floats,
        default="0.5,1.25,2",
        help="per-layer compute time / per-layer transfer time, comma-separated cases",
    )
    p.add_argument(
        "--transports",
        type=csv_of("tcp", "same-host"),
        default="tcp,same-host",
        help="llm.Transport values to measure, comma-separated",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=3, help="timed runs per case (median reported)"
    )
    p.add_argument(
        "--compute",
        choices=["cpu", "device"],
        default="cpu",
        help="a layer's compute: numpy matmuls in this process (cpu), or a sleep as long "
        "(device: an accelerator computes, the CPU is left to the transfer)",
    )
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    layer_bytes = args.layer_kib << 10 if args.layer_kib else args.layer_mib << 20
    try:
        layer_geometry(layer_bytes)
    except ValueError as exc:
        p.error(str(exc))
    rows: list[dict[str, Any]] = []
    ready: list[dict[str, Any]] = []
    for transport in args.transports:
        overlap, all_ready = anyio.run(
            run, transport, args.layers, layer_bytes, args.ratios, args.repeat, args.compute
        )
        rows += overlap
        ready.append(all_ready)
    print_table(
        "Layer-wise streaming (exposed = last compute done -> last byte landed)",
        rows,
        [
            "transport",
            "compute",
            "layers",
            "KiB/layer",
            "compute ms/layer",
            "transfer ms/layer",
            "compute/transfer",
            "exposed ms (layer-wise)",
            "exposed ms (after prefill)",
            "exposed / one layer",
            "hidden %",
            "transfer CPU us/layer",
            "paced floor CPU us/layer",
            "CPU / floor",
            "target",
            "ok",
        ],
    )
    print()
    print_table(
        "Every layer ready: the transfer's own cost per layer, against the copy (same run)",
        ready,
        [
            "transport",
            "layers",
            "KiB/layer",
            "wall us/layer",
            "CPU us/layer",
            "limit",
            "copy us/layer",
            "wall beyond copy",
            "CPU beyond copy",
            "target wall/CPU",
            "ok",
        ],
    )
    out = write_json("layerwise", {"rows": rows, "all_ready": ready}, args.json)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
