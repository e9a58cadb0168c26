"""NIXL: one link's access to its peer's memory (``nixl`` explains the design): the peer's
metadata fetched over the link, grants planned into NIXL requests and run through the agent."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread
import numpy as np

from .._errors import FenceLost, ProtocolError
from .._memory import CancelToken
from .._messages import CacheInfo, NixlInfo
from .._planner import check_within
from . import NO_CAPS, EngineAccess, RegisteredCache
from ._nixl_agent import (
    CHUNK_BYTES,
    SMALL_BYTES,
    U64,
    Chunk,
    Layout,
    cuts,
    find1,
    index1,
)

if TYPE_CHECKING:
    from .nixl import NixlEndpoint

__all__ = ["NixlAccess"]


class NixlAccess(EngineAccess):
    """Initiator-side access to a linked peer through NIXL. Its ``regions`` are the peer's
    reachable regions (as ``Link.view`` has them) once its table was fetched."""

    name: ClassVar[str] = "nixl"
    peer_caps: ClassVar[tuple[str, ...]] = ("nixl",)

    label: ClassVar[str] = "NIXL"

    def __init__(self, ep: NixlEndpoint) -> None:
        super().__init__(ep.host)
        self.ep = ep
        self.peer_agent: str | None = None
        self._remote: dict[int, Layout] = {}
        self._starts = np.zeros(0, dtype=U64)
        self._ends = np.zeros(0, dtype=U64)
        self._ids = np.zeros(0, dtype=np.int64)
        self._lists: tuple[list[int], list[int], list[int]] = ([], [], [])
        #: prepared lists of the peer's caches that changed, kept until the link closes
        self._retired: list[Any] = []

    async def _connect(self) -> None:
        """Connect to the peer's agent ahead of the first transfer."""
        if self.peer_agent is not None:
            await anyio.to_thread.run_sync(self.ep.agent.make_connection, self.peer_agent)

    def caps(self) -> dict[str, bool]:
        return {"inproc": False, "pools": False, "pvr": False, "nixl": True}

    def caps_for(self, entry: RegisteredCache, host_reachable: bool) -> dict[str, bool]:
        """Caps of a request from ``entry``: NIXL only when that cache is registered with our
        agent (remote accessible; device memory too); otherwise the request moves over the
        stream."""
        if self.ep.registered(entry):
            return self.caps()
        return dict(NO_CAPS)

    def table_fields(self) -> dict[str, Any]:
        """Our agent's metadata: only a peer linked over NIXL gets the keys to our memory."""
        return self.ep.published_fields()

    # ---------------------------------------------------------------- peer metadata
    async def refresh(self, timeout_s: float) -> None:
        """Fetch the peer's table over the link and load its NIXL metadata if it changed.

        Raises:
            OSError: no answer, or a table without usable NIXL metadata.
            LLMException: the link failed meanwhile, the peer's table is too big to be sent
                (it says so), or it waited ``timeout_s`` for a build slot (LLM_TIMEOUT).
        """
        async with self._refresh_lock:
            snap = await self._served.view.refetch(timeout_s)
            if snap is None:
                raise OSError("the peer did not send its cache table in time")
            table = snap.typed  # malformed entries count as nothing
            try:
                nx = NixlInfo.of(table.nixl)  # its entry: every part checked here
                # a new generation (or none: unknown, loaded again as it always was)
                md = nx.metadata() if nx is not None and nx.gen != self.peer_gen else None
            except ProtocolError as exc:
                raise OSError(f"malformed NIXL metadata: {exc}") from exc
            if nx is None:
                raise OSError("the peer publishes no NIXL metadata (is it llm.Transport=nixl?)")
            if md is not None:
                held = self.peer_agent is not None
                name = await self.ep.load_peer(nx.agent, md, acquire=not held)
                if self.closed:
                    if not held:
                        self.ep.forget_peer(name)
                    raise OSError("the link closed")
                self.peer_agent = name
                self._load(snap.by_id.values(), nx.mem)
                self.peer_gen = -1 if nx.gen is None else nx.gen
            self.regions = snap.regions

    def _load(self, caches: Iterable[CacheInfo], mem: Mapping[str, tuple[str, int]]) -> None:
        """The peer's NIXL-registered caches from its table's entries, one an id (and its NIXL
        entry's memory types); prepared lists of caches that changed are dropped."""
        fresh: dict[int, Layout] = {}
        for c in caches:
            cid = c.cache_id
            m = mem.get(str(cid))
            if not c.remote_accessible or m is None or m[0] not in ("DRAM", "VRAM"):
                continue
            addrs = np.array(c.addrs, dtype=U64)
            tb, count = c.tensor_bytes, c.count
            if not len(addrs) or tb <= 0 or count <= 0:
                continue
            old = self._remote.get(cid)
            if (
                old is not None
                and old.tensor_bytes == tb
                and old.count == count
                and np.array_equal(old.addrs, addrs)
                and old.mem == m[0]
            ):
                fresh[cid] = old
                continue
            fresh[cid] = Layout(cid, addrs, tb, count, m[0], m[1])
        for cid, old in self._remote.items():
            if fresh.get(cid) is not old and old.prepped is not None:
                # A request of this link may still use it: released when the link closes
                # (no request runs then).
                self._retired.append(old.prepped)
                old.prepped = None
        self._remote = fresh
        lays = list(fresh.values())
        if lays:
            starts = np.concatenate([lay.addrs for lay in lays])
            ends = starts + np.concatenate(
                [np.full(len(lay.addrs), lay.tensor_bytes, U64) for lay in lays]
            )
            ids = np.concatenate([np.full(len(lay.addrs), lay.cache_id, np.int64) for lay in lays])
            order = np.argsort(starts, kind="stable")
            self._starts, self._ends, self._ids = starts[order], ends[order], ids[order]
        else:
            self._starts = self._ends = np.zeros(0, dtype=U64)
            self._ids = np.zeros(0, dtype=np.int64)
        self._lists = (
            [int(a) for a in self._starts],
            [int(a) for a in self._ends],
            [int(c) for c in self._ids],
        )

    def _remote_groups(self, remote: np.ndarray) -> np.ndarray:
        j = np.searchsorted(self._starts, np.asarray(remote, U64), side="right") - 1
        return self._ids[j]

    # ---------------------------------------------------------------- transfers
    async def _move(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
    ) -> int:
        if self.closed or self.link is None:
            raise OSError("the link's NIXL access is closed")
        if not len(nbytes):
            return 0
        engine = self.ep.host
        stall = engine.stall_timeout_s
        if self._primed is not None and not self._primed.is_set():
            await self._primed.wait()  # bounded by the task's deadline
        if len(nbytes) == 1:
            chunk = await self._plan1(int(local[0]), int(remote[0]), int(nbytes[0]))
            if chunk is not None:
                try:
                    return await self.ep.run_small(op, chunk, token, stall)
                except FenceLost as exc:
                    self._served.fail(exc)
                    raise
                except OSError:
                    await self._settle()
                    raise
        if not check_within(remote, nbytes, self._starts, self._ends):
            await self.refresh(engine.sync_kv_timeout_s)
            if not check_within(remote, nbytes, self._starts, self._ends):
                raise OSError("the peer's NIXL metadata does not cover the granted ranges")
        llay = self.ep.layout_of(local, nbytes)
        if llay is None:
            raise OSError("local ranges are not in one cache registered with NIXL")
        chunks = await self._plan(llay, local, remote, nbytes)
        total = sum(c.nbytes for c in chunks)
        try:
            return await self._run(op, chunks, total, token, stall)
        except FenceLost as exc:
            # Never report a stopped transfer while NIXL may still write: the link goes down,
            # which disconnects the peer's UCX endpoints once no request runs on it.
            self._served.fail(exc)
            raise
        except OSError:
            await self._settle()
            raise

    async def _run(
        self, op: str, chunks: list[Chunk], total: int, token: CancelToken, stall: float
    ) -> int:
        """Run planned chunks: one small one on the loop, the rest in a worker thread.

        Raises:
            CopyCancelled, FenceLost, OSError: as :meth:`NixlEndpoint.pump`.
        """
        if len(chunks) == 1 and total <= SMALL_BYTES:
            return await self.ep.run_small(op, chunks[0], token, stall)
        return int(
            await anyio.to_thread.run_sync(
                self.ep.pump, op, chunks, token, stall, limiter=self._served.threads
            )
        )

    async def _settle(self) -> None:
        """A NIXL failure is most often the peer dying: give the link a moment to notice, so
        the task fails with the link's reason (LLM_LINK_FAILED), not a bare NIXL error."""
        with anyio.move_on_after(1.0):
            while self._served.alive:  # noqa: ASYNC110 (the link has no event for this)
                await anyio.sleep(0.01)

    async def _plan1(self, local: int, remote: int, nbytes: int) -> Chunk | None:
        """One range of whole units, both sides in known prepared caches: the request, made
        with plain integers (most small requests); None otherwise."""
        if nbytes > SMALL_BYTES or self.peer_agent is None:
            return None
        rid = find1(*self._lists, remote, nbytes)
        lid = find1(*self.ep.lists, local, nbytes)
        rlay, llay = self._remote.get(rid), self.ep.caches.get(lid)
        if rlay is None or llay is None or rlay.unit != llay.unit:
            return None
        ri, li = index1(rlay, remote, nbytes), index1(llay, local, nbytes)
        if ri is None or li is None:
            return None
        k = nbytes // rlay.unit
        lh = llay.prepped if llay.prepped is not None else await self.ep.prepare(llay, "")
        rh = rlay.prepped
        if rh is None:
            rh = await self.ep.prepare(rlay, self.peer_agent)
        return Chunk(True, (lh, list(range(li, li + k)), rh, list(range(ri, ri + k))), nbytes)

    async def _plan(
        self, llay: Layout, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray
    ) -> list[Chunk]:
        """Chunks of NIXL requests for one grant: prepared-list indices when both sides are
        whole units of one cache each, explicit descriptors otherwise."""
        assert self.peer_agent is not None
        groups = self._remote_groups(remote)
        ids = np.unique(groups)
        n = np.asarray(nbytes, dtype=np.int64)
        if len(ids) == 1:
            rlay = self._remote[int(ids[0])]
            if rlay.unit == llay.unit and rlay.unit > 0:
                li = llay.indices(local, n)
                ri = rlay.indices(remote, n) if li is not None else None
                if li is not None and ri is not None:
                    lh = await self.ep.prepare(llay, "")
                    rh = await self.ep.prepare(rlay, self.peer_agent)
                    per = max(1, CHUNK_BYTES // rlay.unit)
                    return [
                        Chunk(
                            True,
                            (lh, li[s : s + per], rh, ri[s : s + per]),
                            min(per, len(li) - s) * rlay.unit,
                        )
                        for s in range(0, len(li), per)
                    ]
        chunks = []
        for cid in ids:
            sel = np.flatnonzero(groups == cid)
            rlay = self._remote[int(cid)]
            for lo, hi in cuts(n[sel], CHUNK_BYTES):
                s = sel[lo:hi]
                lrows = np.stack(
                    [
                        np.asarray(local, U64)[s],
                        n[s].astype(U64),
                        np.full(len(s), llay.dev, U64),
                    ],
                    axis=1,
                )
                rrows = np.stack(
                    [
                        np.asarray(remote, U64)[s],
                        n[s].astype(U64),
                        np.full(len(s), rlay.dev, U64),
                    ],
                    axis=1,
                )
                chunks.append(
                    Chunk(
                        False, (lrows, llay.mem, rrows, rlay.mem, self.peer_agent), int(n[s].sum())
                    )
                )
        return chunks

    def close(self) -> None:
        """Drop the peer's prepared lists and metadata (disconnects its UCX endpoints). Called
        once no request of the link runs any more. Never raises."""
        if self.closed:
            return
        self.closed = True
        for lay in self._remote.values():
            if lay.prepped is not None:
                self.ep.release(lay.prepped)
                lay.prepped = None
        self._remote = {}
        for prepped in self._retired:
            self.ep.release(prepped)
        self._retired = []
        if self.peer_agent is not None:
            self.ep.forget_peer(self.peer_agent)
            self.peer_agent = None
        self.ep.accesses.discard(self)
