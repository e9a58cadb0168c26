"""The peer engines through their own Python APIs, for ``llmdd-async bench --transports
nixl-raw,mooncake-raw`` and ``benchmarks/peers.py``: the same workloads as ours, on memory
the user allocated (numpy arrays, registered with the engine), between two OS processes.

* ``nixl-raw``: NIXL's agent API (``nixl_agent``, UCX backend, UCX as the environment
  configures it, e.g. ``UCX_NET_DEVICES=lo UCX_TLS=cma,tcp,self``): descriptor lists prepared
  once (``prep_xfer_dlist``), then per request ``make_prepped_xfer``, ``transfer`` and a busy
  ``check_xfer_state`` loop (as NIXL's examples do; it burns a core while it waits);
* ``mooncake-raw``: Mooncake Transfer Engine, TCP protocol, P2P handshake (no metadata
  server): ``batch_transfer_sync_read``/``_write`` per request, ``batch_transfer_async_*`` and
  ``get_batch_transfer_status`` for requests in flight (which returns when the whole wave is
  done: a request's latency in flight is its wave's).

The bench runs each engine in a worker process (``python -m llmdd_async.bench.peers SPEC``)
that starts its target process, so that an engine's crash or its logging cannot take the bench
down with it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ENGINES",
    "INSTALL",
    "Layout",
    "Mooncake",
    "Nixl",
    "local_arrays",
    "nixl_api",
    "run_worker",
    "target_data",
    "unavailable",
    "versions",
]

#: the bench's names of the peer engines, and the driver each uses
ENGINES = ("nixl-raw", "mooncake-raw")
#: how to install each engine
INSTALL = {
    "nixl-raw": "pip install --no-deps nixl-cu12",
    "mooncake-raw": (
        "pip install mooncake-transfer-engine-non-cuda "
        "(with Debian's libibverbs1 librdmacm1 libnuma1)"
    ),
}
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_DISTRIBUTIONS = {
    "nixl": ("nixl", "nixl-cu12", "nixl-cu13"),  # ours over llm.Transport=nixl
    "nixl-raw": ("nixl", "nixl-cu12", "nixl-cu13"),
    "mooncake": ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),  # ours
    "mooncake-raw": ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
}
MARK = "LLMDD-PEER-ROWS "


@dataclass
class Layout:
    """Both sides' memory: ``tensors`` arrays of ``blocks`` blocks, ``span`` bytes of each
    block per tensor."""

    blocks: int
    tensors: int
    span: int


def target_data(lay: Layout, seed: int) -> list[np.ndarray]:
    """The target's arrays: tensor ``t`` holds ``llmdd_async.testing.pattern(seed + t, ...)``."""
    from llmdd_async.testing import pattern

    return [
        pattern(seed + t, lay.blocks * lay.span).reshape(lay.blocks, lay.span)
        for t in range(lay.tensors)
    ]


def local_arrays(lay: Layout) -> list[np.ndarray]:
    """The initiator's arrays, every page touched."""
    return [np.full((lay.blocks, lay.span), 1, np.uint8) for _ in range(lay.tensors)]


def unavailable(engine: str) -> str | None:
    """Why ``engine`` cannot run here, as one line naming its install, or None."""
    if engine == "nixl-raw":
        if not any(_found(m.split(".")[0]) for m in NIXL_MODULES):
            return f"--transports nixl-raw needs NIXL, not installed here: {INSTALL[engine]}"
        return None
    if engine == "mooncake-raw":
        if not _found("mooncake"):
            return (
                "--transports mooncake-raw needs Mooncake Transfer Engine, not installed here: "
                + INSTALL[engine]
            )
        try:
            importlib.import_module("mooncake.engine")
        except (ImportError, OSError) as exc:  # e.g. a shared library it needs is missing
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"--transports mooncake-raw: Mooncake does not load ({why}): {INSTALL[engine]}"
        return None
    raise ValueError(f"unknown peer engine {engine!r}")


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def versions(engines: list[str]) -> dict[str, str | None]:
    """The installed version of each engine's package (None where not found)."""
    out: dict[str, str | None] = {}
    for e in engines:
        out[e] = None
        for dist in _DISTRIBUTIONS.get(e, ()):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                out[e] = f"{dist} {importlib.metadata.version(dist)}"
                break
    return out


# ------------------------------------------------------------------------------ Mooncake TE
def _mooncake_target(conn: Any, lay: Layout, seed: int) -> None:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    data = target_data(lay, seed)
    for a in data:
        rc = rc or te.register_memory(a.ctypes.data, a.nbytes)
    conn.send((rc, te.get_rpc_port(), [a.ctypes.data for a in data]))
    conn.recv()


def mooncake_env(blocks: int, tensors: int, in_flight: int) -> None:
    """Mooncake's settings for a run (set before its engines start): a whole batch of
    ``blocks x tensors`` transfers, or ``in_flight`` at once, must be admitted, or its TCP
    lanes reject it as queue-full; glog at WARNING."""
    queued = max(1024, 2 * blocks * tensors, 2 * in_flight)
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(min(queued, 65535)))
    os.environ.setdefault("GLOG_minloglevel", "1")


#: one Mooncake request: local addresses, remote addresses, lengths
_McReq = tuple[list[int], list[int], list[int]]
_MC_OPS = {"pull": "read", "push": "write"}


class Mooncake:
    """Mooncake Transfer Engine, TCP, P2P handshake, between registered numpy arrays."""

    def __init__(self, lay: Layout, seed: int = 11) -> None:
        from mooncake.engine import TransferEngine

        self.lay = lay
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_mooncake_target, args=(child, lay, seed), daemon=True)
        self.proc.start()
        self.te = TransferEngine()
        if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake initialize failed")
        self.local = local_arrays(lay)
        for a in self.local:
            if self.te.register_memory(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("Mooncake register_memory failed")
        rc, port, raddrs = self.conn.recv()
        if rc != 0:
            raise RuntimeError(f"Mooncake target failed to start: {rc}")
        self.peer = f"127.0.0.1:{port}"
        self.raddrs = np.array(raddrs, np.uint64)
        self.laddrs = np.array([a.ctypes.data for a in self.local], np.uint64)

    def prepare(self, src: list[int], dst: list[int]) -> _McReq:
        """Remote blocks ``src`` and local blocks ``dst`` as (local, remote, lengths)."""
        span = np.uint64(self.lay.span)
        s = np.asarray(src, np.uint64)[:, None] * span + self.raddrs[None, :]
        d = np.asarray(dst, np.uint64)[:, None] * span + self.laddrs[None, :]
        return d.ravel().tolist(), s.ravel().tolist(), [self.lay.span] * d.size

    def one(self, p: _McReq, op: str = "pull") -> None:
        rc = getattr(self.te, f"batch_transfer_sync_{_MC_OPS[op]}")(self.peer, *p)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync ({op}): {rc}")

    def many(self, ps: list[_McReq], op: str = "pull") -> list[float]:
        """All of ``ps`` in flight at once; the time each is known done (its wave's end)."""
        post = getattr(self.te, f"batch_transfer_async_{_MC_OPS[op]}")
        ids = [post(self.peer, *p) for p in ps]
        if 0 in ids:
            raise RuntimeError(f"Mooncake batch_transfer_async ({op}) failed")
        rc = self.te.get_batch_transfer_status(ids)
        if rc != 0:
            raise RuntimeError(f"Mooncake get_batch_transfer_status: {rc}")
        return [time.perf_counter()] * len(ps)

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


# ------------------------------------------------------------------------------ NIXL
def nixl_api() -> Any:
    """NIXL's ``_api`` module (its logger at WARNING unless ``NIXL_LOG_LEVEL`` is set)."""
    errors = []
    for name in NIXL_MODULES:
        saved = logging.raiseExceptions
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        finally:
            logging.raiseExceptions = saved
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise ImportError("; ".join(errors))


def _nixl_rows(addrs: list[int], lay: Layout) -> np.ndarray:
    """Descriptor ``b * tensors + t``: block ``b`` of tensor ``t``."""
    rows = np.zeros((lay.blocks, lay.tensors, 3), np.uint64)
    rows[:, :, 0] = np.asarray(addrs, np.uint64)[None, :] + (
        np.arange(lay.blocks, dtype=np.uint64)[:, None] * np.uint64(lay.span)
    )
    rows[:, :, 1] = lay.span
    return rows.reshape(-1, 3)


def _nixl_regions(arrays: list[np.ndarray]) -> np.ndarray:
    return np.array([[a.ctypes.data, a.nbytes, 0] for a in arrays], np.uint64)


def _nixl_target(conn: Any, lay: Layout, seed: int) -> None:
    api = nixl_api()
    agent = api.nixl_agent(f"peer-target-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
    data = target_data(lay, seed)
    agent.register_memory(_nixl_regions(data), "DRAM")
    conn.send((agent.get_agent_metadata(), [a.ctypes.data for a in data]))
    conn.recv()


class Nixl:
    """NIXL's Python API: prepared descriptor lists, transfers by index, busy polling."""

    def __init__(self, lay: Layout, seed: int = 11) -> None:
        api = nixl_api()
        self.lay = lay
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_nixl_target, args=(child, lay, seed), daemon=True)
        self.proc.start()
        self.agent = api.nixl_agent(
            f"peer-initiator-{os.getpid()}", api.nixl_agent_config(backends=["UCX"])
        )
        self.local = local_arrays(lay)
        self.agent.register_memory(_nixl_regions(self.local), "DRAM")
        md, raddrs = self.conn.recv()
        peer = self.agent.add_remote_agent(md)
        laddrs = [a.ctypes.data for a in self.local]
        self.lside = self.agent.prep_xfer_dlist("", _nixl_rows(laddrs, lay), "DRAM")
        self.rside = self.agent.prep_xfer_dlist(peer, _nixl_rows(raddrs, lay), "DRAM")
        self.per = np.arange(lay.tensors, dtype=np.int32)[None, :]

    def prepare(self, src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Remote blocks ``src`` and local blocks ``dst`` as descriptor indices."""
        t = self.lay.tensors
        s = (np.asarray(src, np.int32)[:, None] * t + self.per).ravel()
        d = (np.asarray(dst, np.int32)[:, None] * t + self.per).ravel()
        return s, d

    def _post(self, p: tuple[np.ndarray, np.ndarray], op: str) -> Any:
        kind = "READ" if op == "pull" else "WRITE"
        h = self.agent.make_prepped_xfer(kind, self.lside, p[1], self.rside, p[0])
        if self.agent.transfer(h) == "ERR":
            raise RuntimeError(f"NIXL {kind} failed to post")
        return h

    def _wait(self, handles: list[Any]) -> list[float]:
        """Poll every handle until all are done; the time each was seen done."""
        done = [0.0] * len(handles)
        pending = list(range(len(handles)))
        while pending:
            still = []
            for i in pending:
                state = self.agent.check_xfer_state(handles[i])
                if state == "PROC":
                    still.append(i)
                    continue
                done[i] = time.perf_counter()
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer: {state}")
                handles[i].release()
            pending = still
        return done

    def one(self, p: tuple[np.ndarray, np.ndarray], op: str = "pull") -> None:
        self._wait([self._post(p, op)])

    def many(self, ps: list[tuple[np.ndarray, np.ndarray]], op: str = "pull") -> list[float]:
        """All of ``ps`` in flight at once; the time each was seen done."""
        return self._wait([self._post(p, op) for p in ps])

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


# ------------------------------------------------------------------------------ the bench
def wave_blocks(
    rng: np.random.Generator, nblocks: int, per: int, conc: int
) -> list[tuple[list[int], list[int]]]:
    """``(source blocks, destination blocks)`` of each of ``conc`` requests in flight, as a
    serving engine's allocators hand them out once they have churned: scattered over the
    whole pool, the two sides independent, no block shared by two requests of a wave."""
    src, dst = rng.permutation(nblocks), rng.permutation(nblocks)
    return [
        (src[i * per : (i + 1) * per].tolist(), dst[i * per : (i + 1) * per].tolist())
        for i in range(conc)
    ]


def _point(
    drv: Any, op: str, per: int, conc: int, nreq: int, nblocks: int, rng: np.random.Generator
) -> dict[str, Any]:
    """One bench point through an engine's own API, as ``runner._point`` does through ours:
    blocks of :func:`wave_blocks`, waves of ``conc`` requests in flight. A request's time
    includes turning its block lists into the engine's descriptors or addresses."""
    for s, d in wave_blocks(rng, nblocks, per, min(conc, nblocks // per)):  # warm-up
        drv.one(drv.prepare(s, d), op)
    lat: list[float] = []
    waves = [wave_blocks(rng, nblocks, per, conc) for _ in range(max(1, nreq // conc))]
    t0 = time.perf_counter()
    for lists in waves:
        if conc == 1:
            t = time.perf_counter()
            drv.one(drv.prepare(*lists[0]), op)
            lat.append(time.perf_counter() - t)
            continue
        t = time.perf_counter()
        done = drv.many([drv.prepare(s, d) for s, d in lists], op)
        lat += [d - t for d in done]
    elapsed = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    block = drv.lay.span * drv.lay.tensors
    return {
        "op": op,
        "blocks": per,
        "concurrency": conc,
        "requests": n,
        "p50_us": lat[n // 2] * 1e6,
        "p99_us": lat[min(n - 1, int(n * 0.99))] * 1e6,
        "req_per_s": n / elapsed,
        "gb_per_s": n * per * block / elapsed / 1e9,
    }


def bench_rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The bench's sweep through ``spec["engine"]``'s own API (in this process, with its own
    target process per block size and tensor count): each block split over the tensors, as
    ours."""
    engine = spec["engine"]
    most = max(spec["blocks"]) * max(spec["concurrency"])
    tensors = spec["tensors"]
    if engine == "mooncake-raw":
        in_flight = max(spec["concurrency"]) * max(spec["blocks"]) * max(tensors)
        mooncake_env(most, max(tensors), in_flight)
    else:
        from llmdd_async._transports._nixl_agent import skip_unusable_ib

        skip_unusable_ib()  # as llm.Transport=nixl does, so both see the same UCX
    rows = []
    for kib, n in itertools.product(spec["block_kib"], tensors):
        lay = Layout(most, n, (kib << 10) // n)
        drv = Mooncake(lay) if engine == "mooncake-raw" else Nixl(lay)
        try:
            rng = np.random.default_rng(0)
            for op in spec["ops"]:
                for per in spec["blocks"]:
                    for conc in spec["concurrency"]:
                        row = _point(drv, op, per, conc, spec["requests"], most, rng)
                        row.update(transport=engine, loop="-", block_kib=kib, tensors=n)
                        rows.append(row)
        finally:
            drv.close()
    return rows


def run_worker(spec: dict[str, Any], timeout: float = 1800) -> list[dict[str, Any]]:
    """:func:`bench_rows` in a worker process; raises RuntimeError with its last error line."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "llmdd_async.bench.peers", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{spec['engine']}: timed out after {timeout:.0f} s") from None
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(MARK):
            rows: list[dict[str, Any]] = json.loads(line[len(MARK) :])
            return rows
    lines = (out.stderr or out.stdout).strip().splitlines()
    raise RuntimeError(
        f"{spec['engine']} failed (exit {out.returncode}): {lines[-1] if lines else ''}"
    )


if __name__ == "__main__":
    print(MARK + json.dumps(bench_rows(json.loads(sys.argv[1]))), flush=True)
