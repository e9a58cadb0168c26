"""Mooncake Transfer Engine: one-sided READ/WRITE through Mooncake TE (its TCP protocol; the
engine Ascend and other serving stacks moved to), selected with ``llm.Transport=mooncake`` on
both endpoints.

Our control plane stays as it is, as for NIXL: the peer resolves, plans, checks and grants every
request, this side checks the grant against the peer's published table, and only then asks
Mooncake to move the bytes between the granted ranges. Deadlines, cancel fencing, per-link
ordering and layer-wise scheduling are the link's and the task's.

* **Engine.** One ``TransferEngine`` per endpoint, ``P2PHANDSHAKE`` metadata (no etcd, no
  metadata server), protocol ``tcp``. Its name (``host:port``) uses the address of
  ``llm.listenIpInfo``: Mooncake's peers open their data connections to that host. An
  endpoint that does not listen has no address its peers are known to reach: it only
  initiates over Mooncake, publishes no entry, and what its peers send it (their pushes)
  moves over the link's stream.
* **Registration.** Remote-accessible caches in host memory, and only those, are registered
  with the engine when they are registered or allocated, and unregistered when their memory
  goes. Other memory (device memory, caches that are not remote accessible) moves over the
  link's stream.
* **Metadata.** The engine's name and the ids of its registered caches are part of the cache
  table a peer linked over Mooncake fetches over the link (covered by the link's frame MACs
  with ``llm.AuthKey``), never in the handshake. The name's host must be the address the link
  is connected to: a peer cannot make us open Mooncake sessions to a third host.
* **Moving bytes.** Every request runs in a worker thread of the link, in Mooncake batches
  sized to take about :data:`CHUNK_SECONDS` at the rate the last one ran; a cancel or a
  deadline stops after the batch in flight, and the request returns only once Mooncake
  finished it (fenced: Mooncake cannot abort a batch, so nothing lands after a task ended).
  On a link gone silent a batch ends by Mooncake's TCP progress timeout, which is the
  endpoint's ``llm.SyncKvCacheWaitTime`` unless ``MC_TCP_PROGRESS_TIMEOUT_SEC`` is set: such
  a task fails up to that much past its deadline.
* **Engines outlive endpoints.** Mooncake has no shutdown call, and dropping an engine holds
  the GIL for about a second; a closed endpoint's engine (nothing registered any more) is
  kept for the process's next endpoint of the same address instead.

* **A restarted peer by an old name.** Mooncake names an engine ``host:port`` and keeps
  what it learned of a name for as long as the engine that learned it lives (no call forgets
  it): a peer engine that restarts on a port an earlier one had (Mooncake picks one of
  15000..17000 at random, or among those ``MC_MIN_PRC_PORT``..``MC_MAX_PRC_PORT`` pin) is out
  of its reach. Each engine publishes a random instance id with its name; a link to a peer
  whose engine's name ours moved bytes with under another id moves over its stream
  (``mooncake.stale_peer`` says so), byte-exact, as a link without Mooncake.

**Trust.** Mooncake's listeners authenticate no one and bind every address of the host, whatever
``llm.listenIpInfo`` says: any process that reaches them can read and write the memory
registered with the engine (it refuses addresses outside it). Only remote-accessible caches are
registered; use this transport on a network and host you trust, as Mooncake itself requires.
The peer's engine describes itself in Mooncake's own handshake, which this library cannot see
(we check the name it publishes in its table, not that description): a hostile peer's engine
could still point Mooncake's data connections elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .._enums import LLMStatusCode
from .._errors import CopyCancelled, LLMException
from .._memory import CancelToken
from .._messages import Cap, Identity, MooncakeInfo
from .._planner import check_within
from . import (
    TRANSPORTS,
    EndpointHost,
    RegisteredCache,
    TransportEndpoint,
    installed,
    peer_asks_for,
)
from ._mooncake_access import MooncakeAccess
from ._runs import U64, merged_runs, tensor_regions

if TYPE_CHECKING:
    from .._devices import DeviceAdapter

__all__ = [
    "BATCH_GROWTH",
    "CHUNK_BYTES",
    "CHUNK_MAX_RANGES",
    "CHUNK_MIN_BYTES",
    "CHUNK_SECONDS",
    "INSTALL_HINT",
    "MooncakeAccess",
    "MooncakeEndpoint",
    "available",
]

INSTALL_HINT = TRANSPORTS["mooncake"].install_hint
#: a request moves in Mooncake batches of at most this many bytes (a cancel waits for one)
CHUNK_BYTES = 64 << 20
#: the first batch of a request, and the least one: a batch grows or shrinks to about
#: :data:`CHUNK_SECONDS` at the rate the last one ran, so that a cancel or a deadline waits
#: for about that long on a slow link, not for 16 MiB at its rate
CHUNK_MIN_BYTES = 64 << 10
CHUNK_SECONDS = 0.05
#: a batch is at most this many times the one before it
BATCH_GROWTH = 4
#: ranges in one batch at most: Mooncake refuses a batch longer than its per-peer queue, and
#: each range costs it about 25 us
CHUNK_MAX_RANGES = 1024
#: Mooncake's per-peer queue of ranges, set unless the environment sets it: one batch of each
#: worker thread of every link to that peer must fit (its default, about 4096, does not: a
#: batch it refuses as queue-full leaves the session failing every later batch)
_QUEUE_ENV, _QUEUE = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535"
#: Mooncake's TCP progress timeout (seconds without progress before it fails a batch), set
#: from ``llm.SyncKvCacheWaitTime`` unless the environment sets it: Mooncake reads it once
_PROGRESS_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"


class _Engine:
    """A Mooncake engine and what it learned of its peers' engines (pooled together)."""

    __slots__ = ("instance", "peers", "te")

    def __init__(self, te: Any) -> None:
        self.te = te
        #: published with its name: a new engine that takes the name of one that is gone has
        #: another (Mooncake picks a port of 15000..17000 at random, or the one a user pins)
        self.instance = secrets.randbits(63)
        #: the instance each peer engine's name was first used with: Mooncake keeps what it
        #: learns of a name (the engine's data port, its session) for as long as this engine
        #: lives, and has no call that forgets it, so another engine by that name is out of
        #: this engine's reach (its transfers fail or wait for Mooncake's timeout)
        self.peers: dict[str, int] = {}


#: engines of endpoints that closed, by name, for this process's next endpoint of that name:
#: Mooncake has no shutdown call, and dropping an engine holds the GIL for about a second
#: (it joins its threads), which would stop every thread and event loop of the process. So
#: none is dropped while the process runs; an idle one has nothing registered.
_IDLE: dict[str, list[_Engine]] = {}
_IDLE_LOCK = threading.Lock()


def _take_idle(name: str) -> _Engine | None:
    with _IDLE_LOCK:
        engines = _IDLE.get(name)
        return engines.pop() if engines else None


def _give_back(name: str, engine: _Engine) -> None:
    with _IDLE_LOCK:
        _IDLE.setdefault(name, []).append(engine)


def available() -> bool:
    """True if Mooncake's Python package is installed (not imported; cheap)."""
    return installed("mooncake")


async def start_endpoint(host: EndpointHost) -> MooncakeEndpoint:
    """The transport registry's entry point: this endpoint's Mooncake transfer engine.

    Raises:
        LLMException: LLM_PARAM_INVALID without Mooncake; LLM_FAILED when its engine does not
            start.
    """
    return await MooncakeEndpoint.start(host)


def _load_engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class.

    Raises:
        LLMException: LLM_PARAM_INVALID when Mooncake (or a system library it needs) is
            missing.
    """
    # Mooncake logs every session it opens and closes, and warns at each start of a host
    # without RDMA: errors only unless the user's environment says otherwise (glog reads this
    # when the library loads).
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        module = importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise LLMException(
            f"llm.Transport=mooncake needs Mooncake Transfer Engine, which cannot be imported "
            f"here ({exc}): {INSTALL_HINT}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from exc
    return module.TransferEngine


class _Registered:
    """One cache registered with the engine: its tensors and the runs it registered."""

    __slots__ = ("addrs", "cache_id", "runs", "tensor_bytes")

    def __init__(self, cache_id: int, addrs: np.ndarray, tensor_bytes: int, runs: np.ndarray):
        self.cache_id = cache_id
        self.addrs = addrs
        self.tensor_bytes = tensor_bytes
        self.runs = runs


class MooncakeEndpoint(TransportEndpoint):
    """The Mooncake transfer engine of one endpoint and the caches registered with it."""

    def __init__(
        self,
        engine: _Engine,
        name: str,
        host_name: str | None,
        port: int,
        adapter: DeviceAdapter,
        host: EndpointHost,
    ) -> None:
        self._pooled = engine
        #: Mooncake's engine (None once closed)
        self.engine: Any = engine.te
        #: the host the engine was started with (its name without the port)
        self.name = name
        self.host = host
        self.adapter = adapter
        #: this engine's host as its peers open sessions to it (None: it does not listen)
        self.info_host = host_name
        self.info_port = port
        self.caches: dict[int, _Registered] = {}
        #: bumped by every (de)registration: peers fetch our table again when it changed
        self.gen = 0
        self._starts = np.zeros(0, dtype=U64)
        self._ends = np.zeros(0, dtype=U64)
        self.accesses: set[MooncakeAccess] = set()
        self.log: Any = host.log

    @classmethod
    async def start(cls, host: EndpointHost) -> MooncakeEndpoint:
        """Start the engine (a worker thread: it binds its listeners and probes the host).

        Raises:
            LLMException: LLM_PARAM_INVALID without Mooncake; LLM_FAILED when it does not start.
        """
        engine_class = await anyio.to_thread.run_sync(_load_engine_class)
        # Only what it initiates when it does not listen: the name is then no one's to reach.
        name = host.listen_host or "127.0.0.1"
        # A batch on a link gone silent (a cut, a partition) ends only by this timeout, and
        # the task waits for it (Mooncake cannot abort a batch): so it is the deadline, not
        # Mooncake's own default. A user's setting wins; the process's first endpoint sets it.
        os.environ.setdefault(_PROGRESS_ENV, str(max(1, math.ceil(host.sync_kv_timeout_s))))
        os.environ.setdefault(_QUEUE_ENV, _QUEUE)

        def make() -> tuple[_Engine, int]:
            engine = _take_idle(name)
            if engine is None:
                te = engine_class()
                rc = te.initialize(name, "P2PHANDSHAKE", "tcp", "")
                if rc != 0:
                    raise OSError(f"TransferEngine.initialize returned {rc}")
                engine = _Engine(te)
            return engine, int(engine.te.get_rpc_port())

        try:
            engine, port = await anyio.to_thread.run_sync(make)
        except Exception as exc:
            raise LLMException(
                f"cannot start a Mooncake transfer engine on {name}: {exc}",
                status_code=LLMStatusCode.LLM_FAILED,
            ) from exc
        host.log.warning(
            "mooncake.trust",
            session=f"{name}:{port}",
            reason="Mooncake's listeners bind every address and authenticate no peer: "
            "remote-accessible caches are reachable by any process that reaches them",
        )
        return cls(engine, name, name if host.listen_host else None, port, host.adapter, host)

    # ---------------------------------------------------------------- registration
    def _host_memory(self, addrs: np.ndarray) -> bool:
        return self.adapter.host_addressable or not self.adapter.owns(addrs)

    def register(self, entry: RegisteredCache) -> None:
        """Register a remote-accessible host-memory cache with the engine (others: nothing).

        Raises:
            LLMException: LLM_FAILED when Mooncake refuses the memory.
        """
        if not entry.remote_accessible or entry.cache_id in self.caches or self.engine is None:
            return  # (closed: the endpoint is going, nothing is served any more)
        if not len(entry.addrs) or not self._host_memory(entry.addrs):
            return  # device memory: its requests move over the stream
        runs = merged_runs(entry.addrs, entry.tensor_bytes)
        done: list[int] = []
        for start, size in runs.tolist():
            rc = self.engine.register_memory(int(start), int(size))
            if rc != 0:
                for s in done:
                    with contextlib.suppress(Exception):
                        self.engine.unregister_memory(s)
                raise LLMException(
                    f"Mooncake could not register cache {entry.cache_id} (returned {rc})",
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            done.append(int(start))
        self.caches[entry.cache_id] = _Registered(
            entry.cache_id, np.asarray(entry.addrs, dtype=U64), entry.tensor_bytes, runs
        )
        self._changed()

    def deregister(self, entry: RegisteredCache) -> None:
        """Unregister a cache whose memory goes (no request of ours uses it: it was pinned
        while any did). Never raises."""
        reg = self.caches.pop(entry.cache_id, None)
        if reg is None:
            return
        self._unregister(reg)
        self._changed()

    def _unregister(self, reg: _Registered) -> None:
        if self.engine is None:
            return  # closed: the engine took its registrations with it
        for start in reg.runs[:, 0].tolist():
            try:
                rc = self.engine.unregister_memory(int(start))
            except Exception as exc:
                rc = str(exc)
            if rc != 0:
                self.log.warning("mooncake.unregister_failed", cache_id=reg.cache_id, error=rc)

    def _changed(self) -> None:
        self.gen += 1
        regs = list(self.caches.values())
        self._starts, self._ends = tensor_regions(
            [r.addrs for r in regs], [r.tensor_bytes for r in regs]
        )

    def covers(self, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """True if every range lies in a tensor of a cache registered with the engine."""
        return check_within(ranges, nbytes, self._starts, self._ends)

    def registered(self, entry: RegisteredCache) -> bool:
        return entry.cache_id in self.caches

    def serves(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool | None:
        """A request whose caps ask for Mooncake may reach what is registered with the engine
        (remote-accessible host-memory caches), nothing else."""
        if not isinstance(caps, dict) or caps.get(Cap.MOONCAKE.value) is not True:
            return None
        # An endpoint that does not listen published no engine: its peers' requests move
        # over the stream, whatever caps they claim.
        return self.info_host is not None and self.covers(ranges, nbytes)

    def table_entry(self) -> dict[str, Any] | None:
        """What a peer linked over Mooncake needs: the engine's name and registered caches
        (None when this endpoint does not listen: no peer is known to reach it)."""
        if self.info_host is None:
            return None
        return MooncakeInfo(
            self.info_host,
            self.info_port,
            self.gen,
            tuple(sorted(self.caches)),
            self._pooled.instance,
        ).fields()

    def reaches(self, session: str, instance: int) -> bool:
        """True unless this engine moved bytes with another engine by the name ``session`` (a
        process that is gone): Mooncake would use what it learned of that one, so a link to
        this one moves over its stream."""
        return self._pooled.peers.get(session, instance) == instance

    def opening(self, session: str, instance: int) -> None:
        """Mooncake is about to open (or use) its session to ``session``: from now on it keeps
        what it learns of that name, for engine ``instance``."""
        self._pooled.peers.setdefault(session, instance)

    def new_access(self, peer: Identity, log: Any) -> MooncakeAccess | None:
        """A Mooncake access when the peer asked for ``llm.Transport=mooncake`` too, else None
        (the link moves bytes over its stream, and ``log`` says ``transport.fallback``)."""
        if not peer_asks_for(peer, "mooncake", log):
            return None
        access = MooncakeAccess(self)
        self.accesses.add(access)
        return access

    # ---------------------------------------------------------------- requests
    def pump(
        self,
        op: str,
        session: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
    ) -> int:
        """Move the ranges in Mooncake batches, in a worker thread; returns bytes moved. Each
        batch is waited for (a cancel stops before the next) and is sized to take about
        :data:`CHUNK_SECONDS` at the rate the last one ran (:data:`CHUNK_MIN_BYTES` to
        :data:`CHUNK_BYTES`, at most :data:`BATCH_GROWTH` times the last, at most
        :data:`CHUNK_MAX_RANGES` ranges, ranges split where a batch ends).

        Raises:
            CopyCancelled: ``token`` tripped (every batch started before is done: fenced).
            OSError: Mooncake failed a batch (peer gone, memory refused, its timeout).
        """
        engine = self.engine
        if engine is None:
            raise OSError("the endpoint's Mooncake engine is closed")
        move = engine.batch_transfer_sync_read if op == "READ" else engine.batch_transfer_sync_write
        n = np.asarray(nbytes, dtype=np.int64)
        ends = np.cumsum(n)  # each range's end in the request's byte stream
        begins = ends - n
        loc = np.asarray(local, dtype=U64).astype(np.int64)
        rem = np.asarray(remote, dtype=U64).astype(np.int64)
        total = int(ends[-1]) if len(ends) else 0
        done, limit = 0, CHUNK_MIN_BYTES
        while done < total:
            if token.cancelled:
                raise CopyCancelled
            # The batch [done, stop) of the byte stream; ranges at its edges are split.
            stop = min(total, done + limit)
            i0 = int(np.searchsorted(ends, done, side="right"))
            i1 = int(np.searchsorted(begins, stop, side="left"))
            if i1 - i0 > CHUNK_MAX_RANGES:
                i1 = i0 + CHUNK_MAX_RANGES
                stop = int(ends[i1 - 1])
            skip = np.maximum(begins[i0:i1], done) - begins[i0:i1]
            sizes = np.minimum(ends[i0:i1], stop) - begins[i0:i1] - skip
            t0 = time.monotonic()
            rc = move(
                session,
                (loc[i0:i1] + skip).tolist(),
                (rem[i0:i1] + skip).tolist(),
                sizes.tolist(),
            )
            size = stop - done
            if rc != 0:
                raise OSError(
                    f"Mooncake failed a {op.lower()} of {size} bytes "
                    f"(returned {rc}: peer gone, memory refused or its timeout)"
                )
            took = max(time.monotonic() - t0, 1e-6)
            # At most fourfold from one batch to the next: a shaped link's burst (a token
            # bucket's) moves a first batch at a rate the link cannot keep, and the batch in
            # flight at a deadline is waited for.
            estimate = min(size * BATCH_GROWTH, size / took * CHUNK_SECONDS)
            limit = int(min(CHUNK_BYTES, max(CHUNK_MIN_BYTES, estimate)))
            done = stop
        return done

    def close(self) -> None:
        """Close every link's access, unregister what is left (the registry closing first
        unregistered its caches) and let the engine go. Never raises."""
        for access in list(self.accesses):
            access.close()
        for reg in list(self.caches.values()):
            self._unregister(reg)
        self.caches.clear()
        self._changed()
        if self.engine is not None:
            self.engine = None
            _give_back(self.name, self._pooled)  # not dropped: see _IDLE
