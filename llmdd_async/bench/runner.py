"""``llmdd-async bench``: pulls and pushes against a real peer process, swept over block size,
tensors a block is split over, blocks per request, requests in flight, operation, transport
and event loop.

Transports: ours over ``llm.Transport`` ``tcp``, ``same-host``, ``nixl`` (NIXL over UCX as
the environment configures it, e.g. ``UCX_NET_DEVICES=lo UCX_TLS=cma,tcp,self``) or
``mooncake`` (Mooncake Transfer Engine, its TCP protocol); and the peer
engines through their own Python APIs on the same workloads in the same run: ``nixl-raw``
(NIXL's agent API: prepared descriptor lists, busy polling) and ``mooncake-raw`` (Mooncake
Transfer Engine over TCP, P2P handshake, no metadata server); these have no event loop (their
rows say loop ``-``). A transport whose package is not installed is refused before the sweep.

Every row comes with the machine's limits measured in the same run: for one request at a time
its latency against a raw two-process request/response of the same size (the floor), for
requests in flight or bulk ones their bandwidth against memcpy (same-host; NIXL when
``UCX_TLS`` allows a shared-memory transport such as cma) or a raw two-process loopback socket
(tcp, mooncake-raw, NIXL with ``UCX_TLS=tcp``), named in the row's ``limit``. Memory is what a
framework would register: user-allocated numpy arrays, each request's blocks scattered over
the whole pool, source and destination independent, as a serving engine's allocators hand
them out; a sweep that would take more than half the memory available is refused before it
starts. The table goes to
stdout, a progress bar with its ETA to stderr (on a terminal only); ``--json PATH`` writes
every row with the run's version, host, loops, the peer engines' versions, the ``UCX_*``
settings and time (``-``: to stdout, the table then to stderr); ``--plot PNG`` draws latency
and throughput (needs matplotlib, the ``demo`` extra). Nothing is written unless asked.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any, TextIO

import numpy as np

import llmdd_async as dd
from llmdd_async._childproc import run_on_loop
from llmdd_async._doctor import cpu_idle
from llmdd_async._options import parse_busy_poll_us
from llmdd_async.bench import peers
from llmdd_async.bench.limits import (
    MEMORY_FRACTION,
    available_memory,
    memcpy_gbps,
    raw_rpc_us,
    raw_socket_gbps,
)
from llmdd_async.testing import PeerProcess, encode_key

__all__ = ["build_parser", "run"]

_LOOPS = ("asyncio", "uvloop", "trio")
_TRANSPORTS = ("tcp", "same-host", "nixl", "mooncake", *peers.ENGINES)
#: UCX transports that move bytes between processes of one host through memory (not a socket)
_UCX_MEMORY_TLS = {"all", "cma", "shm", "sm", "posix", "sysv", "xpmem", "knem"}
_OPS = ("pull", "push")
#: ``remote-accessible``: llm.EnableRemoteCacheAccessible=1 (one-sided pulls by cache id where
#: the transport allows); ``default``: request/response for every transfer, as most upstream
#: samples run
_MODES = ("remote-accessible", "default")


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


def _busy_poll_us(text: str) -> int:
    try:
        return parse_busy_poll_us(text)
    except dd.LLMException as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    p.add_argument(
        "--tensors",
        type=_ints,
        default=[2],
        help="tensors a block is split over, as a model's K and V of each layer are (a block "
        "of each: more tensors, more and smaller ranges per request, the same bytes)",
    )
    p.add_argument("--blocks", type=_ints, default=[1, 16], help="blocks per request")
    p.add_argument("--concurrency", type=_ints, default=[1, 64], help="requests in flight")
    p.add_argument("--ops", type=_choices(*_OPS), default=list(_OPS), help="operations")
    p.add_argument(
        "--transports",
        type=_choices(*_TRANSPORTS),
        default=["tcp", "same-host"],
        help="transports: ours over llm.Transport tcp, same-host, nixl or mooncake; nixl-raw and "
        "mooncake-raw: those engines' own APIs on the same workloads",
    )
    p.add_argument(
        "--loops", type=_choices(*_LOOPS), default=["asyncio", "uvloop"], help="event loops"
    )
    p.add_argument(
        "--modes",
        type=_choices(*_MODES),
        default=["remote-accessible"],
        help="llm.EnableRemoteCacheAccessible=1 (remote-accessible) or not (default: pulls "
        "only, as pushes need remote-accessible mode)",
    )
    p.add_argument(
        "--requests", type=_ints, default=[200], help="requests per measurement (first value)"
    )
    p.add_argument(
        "--busy-poll",
        metavar="US",
        type=_busy_poll_us,
        default=0,
        help="llm.BusyPoll of both endpoints: microseconds their loops keep polling after "
        "link traffic (0: off, as endpoints run unless told)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="write the results there ('-': stdout)"
    )
    p.add_argument(
        "--plot", metavar="PNG", default=None, help="draw latency and throughput (matplotlib)"
    )
    return p


async def _measure(
    transport: str, loop: str, mode: str, args: argparse.Namespace, progress: Any
) -> list[dict[str, Any]]:
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1" if mode == "remote-accessible" else "0",
        "llm.Transport": transport,
        "llm.SyncKvCacheWaitTime": "60000",
        "llm.BusyPoll": str(args.busy_poll),
    }
    rows: list[dict[str, Any]] = []
    for kib in args.block_kib:
        for tensors in args.tensors:
            for r in await _measure_layout(opts, loop, mode, args, progress, kib, tensors):
                r.update(transport=transport, loop=loop, mode=mode, block_kib=kib, tensors=tensors)
                rows.append(r)
    return rows


async def _measure_layout(
    opts: dict[str, str],
    loop: str,
    mode: str,
    args: argparse.Namespace,
    progress: Any,
    kib: int,
    tensors: int,
) -> list[dict[str, Any]]:
    """The sweep's points for blocks of ``kib`` KiB split over ``tensors`` tensors, against a
    peer process of their own."""
    rows: list[dict[str, Any]] = []
    nreq = args.requests[0]
    block = kib << 10
    nblocks = max(args.blocks) * max(args.concurrency)
    shape = [nblocks, block // tensors]  # a block of each tensor: K and V of tensors/2 layers
    peer_opts = {
        **opts,
        "llm.listenIpInfo": "127.0.0.1:0",
        "llm.MemPoolConfig": json.dumps({"memory_size": nblocks * block + (16 << 20)}),
    }
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, peer_opts, loop, fork=False) as peer:
        await peer.request(
            "alloc",
            kind="blocks",
            num_tensors=tensors,
            shape=shape,
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=1,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            code, _ = await d.link_clusters([peer.cluster_info()], 10000)
            if code != dd.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"could not link to the bench peer: {code!r}")
            cm = d.cache_manager
            # Memory the "framework" allocated itself: numpy arrays, registered; every page
            # written once, as the peer engines' arrays are (requests scatter over them all).
            arrays = [np.full(shape, 1, np.uint8) for _ in range(tensors)]
            cache = cm.register_blocks_cache(
                dd.CacheDesc(tensors, shape, dd.DataType.DT_UINT8), arrays
            )
            rng = np.random.default_rng(0)
            for op in _ops_of(mode, args.ops):
                for per in args.blocks:
                    for conc in args.concurrency:
                        rows.append(
                            await _point(cm, cache, peer, op, per, conc, nreq, nblocks, block, rng)
                        )
                        progress()
    return rows


async def _point(
    cm: Any,
    cache: Any,
    peer: PeerProcess,
    op: str,
    per: int,
    conc: int,
    nreq: int,
    nblocks: int,
    block: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    key = dd.BlocksCacheKey(1, 0)
    move = cm.pull_blocks if op == "pull" else cm.push_blocks
    lat: list[float] = []

    async def wave_of(requests: list[tuple[list[int], list[int]]]) -> None:
        # Each request is a CacheTask, running from the call: a wave is issued as a caller
        # issues requests in flight, with no task of ours per request (a task group and a task
        # each cost this process more CPU than a small same-host pull itself), then awaited
        # in order (a link answers in order): a latency runs from the request's own call to
        # its end (seen there for one that ended in the call: a one-sided copy on the loop)
        issued = []
        for src, dst in requests:
            t0 = time.perf_counter()
            task = move(key, cache, src, dst)
            issued.append((t0, task, time.perf_counter() - t0 if task.done() else None))
        for t0, task, took in issued:
            await task
            lat.append(took if took is not None else time.perf_counter() - t0)

    # Blocks scattered over the whole pool, as an engine's allocator hands them out (a first
    # touch of memory in the warm-up; a request's bytes are rarely in the cache).
    for src, dst in peers.wave_blocks(rng, nblocks, per, min(conc, nblocks // per)):
        await wave_of([(src, dst)])
    lat.clear()
    waves = [peers.wave_blocks(rng, nblocks, per, conc) for _ in range(max(1, nreq // conc))]
    peer_cpu = await peer.request("cpu_seconds")
    cpu = time.process_time()
    t0 = time.perf_counter()
    for wave in waves:
        await wave_of(wave)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu
    peer_cpu = await peer.request("cpu_seconds") - peer_cpu
    lat.sort()
    n = len(lat)
    return {
        # what one request costs each process in CPU time (every thread; the peer's includes
        # answering the two cpu_seconds requests, a few tens of microseconds in all)
        "cpu_us": cpu / n * 1e6,
        "peer_cpu_us": peer_cpu / n * 1e6,
        "op": op,
        "blocks": per,
        "concurrency": conc,
        "requests": n,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[min(n - 1, int(n * 0.99))] * 1e6,
        "req_per_s": n / elapsed,
        "gb_per_s": n * per * block / elapsed / 1e9,
    }


#: requests of at most this size, one at a time, are latency-bound: their ratio is to the
#: floor of a request/response of their size; larger ones, or many in flight, to bandwidth
_LATENCY_BOUND_BYTES = 1 << 20


def _checked_output(path: str | None, what: str) -> str | None:
    """Why ``path`` cannot be written (checked before the sweep), or None."""
    if path is None or path == "-":
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{what} {path!r} is a directory"
    if not os.path.isdir(folder):
        return f"{what} {path!r}: no such directory {folder!r}"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{what} {path!r} is not writable"
    return None


def _memory_needed(args: argparse.Namespace) -> int:
    """Bytes the sweep takes at most at once: both processes' caches of the largest block
    size (the peer's pool and this side's arrays) and the limits' buffers."""
    most = max(args.block_kib) << 10
    caches = 2 * max(args.blocks) * max(args.concurrency) * most + (32 << 20)
    return caches + 2 * _limit_bytes(args)


def _limit_bytes(args: argparse.Namespace) -> int:
    """The size of the bandwidth limits' copies: a wave's bytes, between 16 and 256 MiB."""
    wave = max(args.blocks) * max(args.concurrency) * (max(args.block_kib) << 10)
    return min(max(wave, 16 << 20), 256 << 20)


def _meta(args: argparse.Namespace, cpu_idle_detail: str) -> dict[str, Any]:
    return {
        "version": dd.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "hostname": socket.gethostname(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_idle": cpu_idle_detail,  # (it moves one-request latency by a third on a VM)
        },
        "loops": list(args.loops),
        "tensors": list(args.tensors),
        "modes": list(args.modes),
        "busy_poll_us": args.busy_poll,
        "transports": list(args.transports),
        "engines": peers.versions(
            [t for t in args.transports if t in ("nixl", "mooncake", *peers.ENGINES)]
        ),
        "ucx": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        "argv": sys.argv[1:],
    }


def run(args: argparse.Namespace) -> int:
    """Run the sweep; returns the exit status: 2, with one line on stderr, for a ``--plot``
    without matplotlib, an output path that cannot be written, a transport whose package is
    not installed or a sweep too large for the memory available (all checked before anything
    runs)."""
    problems = [_checked_output(args.json, "--json"), _checked_output(args.plot, "--plot")]
    problems += [_unavailable(t) for t in args.transports]
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        problems.append("--plot needs matplotlib: pip install 'llmdd-async[demo]'")
    if args.plot == "-":
        problems.append("--plot needs a file name (a PNG), not '-'")
    need, free = _memory_needed(args), available_memory()
    if need > MEMORY_FRACTION * free:
        problems.append(
            f"the sweep needs about {need / 2**30:.1f} GiB, more than {MEMORY_FRACTION:.0%} of "
            f"the {free / 2**30:.1f} GiB available: lower --blocks, --concurrency or --block-kib"
        )
    for t in args.tensors:
        uneven = [str(kib) for kib in args.block_kib if (kib << 10) % t]
        if uneven:
            kibs = ", ".join(uneven)
            problems.append(f"--tensors {t} does not split a block of {kibs} KiB evenly")
    ours = [t for t in args.transports if t not in peers.ENGINES]
    if (
        ours
        and len(ours) == len(args.transports)
        and not any(_ops_of(m, args.ops) for m in args.modes)
    ):
        problems.append(
            "--modes default runs pulls only (pushes need llm.EnableRemoteCacheAccessible=1): "
            "add --ops pull or --modes remote-accessible"
        )
    problems = [p for p in problems if p]
    if problems:
        for p in problems:
            print(f"llmdd-async bench: {p}", file=sys.stderr)
        return 2
    table: TextIO = sys.stderr if args.json == "-" else sys.stdout
    combos = [
        (t, "-", "-") if t in peers.ENGINES else (t, lp, m)
        for t in args.transports
        for lp in args.loops
        for m in args.modes
    ]
    combos = list(dict.fromkeys(combos))  # a peer engine runs once, whatever the loops
    per_op = len(args.block_kib) * len(args.tensors) * len(args.blocks) * len(args.concurrency)
    points = per_op * len(args.ops)
    progress = _Progress(
        sum(per_op * len(_ops_of(m, args.ops)) if m != "-" else points for _, _, m in combos),
        sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    for transport, loop, mode in combos:
        if transport in peers.ENGINES:
            peer_rows = peers.run_worker(_peer_spec(transport, args))
            for r in peer_rows:  # one process, its own API: no mode, CPU not measured
                r.update(mode="-", cpu_us=None, peer_cpu_us=None)
            rows += peer_rows
            for _ in range(points):
                progress.step()
        else:
            rows += run_on_loop(loop, _measure, transport, loop, mode, args, progress.step)
    progress.close()
    limits = _limits(args, rows)
    for r in rows:
        size = r["blocks"] * r["block_kib"] * 1024
        r["limit"] = _limit_of(r["transport"])
        lim = limits[f"{r['limit']}_gbps"]
        r["limit_gb_per_s"] = lim
        latency_bound = r["concurrency"] == 1 and size <= _LATENCY_BOUND_BYTES
        floor = limits["floor_p50_us"].get(str(size)) if latency_bound else None
        r["floor_p50_us"] = floor
        r["latency_ratio"] = r["p50_us"] / floor if floor else None
        r["bandwidth_ratio"] = None if latency_bound else r["gb_per_s"] / lim
    cols = ["loop", "transport", "mode", "op", "block_kib", "tensors", "blocks", "concurrency"]
    cols += ["limit", "p50_us", "p99_us", "req_per_s", "gb_per_s", "latency_ratio"]
    cols += ["bandwidth_ratio", "cpu_us", "peer_cpu_us"]
    print("  ".join(f"{c:>15}" for c in cols), file=table)
    for r in rows:
        print("  ".join(_cell(r[c]) for c in cols), file=table)
    print(
        "latency_ratio: p50 over a raw request/response of the same size (one in flight); "
        "bandwidth_ratio: GB/s over the row's limit: memcpy (same-host; NIXL with a UCX "
        "shared-memory transport such as cma) or raw_socket (tcp, mooncake-raw; NIXL with "
        "UCX_TLS=tcp); cpu_us / peer_cpu_us: CPU time per request of this process and of "
        "the peer's",
        file=table,
    )
    idle = cpu_idle()
    if idle.state != "ok":  # (it moves every one-request row: say so beside them)
        print(f"cpu-idle {idle.state}: {idle.detail}; fix: {idle.fix}", file=table)
    result = {"meta": _meta(args, idle.detail), "limits": limits, "rows": rows}
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=table)
    if args.plot:
        _plot(rows, limits, args.plot)
        print(f"wrote {args.plot}", file=table)
    return 0


def _ops_of(mode: str, ops: list[str]) -> list[str]:
    """The operations a mode runs: pushes need remote-accessible mode (as upstream's push
    APIs do), so default mode runs the pulls only."""
    return [op for op in ops if mode != "default" or op != "push"]


def _unavailable(transport: str) -> str | None:
    """Why ``transport`` cannot run here (one line naming the pip install), or None."""
    if transport in peers.ENGINES:
        return peers.unavailable(transport)
    if transport == "nixl":
        from llmdd_async._transports.nixl import INSTALL_HINT, available

        if not available():
            return f"--transports nixl needs NIXL, not installed here: {INSTALL_HINT}"
    if transport == "mooncake":
        from llmdd_async._transports import mooncake

        if not mooncake.available():
            return (
                f"--transports mooncake needs Mooncake, not installed here: {mooncake.INSTALL_HINT}"
            )
    return None


def _limit_of(transport: str) -> str:
    """The limit a row of ``transport`` is held against: ``memcpy`` (one host's memory) or
    ``raw_socket`` (a loopback TCP stream). NIXL's is memcpy unless ``UCX_TLS`` leaves UCX
    no shared-memory transport (``UCX_TLS=tcp``)."""
    if transport == "same-host":
        return "memcpy"
    if transport in ("nixl", "nixl-raw"):
        tls = os.environ.get("UCX_TLS", "all").strip()
        names = {t.strip().split(":")[0] for t in tls.lstrip("^").split(",") if t.strip()}
        if tls.startswith("^") or not tls or names & _UCX_MEMORY_TLS:
            return "memcpy"
    return "raw_socket"


def _peer_spec(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "engine": engine,
        "block_kib": args.block_kib,
        "tensors": args.tensors,
        "blocks": args.blocks,
        "concurrency": args.concurrency,
        "ops": args.ops,
        "requests": args.requests[0],
    }


def _limits(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The machine's limits, measured now: a memcpy and a raw socket stream of one wave's
    bytes, and the floor of one request/response of each latency-bound request size."""
    nbytes = _limit_bytes(args)
    sizes = sorted(
        {
            r["blocks"] * r["block_kib"] * 1024
            for r in rows
            if r["concurrency"] == 1 and r["blocks"] * r["block_kib"] * 1024 <= _LATENCY_BOUND_BYTES
        }
    )
    return {
        "memcpy_gbps": statistics.median(memcpy_gbps(nbytes) for _ in range(3)),
        "raw_socket_gbps": raw_socket_gbps(nbytes),
        "limit_bytes": nbytes,
        "floor_p50_us": {str(size): raw_rpc_us(size)[0] for size in sizes},
    }


class _Progress:
    """A progress bar with an ETA on a terminal; nothing elsewhere (a log file, a pipe)."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.done, self.out = total, 0, out
        self.on = out.isatty()
        self.t0 = time.monotonic()

    def step(self) -> None:
        self.done += 1
        if not self.on:
            return
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        bar = "#" * (30 * self.done // self.total)
        self.out.write(f"\r[{bar:<30}] {self.done}/{self.total}  ETA {eta:5.0f} s")
        self.out.flush()

    def close(self) -> None:
        if self.on:
            self.out.write("\n")


def _cell(v: Any) -> str:
    if v is None:
        return f"{'-':>15}"
    return f"{v:>15.3f}" if isinstance(v, float) else f"{v!s:>15}"


def _plot(rows: list[dict[str, Any]], limits: dict[str, Any], path: str) -> None:
    """Two panels against requests in flight: p50 latency, and GB/s with the limits drawn;
    one colour per transport, one line style per loop, one marker per operation, thicker
    lines for larger requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "tcp": "tab:blue",
        "same-host": "tab:orange",
        "nixl": "tab:green",
        "nixl-raw": "tab:olive",
        "mooncake": "tab:purple",
        "mooncake-raw": "tab:red",
    }
    styles = {"asyncio": "-", "uvloop": "--", "trio": ":", "-": "-."}
    markers = {"pull": "o", "push": "s"}
    fig, (lat_ax, bw_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    series: dict[tuple[str, str, str, int, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["transport"], r["loop"], r["op"], r["blocks"], r["block_kib"], r["tensors"])
        series.setdefault(key, []).append(r)
    sizes = sorted({blocks * kib for _, _, _, blocks, kib, _ in series})
    for (transport, loop, op, blocks, kib, tensors), pts in sorted(series.items()):
        pts.sort(key=lambda r: r["concurrency"])
        style = {
            "color": colours.get(transport, "tab:gray"),
            "linestyle": styles.get(loop, "-"),
            "marker": markers.get(op, "x"),
            "linewidth": 1.0 + 1.5 * sizes.index(blocks * kib),  # thicker: larger requests
            "label": f"{transport} {loop} {op} {blocks}x{kib} KiB / {tensors} tensors",
        }
        xs = [r["concurrency"] for r in pts]
        lat_ax.plot(xs, [r["p50_us"] for r in pts], **style)
        bw_ax.plot(xs, [r["gb_per_s"] for r in pts], **style)
    bw_ax.axhline(limits["memcpy_gbps"], color=colours["same-host"], linewidth=0.8)
    bw_ax.axhline(limits["raw_socket_gbps"], color=colours["tcp"], linewidth=0.8)
    bw_ax.annotate("memcpy", (1, limits["memcpy_gbps"]), color=colours["same-host"])
    bw_ax.annotate("raw socket", (1, limits["raw_socket_gbps"]), color=colours["tcp"])
    for ax, label in ((lat_ax, "p50 latency (µs)"), (bw_ax, "GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = lat_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.12 + 0.02 * (len(labels) // 4), 1, 1))
    fig.savefig(path)
