"""NIXL: one-sided READ/WRITE through NVIDIA's transfer engine (UCX underneath: RDMA verbs,
cma, shm, tcp, cuda_ipc), selected with ``llm.Transport=nixl`` on both endpoints.

Our control plane stays as it is: the peer resolves, plans, checks and grants every request
(``local`` mode), this side checks the grant against the peer's published table, and only then
posts NIXL transfers between the granted ranges. Deadlines, cancel fencing, per-link ordering
and layer-wise scheduling are the link's and the task's, exactly as for the other transports.

* **Registration.** One NIXL agent per endpoint (UCX backend, no listener, no etcd, and no NIXL
  progress thread: it polls UCX without pause, a core per agent; see ``_nixl_agent.Poller``).
  Caches that are remote accessible, and only those, are registered with it when they are
  registered or allocated, and deregistered when their memory goes (unregister, deallocate,
  finalize). Host memory is ``DRAM``; CUDA tensors of the torch adapter are ``VRAM``. Other
  memory is not registered, and requests touching it move over the link's stream.
* **Metadata.** The agent's metadata (connection info and the registered regions, with their
  remote keys) is part of the cache table a linked peer fetches over the link (``TABLE``), so
  on a link keyed with ``llm.AuthKey`` it is covered by the link's frame MACs; it is never in
  the handshake (sent before the server proved the key). Peers learn newly registered caches
  by fetching the table again when a grant names memory they do not know.
* **Prepared lists.** Each cache (ours and each peer's) gets one prepared descriptor list of
  its units (blocks of a blocks cache, batch slots of a contiguous one) per tensor, made on
  first use; a request picks unit indices from them (``make_prepped_xfer``). Grants that are
  not unit-aligned (byte offsets, caches of different unit sizes) use descriptors made for the
  request (``initialize_xfer``).
* **Completion.** Small requests are posted on the loop and, unless already done, awaited
  through one poller thread per agent that checks ``check_xfer_state`` with backoff and wakes
  the loop (it also progresses UCX for the peer's one-sided requests, which UCX tcp needs).
  Large ones run in a worker thread, posted in chunks of at most ``_CHUNK_BYTES`` (``_WINDOW``
  in flight), so a cancel stops after the chunks in flight. Every request is granted by the
  owner of the cache, which pins it while NIXL moves its bytes.
* **Fencing.** Releasing a NIXL request that is still in flight does not stop UCX from moving
  its bytes (measured with UCX tcp: the whole transfer landed after ``release()`` returned).
  So a cancelled request stops posting and waits until every posted chunk is done before it
  returns; only then are handles released.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .._enums import LLMStatusCode
from .._errors import CopyCancelled, FenceLost, LLMException
from .._memory import CancelToken
from .._messages import Cap, Identity
from .._planner import check_within
from . import EndpointHost, RegisteredCache, TransportEndpoint, installed, peer_asks_for
from ._nixl_access import NixlAccess
from ._nixl_agent import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    INSTALL_HINT,
    PREP_INLINE,
    U64,
    WINDOW,
    Chunk,
    Layout,
    Poller,
    load_api,
    merged_runs,
    skip_unusable_ib,
)

if TYPE_CHECKING:
    from .._devices import DeviceAdapter

__all__ = ["INSTALL_HINT", "NixlEndpoint", "available", "start_endpoint"]


def available() -> bool:
    """True if some NIXL Python package is installed (not imported; cheap)."""
    return installed("nixl")


async def start_endpoint(host: EndpointHost) -> NixlEndpoint:
    """The transport registry's entry point: this engine's NIXL agent.

    Raises:
        LLMException: LLM_PARAM_INVALID without NIXL; LLM_FAILED when no UCX agent starts.
    """
    return await NixlEndpoint.start(host)


#: how long a load of a peer's agent waits for a drop of the same agent still running
DROP_WAIT_S = 30.0


class NixlEndpoint(TransportEndpoint):
    """The NIXL agent of one endpoint and the caches registered with it."""

    def __init__(
        self, api: Any, agent: Any, name: str, adapter: DeviceAdapter, host: EndpointHost
    ) -> None:
        self.api = api
        #: the engine it serves (its links' accesses spawn and time out through it)
        self.host = host
        self.agent = agent
        self.name = name
        self.adapter = adapter
        self.caches: dict[int, Layout] = {}
        #: bumped by every (de)registration: peers reload our metadata when it changed
        self.gen = 0
        self._md: tuple[int, str] | None = None
        self._starts = np.zeros(0, dtype=U64)
        self._ends = np.zeros(0, dtype=U64)
        self._ids = np.zeros(0, dtype=np.int64)
        #: the same three as Python lists, for one-range requests
        self.lists: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.poller = Poller(self.check, self._progress)
        self.poller.start()
        self.accesses: weakref.WeakSet[NixlAccess] = weakref.WeakSet()
        #: requests whose fence could not complete: never released (NIXL would free them while
        #: UCX may still move their bytes)
        self._leaked: list[Any] = []
        #: peers whose metadata is being dropped (a disconnect can block: never on the loop)
        self._removing: dict[str, threading.Thread] = {}
        #: accesses (links) that loaded each peer agent's metadata
        self._peer_refs: dict[str, int] = {}
        self.log: Any = None

    @classmethod
    async def start(cls, engine: EndpointHost) -> NixlEndpoint:
        """Create the agent (UCX backend; a worker thread: UCX takes ~0.5 s to start).

        Raises:
            LLMException: LLM_PARAM_INVALID without NIXL; LLM_FAILED when no UCX agent starts.
        """
        api = load_api()
        if skip_unusable_ib():
            engine.log.info("nixl.ucx_modules", set="UCX_MODULES=^ib", reason="no InfiniBand here")
        name = (
            f"llmdd-{engine.cluster_id}-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        )

        def make() -> Any:
            sync = getattr(api, "nixl_thread_sync_t", None)
            # No NIXL progress thread: it polls UCX without pause, a core per agent. Our
            # poller and transfer workers progress the agent instead (see ``Poller``).
            kwargs: dict[str, Any] = {"enable_prog_thread": False, "backends": ["UCX"]}
            if sync is not None:
                # Worker threads, the poller and the loop all call into the agent.
                kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_STRICT
            return api.nixl_agent(name, api.nixl_agent_config(**kwargs))

        try:
            agent = await anyio.to_thread.run_sync(make)
        except Exception as exc:
            raise LLMException(
                f"cannot start a NIXL agent: {exc}", status_code=LLMStatusCode.LLM_FAILED
            ) from exc
        if "UCX" not in getattr(agent, "backends", {}):
            raise LLMException(
                "NIXL started without its UCX backend (plugin missing?)",
                status_code=LLMStatusCode.LLM_FAILED,
            )
        ep = cls(api, agent, name, engine.adapter, engine)
        ep.log = engine.log
        return ep

    # ---------------------------------------------------------------- registration
    def _mem_of(self, addrs: np.ndarray) -> tuple[str, int] | None:
        """NIXL memory type and device of a cache's memory; None when NIXL cannot take it."""
        if self.adapter.host_addressable or not self.adapter.owns(addrs):
            return "DRAM", 0
        dev = getattr(self.adapter, "device", None)
        kind = getattr(dev, "type", None)
        if kind == "cpu":
            return "DRAM", 0
        if kind == "cuda":
            return "VRAM", int(getattr(dev, "index", None) or 0)
        return None

    def register(self, entry: RegisteredCache) -> None:
        """Register a remote-accessible cache's memory with the agent (others: nothing).

        Raises:
            LLMException: LLM_FAILED when NIXL refuses the memory.
        """
        if not entry.remote_accessible or entry.cache_id in self.caches:
            return
        mem = self._mem_of(entry.addrs)
        if mem is None:
            return  # NIXL does not reach this memory: its requests move over the stream
        runs = merged_runs(entry.addrs, entry.tensor_bytes)
        rows = np.empty((len(runs), 3), dtype=U64)
        rows[:, :2] = runs
        rows[:, 2] = mem[1]
        try:
            reg = self.agent.register_memory(rows, mem[0])
        except Exception as exc:
            raise LLMException(
                f"NIXL could not register cache {entry.cache_id} ({mem[0]}): {exc}",
                status_code=LLMStatusCode.LLM_FAILED,
            ) from exc
        lay = Layout(entry.cache_id, entry.addrs, entry.tensor_bytes, entry.count, *mem)
        lay.reg = reg
        self.caches[entry.cache_id] = lay
        self._changed()

    def deregister(self, entry: RegisteredCache) -> None:
        """Deregister a cache whose memory goes (no request of ours uses it: it was pinned
        while any did). Never raises."""
        lay = self.caches.pop(entry.cache_id, None)
        if lay is None:
            return
        try:
            if lay.prepped is not None:
                lay.prepped.release()
            self.agent.deregister_memory(lay.reg)
        except Exception as exc:
            if self.log is not None:
                self.log.warning("nixl.deregister_failed", cache_id=entry.cache_id, error=str(exc))
        self._changed()

    def _changed(self) -> None:
        self.gen += 1
        self._md = None
        lays = list(self.caches.values())
        if not lays:
            self._starts = self._ends = np.zeros(0, dtype=U64)
            self._ids = np.zeros(0, dtype=np.int64)
        else:
            starts = np.concatenate([lay.addrs for lay in lays])
            sizes = np.concatenate([np.full(len(lay.addrs), lay.tensor_bytes, U64) for lay in lays])
            ids = np.concatenate([np.full(len(lay.addrs), lay.cache_id, np.int64) for lay in lays])
            order = np.argsort(starts, kind="stable")
            self._starts, self._ends, self._ids = starts[order], (starts + sizes)[order], ids[order]
        self.lists = (
            [int(a) for a in self._starts],
            [int(a) for a in self._ends],
            [int(c) for c in self._ids],
        )

    def covers(self, ranges: np.ndarray, nbytes: np.ndarray) -> bool:
        """True if every range lies in a tensor of a cache registered with the agent."""
        return check_within(ranges, nbytes, self._starts, self._ends)

    def layout_of(self, ranges: np.ndarray, nbytes: np.ndarray) -> Layout | None:
        """The one registered cache holding all these ranges, or None."""
        if not len(ranges) or not self.covers(ranges, nbytes):
            return None
        j = np.searchsorted(self._starts, np.asarray(ranges, U64), side="right") - 1
        ids = np.unique(self._ids[j])
        return self.caches.get(int(ids[0])) if len(ids) == 1 else None

    def registered(self, entry: RegisteredCache) -> bool:
        return entry.cache_id in self.caches

    def serves(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool | None:
        """A request whose caps ask for NIXL may reach device memory too: whatever is
        registered with the agent (remote-accessible caches only)."""
        if not isinstance(caps, dict) or caps.get(Cap.NIXL.value) is not True:
            return None
        if not self.covers(ranges, nbytes):
            return False
        self.poller.busy()  # UCX tcp moves the peer's bytes only while we progress
        return True

    def published_fields(self) -> dict[str, Any]:
        """What a peer on a NIXL link finds in our cache table: :meth:`table_entry`."""
        return {"nixl": self.table_entry()}

    def table_entry(self) -> dict[str, Any]:
        """What peers need to reach our registered caches: agent name, metadata (regions and
        their remote keys; base64) and each cache's memory type."""
        if self._md is None or self._md[0] != self.gen:
            md = self.agent.get_agent_metadata()
            self._md = (self.gen, base64.b64encode(md).decode())
        return {
            "agent": self.name,
            "gen": self.gen,
            "md": self._md[1],
            "mem": {str(c): [lay.mem, lay.dev] for c, lay in self.caches.items()},
        }

    async def prepare(self, lay: Layout, agent_name: str) -> Any:
        """The prepared descriptor list of ``lay`` (ours: ``agent_name=""``), made once.

        Raises:
            OSError: NIXL refused to prepare it.
        """
        if lay.prepped is None:
            rows = lay.rows()
            try:
                if len(rows) > PREP_INLINE:
                    handle = await anyio.to_thread.run_sync(
                        self.agent.prep_xfer_dlist, agent_name, rows, lay.mem
                    )
                else:
                    handle = self.agent.prep_xfer_dlist(agent_name, rows, lay.mem)
            except Exception as exc:
                raise OSError(f"NIXL could not prepare cache {lay.cache_id}: {exc}") from exc
            if lay.prepped is None:
                lay.prepped = handle
            else:
                handle.release()
        return lay.prepped

    # ---------------------------------------------------------------- requests
    def _progress(self) -> None:
        """Let UCX make progress (this agent runs no progress thread of its own)."""
        self.agent.get_new_notifs()

    def check(self, handle: Any) -> str:
        """NIXL's state of a request: DONE, PROC or ERR (a disconnected peer is ERR)."""
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def make(self, chunk: Chunk, op: str) -> Any:
        """A NIXL request for ``chunk``, or None when NIXL refuses to make one (its errors,
        e.g. a disconnected peer, are not ``OSError``s)."""
        try:
            return chunk.make(self.agent, op)
        except Exception:
            return None

    def post(self, handle: Any) -> str:
        try:
            return str(self.agent.transfer(handle))
        except Exception:
            return "ERR"

    def release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            handle.release()

    def leak(self, handle: Any) -> None:
        self._leaked.append(handle)

    def pump(self, op: str, chunks: list[Chunk], token: CancelToken, stall_s: float) -> int:
        """Post ``chunks`` (at most ``WINDOW`` in flight) and wait for them, in a worker
        thread; returns bytes moved.

        Raises:
            CopyCancelled: ``token`` tripped; every chunk posted before is done (fenced).
            OSError: NIXL failed a chunk (peer gone, memory refused).
        """
        flight: collections.deque[tuple[Any, int]] = collections.deque()
        done = 0
        failed: str | None = None
        i = 0
        delay = 0.0
        stop_at: float | None = None
        try:
            while True:
                while (
                    i < len(chunks)
                    and len(flight) < WINDOW
                    and failed is None
                    and not token.cancelled
                ):
                    c = chunks[i]
                    i += 1
                    handle = self.make(c, op)
                    if handle is None:
                        failed = "NIXL could not make a transfer (peer gone or memory refused)"
                        break
                    state = self.post(handle)
                    if state == "PROC":
                        flight.append((handle, c.nbytes))
                        continue
                    self.release(handle)
                    if state == "DONE":
                        done += c.nbytes
                    else:
                        failed = "NIXL could not post a transfer"
                if not flight:
                    break
                progressed = False
                for _ in range(len(flight)):
                    handle, n = flight.popleft()
                    state = self.check(handle)
                    if state == "PROC":
                        flight.append((handle, n))
                        continue
                    progressed = True
                    self.release(handle)
                    if state == "DONE":
                        done += n
                    elif failed is None:
                        failed = "NIXL failed a transfer (peer gone or memory refused)"
                if progressed:
                    delay = 0.0
                    continue
                if token.cancelled or failed is not None:
                    # Fencing: what is in flight must finish before we return; bounded.
                    now = time.monotonic()
                    stop_at = stop_at or now + stall_s
                    if now > stop_at:
                        for handle, _ in flight:
                            self.leak(handle)
                        flight.clear()
                        raise FenceLost(
                            "NIXL transfers did not finish after a cancel or failure; their "
                            "handles are kept (bytes may still land)"
                        )
                delay = min(max(delay * 2, BACKOFF_MIN), BACKOFF_MAX)
                time.sleep(delay)
        finally:
            for handle, _ in flight:  # only reached by an unexpected exception
                self.leak(handle)
        if failed is not None:
            raise OSError(failed)
        if token.cancelled and done < sum(c.nbytes for c in chunks):
            raise CopyCancelled
        return done

    async def run_small(self, op: str, chunk: Chunk, token: CancelToken, stall_s: float) -> int:
        """Post one small request on the loop; await it through the poller unless it is done
        at once. Cancellation (token or scope) waits for the request to finish (fence).

        Raises:
            CopyCancelled: the token tripped. OSError: NIXL failed it.
        """
        if token.cancelled:
            raise CopyCancelled
        handle = self.make(chunk, op)
        if handle is None:
            raise OSError("NIXL could not make a transfer (peer gone or memory refused)")
        state = self.post(handle)
        try:
            if state == "PROC":
                state = await self.poller.wait(handle, token)
        finally:
            if state in ("PROC", "CANCELLED"):
                # Until the poller says otherwise the request is still in flight: a wait that
                # runs out must keep the handle (bytes may still land), never release it.
                state = "PROC"
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(stall_s):
                        state = await self.poller.wait(handle, None)
                    if state == "PROC":
                        self.leak(handle)
                        raise FenceLost("a cancelled NIXL transfer did not finish (handle kept)")
                    if token.cancelled:
                        state = "CANCELLED"
            if state != "PROC":
                self.release(handle)
        if state == "DONE":
            return chunk.nbytes
        if state == "CANCELLED":
            raise CopyCancelled
        raise OSError("NIXL failed a transfer (peer gone or memory refused)")

    def _unref(self, name: str) -> bool:
        """Give back one reference to ``name``; True while others remain."""
        left = self._peer_refs.get(name, 0) - 1
        if left > 0:
            self._peer_refs[name] = left
            return True
        self._peer_refs.pop(name, None)
        return False

    def forget_peer(self, name: str) -> None:
        """Give back one reference to a peer's metadata (:meth:`load_peer`); the last one
        drops it and disconnects, in a thread of its own (UCX may wait for the peer while it
        closes its endpoints). An old link closing after a new link to the same peer loaded
        it again therefore leaves the new one working. Never raises."""
        if self._unref(name):
            return
        before = self._removing.get(name)

        def remove() -> None:
            if before is not None:
                before.join()
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)

        t = threading.Thread(target=remove, name="llmdd-nixl-forget", daemon=True)
        self._removing[name] = t
        t.start()

    async def load_peer(self, name: str, md: bytes, acquire: bool = True) -> str:
        """Load (or, ``acquire=False``, reload) a peer's metadata, after any pending drop of
        the same agent; returns the agent name NIXL knows it by. Each acquiring load is one
        reference, given back with :meth:`forget_peer`.

        Raises:
            OSError: NIXL refused the metadata, or a drop of the same agent did not end
                within :data:`DROP_WAIT_S`.
        """
        if acquire:
            # The reference is taken before anything is awaited: an old link that gives back
            # its own reference meanwhile must not drop the agent this load brings back (it
            # would be the last one otherwise, and remove what we just added). From here no
            # new drop of the agent can start until this reference is given back.
            self._peer_refs[name] = self._peer_refs.get(name, 0) + 1
        pending = self._removing.get(name)
        if pending is not None:
            # A drop that started before this load: every load waits for it, not only the
            # first (two links loading at once: the second must not add the agent while the
            # drop still runs, which would then remove it under both).
            try:
                # Polled, not joined in a thread: a disconnect UCX never finishes must fail
                # this load (and its link), not hang it and a worker thread for ever.
                with anyio.move_on_after(DROP_WAIT_S):
                    while pending.is_alive():  # noqa: ASYNC110 (a thread, no event)
                        await anyio.sleep(0.005)
                if pending.is_alive():
                    raise OSError(
                        f"NIXL is still dropping the peer's agent {name!r} after {DROP_WAIT_S:g} s"
                    )
            except BaseException:
                if acquire:
                    # Only the count: this load added nothing, and the drop it waited for is
                    # still in _removing for later loads (a new drop would only chain on it).
                    self._unref(name)
                raise
            if self._removing.get(name) is pending:
                del self._removing[name]
        try:
            got = await anyio.to_thread.run_sync(self.agent.add_remote_agent, md)
        except BaseException as exc:
            if acquire:
                self.forget_peer(name)
            if isinstance(exc, Exception):
                raise OSError(f"NIXL refused the peer's metadata: {exc}") from exc
            raise
        agent = got.decode() if isinstance(got, bytes) else str(got)
        if acquire and agent != name:  # NIXL knows it by another name: move the reference
            self._unref(name)
            self._peer_refs[agent] = self._peer_refs.get(agent, 0) + 1
        return agent

    def new_access(self, peer: Identity, log: Any) -> NixlAccess | None:
        """A NIXL access when the peer asked for ``llm.Transport=nixl`` too, else None (the
        link moves bytes over its stream, and ``log`` says ``transport.fallback``)."""
        if not peer_asks_for(peer, "nixl", log):
            return None
        access = NixlAccess(self)
        self.accesses.add(access)
        return access

    def close(self) -> None:
        """Close every link's NIXL state, stop the poller and drop the agent (its caches were
        deregistered by the registry closing first). Never raises."""
        for access in list(self.accesses):
            access.close()
        self.poller.close()
        for t in list(self._removing.values()):
            t.join(5.0)  # disconnects must not outlive the agent (a crash at exit otherwise)
        self._removing.clear()
        for lay in list(self.caches.values()):
            with contextlib.suppress(Exception):
                if lay.prepped is not None:
                    lay.prepped.release()
                self.agent.deregister_memory(lay.reg)
        self.caches.clear()
        self._changed()
