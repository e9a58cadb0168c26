"""llmdd_async against Mooncake Transfer Engine and NIXL on the same workloads, in the same run.

Every engine moves the same bytes between two OS processes on 127.0.0.1: an initiator READs
(pulls) from a target. Both sides' memory is allocated by the user: ``--tensors`` numpy arrays
of ``--blocks`` blocks each, a block being 64 KiB over all tensors, one span of ``64 KiB /
tensors`` per tensor. The default, one tensor, makes every block one contiguous 64 KiB span
(as throughput.py's pool rows); ``--tensors 2`` is ``llmdd-async bench``'s layout (K and V
halves, two 32 KiB spans per block, twice the descriptors). Workloads:

* ``1-block``: ``--small`` sequential requests of one block (random source and destination):
  p50 / p99 latency;
* ``64x16``: waves of ``--concurrency`` requests of ``--per-request`` shuffled blocks each, all
  in flight at once (``--waves`` waves): requests/s and GB/s (``--per-request 1``: many small
  requests in flight);
* ``bulk``: all ``--blocks`` blocks in one request in shuffled order (256 MiB by default):
  GB/s, median of ``--repeat`` runs.

Engines (each run in its own initiator process, which starts its own target process):

* ``llmdd-async``: ``llm.Transport`` tcp and same-host x asyncio, uvloop and trio; remote-accessible
  mode (``llm.EnableRemoteCacheAccessible=1``), ``pull_blocks`` by ``BlocksCacheKey`` between
  caches registered with ``register_blocks_cache``; requests in flight are the ``CacheTask``
  objects that ``pull_blocks`` returns, awaited after all are issued;
* ``mooncake``: Mooncake Transfer Engine, TCP protocol, P2P handshake (no metadata server);
  ``batch_transfer_sync_read`` per request, ``batch_transfer_async_read`` +
  ``get_batch_transfer_status`` for requests in flight; ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
  raised so that a whole bulk batch is admitted;
* ``nixl``: NIXL over UCX with ``UCX_NET_DEVICES=lo`` and ``UCX_TLS=cma,tcp,self`` (same-host
  cross-memory attach) or ``UCX_TLS=tcp``; descriptor lists prepared once
  (``prep_xfer_dlist``), then per request ``make_prepped_xfer``, ``transfer`` and a busy
  ``check_xfer_state`` loop (as NIXL's examples do; it burns a core while it waits).

The peers' address or index lists are computed before the timed sections (what a framework
caches); ours are plain block lists built before timing too. Every engine's bulk result is
checked byte for byte against the target's data.

CPU per request, for the 1-block and the in-flight workloads, of each process: the initiator's
``time.process_time`` and the target's (ours: its own ``time.process_time``, asked for over the
test kit's control pipe; the peers': the sum over its threads of ``/proc/<pid>/task/*/schedstat``,
the scheduler's nanoseconds on a CPU). It is what a serving engine's workers pay beside their
model. NIXL's initiator figures include its busy ``check_xfer_state`` loop.

Every round also measures the machine's limits: ``numpy.copyto`` of the bulk size (memcpy,
the limit for same-host paths), a raw blocking loopback TCP stream between two processes (the
limit for TCP paths) and a raw blocking 64 KiB request/response between two processes (the
limit for one-block latency). Rounds interleave the engines (A, B, C, ... rotated each round:
the machine is small and shared, so its noise lands on every engine alike) and the tables
show medians over rounds; ratios are medians of the per-round ratios.

The engines' drivers are ``llmdd_async.bench.peers``'s, which ``llmdd-async bench
--transports nixl-raw,mooncake-raw`` runs on the bench's own sweep.

An engine that is not installed gets a "not installed" row and the rest still runs. Install:
``pip install mooncake-transfer-engine-non-cuda`` (needs Debian ``libibverbs1 librdmacm1
libnuma1``) and ``pip install --no-deps nixl-cu12``.

Run: ``python benchmarks/peers.py [--rounds N] [--engines ours,mooncake,nixl] [--json PATH]``.
Issue 10 targets: one-block p50 <= 250 us, p99 <= 1 ms; 64x16 in flight >= 0.6 x the raw
socket (tcp), >= 0.3 x memcpy (same-host) and >= 1.5 x Mooncake's requests/s.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from _common import (
    csv_of,
    memcpy_gbps,
    parser,
    positive_int,
    print_table,
    raw_socket_gbps,
    write_json,
)

# The engines' drivers live in the installed package, shared with ``llmdd-async bench
# --transports nixl-raw,mooncake-raw``.
from llmdd_async.bench.peers import Layout, Mooncake, Nixl, local_arrays, nixl_api
from llmdd_async.bench.peers import target_data as _target_data

BLOCK = 64 << 10
SEED = 11  # the targets' data: tensor t holds llmdd_async.testing.pattern(SEED + t, ...)
MARK = "PEERS-RESULT "
UCX_TLS = {"cma": "cma,tcp,self", "tcp": "tcp"}


@dataclass
class Sizes:
    blocks: int
    tensors: int
    small: int
    concurrency: int
    per_request: int
    waves: int
    repeat: int

    @property
    def span(self) -> int:
        return BLOCK // self.tensors

    @property
    def total(self) -> int:
        return self.blocks * BLOCK


@dataclass
class Plan:
    """The block lists of one round, the same for every engine."""

    small: list[tuple[int, int]]
    waves: list[list[tuple[list[int], list[int]]]]
    bulk_src: list[int]
    bulk_dst: list[int]

    @classmethod
    def make(cls, sz: Sizes, seed: int) -> Plan:
        rng = np.random.default_rng(seed)
        small = [(int(s), int(d)) for s, d in rng.integers(sz.blocks, size=(sz.small, 2))]
        waves = []
        for _ in range(sz.waves + 1):  # the first wave is the warm-up
            wave = []
            for slot in range(sz.concurrency):
                src = rng.permutation(sz.blocks)[: sz.per_request]
                dst = (slot * sz.per_request + np.arange(sz.per_request)) % sz.blocks
                wave.append((src.tolist(), dst.tolist()))
            waves.append(wave)
        perm = rng.permutation(sz.blocks).tolist()
        return cls(small, waves, perm, list(range(sz.blocks)))


def layout(sz: Sizes) -> Layout:
    return Layout(sz.blocks, sz.tensors, sz.span)


def target_data(sz: Sizes) -> list[np.ndarray]:
    return _target_data(layout(sz), SEED)


def verify(local: list[np.ndarray], sz: Sizes, plan: Plan) -> None:
    """After the last bulk pull, local block ``bulk_dst[i]`` must hold source block
    ``bulk_src[i]`` in every tensor."""
    src = np.asarray(plan.bulk_src)
    dst = np.asarray(plan.bulk_dst)
    for got, want in zip(local, target_data(sz), strict=True):
        if not np.array_equal(got[dst], want[src]):
            raise RuntimeError("bulk data differs from the target's")


#: CPU seconds per request of (initiator, target), per workload: "one" (1-block), "conc"
_CPU_KEYS = {"one": ("cpu_us", "peer_cpu_us"), "conc": ("conc_cpu_us", "conc_peer_cpu_us")}


def summarize(
    lat: list[float],
    waves: list[float],
    bulk: list[float],
    sz: Sizes,
    cpu: dict[str, tuple[float, float | None]],
) -> dict[str, Any]:
    """The figures of one engine's run; ``cpu``: per workload, the CPU seconds the initiator
    and the target (None: unknown) spent on all its requests."""
    req_s = sz.concurrency * len(waves) / sum(waves)
    out: dict[str, float | None] = {
        "p50_us": float(np.percentile(lat, 50) * 1e6),
        "p99_us": float(np.percentile(lat, 99) * 1e6),
        "req_per_s": req_s,
        "conc_gbps": req_s * sz.per_request * BLOCK / 1e9,
        "bulk_gbps": sz.total / statistics.median(bulk) / 1e9,
    }
    count = {"one": len(lat), "conc": sz.concurrency * len(waves)}
    for work, (mine, theirs) in cpu.items():
        ours_key, peer_key = _CPU_KEYS[work]
        out[ours_key] = mine / count[work] * 1e6
        out[peer_key] = None if theirs is None else theirs / count[work] * 1e6
    return out


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` spent so far, over all its threads (the scheduler's
    nanosecond count: ``/proc/<pid>/stat``'s ticks are too coarse for a few hundred
    requests); None where the kernel does not say."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            path = f"/proc/{pid}/task/{task}/schedstat"
            with contextlib.suppress(FileNotFoundError), open(path) as f:  # (a thread ended)
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def _spent(
    mine0: float, theirs0: float | None, theirs1: float | None
) -> tuple[float, float | None]:
    """(this process's, the target's) CPU seconds since ``mine0`` / ``theirs0`` (this
    process's ``time.process_time`` then, the target's CPU seconds then and now)."""
    theirs = None if theirs0 is None or theirs1 is None else theirs1 - theirs0
    return time.process_time() - mine0, theirs


def run_sync(drv: Any, sz: Sizes, plan: Plan) -> dict[str, Any]:
    """The three workloads through a blocking driver (``prepare``, ``one``, ``many``)."""
    small = [drv.prepare([s], [d]) for s, d in plan.small]
    waves = [[drv.prepare(s, d) for s, d in wave] for wave in plan.waves]
    bulk = drv.prepare(plan.bulk_src, plan.bulk_dst)
    drv.many([bulk])  # warm-up: connections, first touch on the target's side
    for p in small[:20]:
        drv.one(p)
    target = drv.proc.pid
    cpu = {}
    lat = []
    mine0, theirs0 = time.process_time(), process_cpu_s(target)
    for p in small:
        t0 = time.perf_counter()
        drv.one(p)
        lat.append(time.perf_counter() - t0)
    cpu["one"] = _spent(mine0, theirs0, process_cpu_s(target))
    drv.many(waves[0])  # the first wave is the warm-up
    wave_t = []
    mine0, theirs0 = time.process_time(), process_cpu_s(target)
    for wave in waves[1:]:
        t0 = time.perf_counter()
        drv.many(wave)
        wave_t.append(time.perf_counter() - t0)
    cpu["conc"] = _spent(mine0, theirs0, process_cpu_s(target))
    bulk_t = []
    for _ in range(sz.repeat):
        t0 = time.perf_counter()
        drv.many([bulk])
        bulk_t.append(time.perf_counter() - t0)
    verify(drv.local, sz, plan)
    return summarize(lat, wave_t, bulk_t, sz, cpu)


# ------------------------------------------------------------------------------ llmdd_async
async def run_ours(transport: str, loop: str, sz: Sizes, plan: Plan) -> dict[str, Any]:
    import llmdd_async as dd
    from llmdd_async.testing import PeerProcess, encode_key

    key = dd.BlocksCacheKey(1, 0)
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.Transport": transport,
        "llm.SyncKvCacheWaitTime": "60000",
        "llm.MemPoolConfig": json.dumps({"memory_size": 64 << 20}),  # user memory only
    }
    peer_opts = {**opts, "llm.listenIpInfo": "127.0.0.1:0"}
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, peer_opts, loop, fork=False) as peer:
        await peer.request(
            "register",
            kind="blocks",
            num_tensors=sz.tensors,
            shape=[sz.blocks, sz.span],
            blocks_key=encode_key(key),
            seed=SEED,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            code, _ = await d.link_clusters([peer.cluster_info()], 10000)
            if code != dd.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link failed: {code!r}")
            cm = d.cache_manager
            local = local_arrays(layout(sz))
            cache = cm.register_blocks_cache(
                dd.CacheDesc(sz.tensors, [sz.blocks, sz.span], dd.DataType.DT_UINT8), local
            )

            async def many(reqs: list[tuple[list[int], list[int]]]) -> None:
                tasks = [cm.pull_blocks(key, cache, s, dst) for s, dst in reqs]
                for task in tasks:
                    await task

            await many([(plan.bulk_src, plan.bulk_dst)])  # warm-up
            for s, dst in plan.small[:20]:
                await cm.pull_blocks(key, cache, [s], [dst])
            cpu = {}
            lat = []
            mine0, theirs0 = time.process_time(), await peer.request("cpu_seconds")
            for s, dst in plan.small:
                t0 = time.perf_counter()
                await cm.pull_blocks(key, cache, [s], [dst])
                lat.append(time.perf_counter() - t0)
            # (the figures include one cpu_seconds request and answer: some microseconds)
            cpu["one"] = _spent(mine0, theirs0, await peer.request("cpu_seconds"))
            await many(plan.waves[0])  # the first wave is the warm-up
            wave_t = []
            mine0, theirs0 = time.process_time(), await peer.request("cpu_seconds")
            for wave in plan.waves[1:]:
                t0 = time.perf_counter()
                await many(wave)
                wave_t.append(time.perf_counter() - t0)
            cpu["conc"] = _spent(mine0, theirs0, await peer.request("cpu_seconds"))
            bulk_t = []
            for _ in range(sz.repeat):
                t0 = time.perf_counter()
                await many([(plan.bulk_src, plan.bulk_dst)])
                bulk_t.append(time.perf_counter() - t0)
            used = d.link_statistics(1).transport
    verify(local, sz, plan)
    return {**summarize(lat, wave_t, bulk_t, sz, cpu), "path": used}


# ------------------------------------------------------------------------------ workers
@dataclass
class Config:
    engine: str  # llmdd-async, mooncake, nixl
    transport: str  # tcp / same-host (ours), tcp (mooncake), cma / tcp (nixl's UCX_TLS)
    loop: str  # asyncio / uvloop / trio for ours, "-" for the peers
    kind: str  # tcp or same-host: which limit applies

    @property
    def name(self) -> str:
        if self.engine == "nixl":
            return f"nixl UCX_TLS={UCX_TLS[self.transport]}"
        if self.engine == "mooncake":
            return "mooncake tcp"
        return f"llmdd-async {self.transport} {self.loop}"

    def env(self, sz: Sizes) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        if self.engine == "mooncake":
            # A whole bulk batch (blocks x tensors transfers) must be admitted, or Mooncake's
            # TCP lanes reject it as queue-full.
            queued = max(1024, 2 * sz.blocks * sz.tensors, sz.concurrency * sz.per_request * 2)
            env.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(min(queued, 65535)))
            env.setdefault("GLOG_minloglevel", "1")
        if self.engine == "nixl":
            env.update(UCX_NET_DEVICES="lo", UCX_TLS=UCX_TLS[self.transport])
        return env


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine's three workloads (in this process, with its own target process)."""
    cfg = Config(**spec["config"])
    sz = Sizes(**spec["sizes"])
    plan = Plan.make(sz, spec["seed"])
    if cfg.engine == "llmdd-async":
        import anyio

        if cfg.loop == "trio":
            return anyio.run(run_ours, cfg.transport, cfg.loop, sz, plan, backend="trio")
        opts = {"use_uvloop": True} if cfg.loop == "uvloop" else {}
        return anyio.run(
            run_ours, cfg.transport, cfg.loop, sz, plan, backend="asyncio", backend_options=opts
        )
    drv = (Mooncake if cfg.engine == "mooncake" else Nixl)(layout(sz), SEED)
    try:
        out = run_sync(drv, sz, plan)
    finally:
        drv.close()
    return {**out, "path": cfg.transport}


def probe(engine: str) -> list[str]:
    """``[]`` when ``engine`` can be imported here, else ``[status, why]``."""
    try:
        if engine == "mooncake":
            importlib.import_module("mooncake.engine")
        elif engine == "nixl":
            nixl_api()
    except ImportError as exc:
        return ["not installed", str(exc)]
    except OSError as exc:  # a shared library it needs is missing
        return ["not loadable", str(exc)]
    return []


def run_child(args: list[str], env: dict[str, str], timeout: float) -> tuple[Any, str]:
    """Run this script with ``args``; returns (the JSON after MARK, or None; an error text)."""
    try:
        out = subprocess.run(
            [sys.executable, __file__, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :]), ""
    lines = (out.stderr or out.stdout).strip().splitlines()
    return None, f"failed (exit {out.returncode}): {lines[-1] if lines else ''}"


# ------------------------------------------------------------------------------ limits
@contextlib.contextmanager
def _rpc_child(script: str, size: int) -> Iterator[socket.socket]:
    """A child process running ``script`` (a request/response server for ``size``-byte
    replies, told a CPU to run on or -1) connected to us: yields our end of the connection.
    Each end runs on a CPU of its own while it lasts (``limits.two_ends``: the blocking
    floor's reason)."""
    from llmdd_async.bench.limits import two_ends

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with contextlib.closing(listener), two_ends() as cpu:
        child = subprocess.Popen([sys.executable, "-c", script, str(port), str(size), str(cpu)])
        try:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                yield conn
        finally:
            listener.close()
            child.wait(timeout=30)


def _p50_p99_us(lat: list[float]) -> tuple[float, float]:
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def raw_rpc_us(n: int, size: int = BLOCK) -> tuple[float, float]:
    """A raw blocking request/response between two processes (8-byte request, ``size``-byte
    reply into a numpy buffer): p50 and p99 in microseconds (``llmdd-async bench``'s floor)."""
    from llmdd_async.bench.limits import raw_rpc_us as floor

    return floor(size, n)


_AIO_RPC_SERVER = """
import asyncio, os, socket, sys
import numpy as np
port, size, cpu = map(int, sys.argv[1:])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
async def main():
    loop = asyncio.get_running_loop()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    payload = memoryview(np.ones(size, np.uint8))
    req = bytearray(8)
    while True:
        got = 0
        while got < 8:
            k = await loop.sock_recv_into(s, memoryview(req)[got:])
            if k == 0:
                return
            got += k
        await loop.sock_sendall(s, payload)
asyncio.run(main())
"""


def asyncio_rpc_us(n: int, size: int = BLOCK) -> tuple[float, float]:
    """:func:`raw_rpc_us` with both ends on a plain asyncio loop (``sock_recv_into`` /
    ``sock_sendall``, nothing else): the floor of any asyncio-native request/response here.
    p50 and p99 in microseconds."""
    import asyncio

    view = memoryview(np.empty(size, np.uint8))
    lat: list[float] = []

    async def client(conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for i in range(n + 20):
            t0 = time.perf_counter()
            await loop.sock_sendall(conn, b"\0" * 8)
            got = 0
            while got < size:
                k = await loop.sock_recv_into(conn, view[got:])
                if k == 0:
                    raise RuntimeError("asyncio request/response: peer closed")
                got += k
            if i >= 20:
                lat.append(time.perf_counter() - t0)

    with _rpc_child(_AIO_RPC_SERVER, size) as conn:
        conn.setblocking(False)
        asyncio.run(client(conn))
    return _p50_p99_us(lat)


_LIMIT_KEYS = (
    "memcpy_gbps",
    "socket_gbps",
    "rpc_p50_us",
    "rpc_p99_us",
    "aio_rpc_p50_us",
    "aio_rpc_p99_us",
)


def measure_limits(sz: Sizes) -> dict[str, float]:
    p50, p99 = raw_rpc_us(max(sz.small, 50))
    a50, a99 = asyncio_rpc_us(max(sz.small, 50))
    return {
        "memcpy_gbps": memcpy_gbps(sz.total, repeat=3),
        "socket_gbps": raw_socket_gbps(max(sz.total, 16 << 20), repeat=1),
        "rpc_p50_us": p50,
        "rpc_p99_us": p99,
        "aio_rpc_p50_us": a50,
        "aio_rpc_p99_us": a99,
    }


# ------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "peers")
    p.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (medians)")
    p.add_argument(
        "--engines",
        type=csv_of("ours", "mooncake", "nixl"),
        default="ours,mooncake,nixl",
        help="engines to run, comma-separated (ours = llmdd_async)",
    )
    p.add_argument(
        "--transports",
        type=csv_of("tcp", "same-host"),
        default="tcp,same-host",
        help="llm.Transport values for llmdd_async",
    )
    p.add_argument(
        "--loops",
        type=csv_of("asyncio", "uvloop", "trio"),
        default="asyncio,uvloop,trio",
        help="event loops for llmdd_async",
    )
    p.add_argument(
        "--ucx", type=csv_of("cma", "tcp"), default="cma,tcp", help="NIXL's UCX_TLS modes"
    )
    p.add_argument("--blocks", type=positive_int, default=4096, help="blocks of 64 KiB (bulk)")
    p.add_argument(
        "--tensors", type=positive_int, default=1, help="tensors a 64 KiB block is split over"
    )
    p.add_argument("--small", type=positive_int, default=300, help="sequential 1-block requests")
    p.add_argument("--concurrency", type=positive_int, default=64, help="requests in flight")
    p.add_argument("--per-request", type=positive_int, default=16, help="blocks per request")
    p.add_argument("--waves", type=positive_int, default=5, help="waves of requests in flight")
    p.add_argument("--repeat", type=positive_int, default=3, help="bulk runs per round")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per engine and round")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p


def configs(args: argparse.Namespace) -> list[Config]:
    out = []
    if "ours" in args.engines:
        for t in args.transports:
            for lp in args.loops:
                out.append(Config("llmdd-async", t, lp, t))
    if "mooncake" in args.engines:
        out.append(Config("mooncake", "tcp", "-", "tcp"))
    if "nixl" in args.engines:
        for u in args.ucx:
            out.append(Config("nixl", u, "-", "same-host" if u == "cma" else "tcp"))
    return out


#: CPU microseconds per request: this process (the initiator) and the target, per workload
_CPU_COLS = ("cpu_us", "peer_cpu_us", "conc_cpu_us", "conc_peer_cpu_us")


def _both(run: dict[str, Any], work: str) -> float | None:
    """CPU microseconds per request of both processes together (None: one is unknown)."""
    mine, theirs = (run.get(k) for k in _CPU_KEYS[work])
    return None if mine is None or theirs is None else mine + theirs


def _med(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        if spec.get("probe"):
            print(MARK + json.dumps(probe(spec["probe"])))
            return
        print(MARK + json.dumps(worker(spec)), flush=True)
        return
    if BLOCK % args.tensors:
        p.error(f"--tensors must divide {BLOCK}")
    sz = Sizes(
        args.blocks,
        args.tensors,
        args.small,
        args.concurrency,
        args.per_request,
        args.waves,
        args.repeat,
    )
    cfgs = configs(args)
    status: dict[str, str] = {}  # engine -> why it does not run ("" or absent: it runs)
    detail: dict[str, str] = {}
    for engine in sorted({c.engine for c in cfgs} - {"llmdd-async"}):
        got, err = run_child(["--worker", json.dumps({"probe": engine})], dict(os.environ), 120)
        if err or got:
            status[engine], detail[engine] = ("probe failed", err) if err else got
            print(f"{engine}: {status[engine]} ({detail[engine]})", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cfgs}
    errors: dict[str, list[str]] = {c.name: [] for c in cfgs}
    limits: list[dict[str, float]] = []
    live = [c for c in cfgs if not status.get(c.engine)]
    for rnd in range(args.rounds):
        lim = measure_limits(sz)
        limits.append(lim)
        order = live[rnd % len(live) :] + live[: rnd % len(live)] if live else []
        for cfg in order:
            print(f"round {rnd + 1}/{args.rounds}: {cfg.name}", file=sys.stderr, flush=True)
            spec = {"config": asdict(cfg), "sizes": asdict(sz), "seed": rnd}
            got, err = run_child(["--worker", json.dumps(spec)], cfg.env(sz), args.timeout)
            if got is None:
                errors[cfg.name].append(f"round {rnd + 1}: {err}")
                print(f"  {err}", file=sys.stderr)
                continue
            got["round"] = rnd
            got["limits"] = lim
            runs[cfg.name].append(got)
    rows, ratios = tabulate(cfgs, runs, status, errors, args.rounds)
    lim_row = {k: _med([lim[k] for lim in limits]) for k in _LIMIT_KEYS}
    print(
        f"\n{args.blocks} blocks of 64 KiB over {args.tensors} tensors per side "
        f"({sz.total >> 20} MiB), two processes on 127.0.0.1, {args.rounds} interleaved rounds; "
        "medians over rounds"
    )
    print_table(
        "machine limits measured in the same run (memcpy = numpy.copyto of the bulk size; "
        "socket = raw blocking loopback stream; rpc = raw blocking 64 KiB request/response; "
        "aio_rpc = the same on plain asyncio at both ends)",
        [lim_row],
        list(_LIMIT_KEYS),
    )
    print_table(
        f"absolute figures: 1-block p50/p99; {args.concurrency}x{args.per_request} in flight "
        f"(req/s, GB/s); bulk shuffled (GB/s); x_rpc / x_aio: p50 / rpc p50 and / aio_rpc "
        "p50; x_limit: GB/s / limit (memcpy for same-host, socket for tcp)",
        rows,
        [
            "engine",
            "status",
            "path",
            "p50_us",
            "p99_us",
            "p50_x_rpc",
            "p50_x_aio",
            "req_per_s",
            "conc_gbps",
            "conc_x_limit",
            "bulk_gbps",
            "bulk_x_limit",
        ],
    )
    print_table(
        "CPU microseconds per request of each process: the initiator (cpu_us) and the target "
        f"(peer_cpu_us), for the 1-block requests and the {args.concurrency}x"
        f"{args.per_request} in flight (conc_); NIXL's initiator spins on check_xfer_state",
        rows,
        ["engine", "status", *_CPU_COLS],
    )
    if ratios:
        print_table(
            "ours / theirs (median of per-round ratios; p50/p99: lower is better, req/s and bulk: "
            "higher is better; cpu / conc_cpu: both processes' CPU per request, lower is better)",
            ratios,
            [
                "ours",
                "theirs",
                "p50",
                "p99",
                "req_per_s",
                "conc_gbps",
                "bulk_gbps",
                "cpu",
                "conc_cpu",
            ],
        )
    out = write_json(
        "peers",
        {
            "sizes": asdict(sz),
            "rounds": args.rounds,
            "limits": lim_row,
            "limits_per_round": limits,
            "rows": rows,
            "ratios": ratios,
            "runs": runs,
            "errors": errors,
            "unavailable": {k: [v, detail[k]] for k, v in status.items()},
        },
        args.json,
    )
    print(f"\nwrote {out}")


def tabulate(
    cfgs: list[Config],
    runs: dict[str, list[dict[str, Any]]],
    status: dict[str, str],
    errors: dict[str, list[str]],
    rounds: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = []
    for c in cfgs:
        rs = runs[c.name]
        row: dict[str, Any] = {"engine": c.name, "kind": c.kind}
        if not rs:
            row["status"] = status.get(c.engine) or "failed"
            row["error"] = "; ".join(errors[c.name]) or None
            rows.append(row)
            continue
        row["status"] = "ok" if len(rs) == rounds else f"{len(rs)}/{rounds} rounds ok"
        row["path"] = rs[0]["path"]
        for k in ("p50_us", "p99_us", "req_per_s", "conc_gbps", "bulk_gbps", *_CPU_COLS):
            row[k] = _med([r.get(k) for r in rs])
        lim = "memcpy_gbps" if c.kind == "same-host" else "socket_gbps"
        row["p50_x_rpc"] = _med([r["p50_us"] / r["limits"]["rpc_p50_us"] for r in rs])
        row["p50_x_aio"] = _med([r["p50_us"] / r["limits"]["aio_rpc_p50_us"] for r in rs])
        row["conc_x_limit"] = _med([r["conc_gbps"] / r["limits"][lim] for r in rs])
        row["bulk_x_limit"] = _med([r["bulk_gbps"] / r["limits"][lim] for r in rs])
        rows.append(row)
    ratios = []
    ours = [c for c in cfgs if c.engine == "llmdd-async"]
    theirs = [c for c in cfgs if c.engine != "llmdd-async"]
    for a in ours:
        for b in theirs:
            ra, rb = runs[a.name], runs[b.name]
            row = {"ours": a.name, "theirs": b.name}
            pairs = [(x, y) for x in ra for y in rb if x["round"] == y["round"]]
            if not pairs:
                row["p50"] = "n/a (" + (status.get(b.engine) or "no result") + ")"
                ratios.append(row)
                continue
            for k in ("p50", "p99"):
                row[k] = _med([x[f"{k}_us"] / y[f"{k}_us"] for x, y in pairs])
            for k in ("req_per_s", "conc_gbps", "bulk_gbps"):
                row[k] = _med([x[k] / y[k] for x, y in pairs])
            for k, work in (("cpu", "one"), ("conc_cpu", "conc")):
                both = [(_both(x, work), _both(y, work)) for x, y in pairs]
                row[k] = _med([u / v for u, v in both if u is not None and v])
            ratios.append(row)
    return rows, ratios


if __name__ == "__main__":
    main()
