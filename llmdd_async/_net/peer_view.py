"""What one side of a link knows of the peer's memory, and which direct access each may use.

:class:`PeerView` holds the peer's published cache table: the snapshot that resolves keys and
ids (fetched once, for the link's life), and the latest view of the memory it lets us reach
(its regions, its caches by id, its epoch counter), refreshed when a grant or a one-sided pull
names memory outside it. :class:`CapsPolicy` says which direct-access caps this side's
requests carry and which a peer's requests may use, both by the kind of the link.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import anyio
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException, ProtocolError
from .._messages import CacheInfo, Table, TableSnapshot, no_regions
from .._planner import BlockPair, Layout, check_within
from .._transports import NO_CAPS, PeerAccess, RegisteredCache

__all__ = ["BuildTurns", "CapsPolicy", "PeerView", "TableSnapshot", "fetch_tables", "typed_table"]


#: a fetch cut after this share of its timeout with no answer counts as unanswered
_MOSTLY = 0.95


class BuildTurns:
    """The tables fetched together (:func:`fetch_tables`) take the endpoint's build slot one
    after another of their own accord, each waiting for it from its turn (not for its
    fellows' builds), and their waits for other links' builds share one timeout: a slot held
    by others costs the fetches one timeout in all, not one each."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        #: how long they have waited for the slot so far
        self.waited_s = 0.0


class FetchTable(Protocol):
    """Asks the peer for its cache table: the table (parsed off the loop), or None if it did
    not answer within ``timeout_s``; ``answered()`` is called when it came, and its build
    takes a turn of ``turns`` (:class:`BuildTurns`) if given."""

    def __call__(
        self, timeout_s: float, turns: BuildTurns | None = None, answered: Callable[[], None] = ...
    ) -> Awaitable[TableSnapshot | None]: ...


def typed_table(table: Mapping[str, Any]) -> Table:
    """The typed form of a peer's table fields (parsed once for a :class:`TableSnapshot`);
    never raises: malformed entries count as nothing."""
    return table.typed if isinstance(table, TableSnapshot) else Table.of(table)


def cache_info(table: Mapping[str, Any], cache_id: int | None) -> CacheInfo | None:
    """The (first) entry of ``cache_id`` in a peer's table fields, None if there is none; a
    dict lookup for a :class:`TableSnapshot` (a peer may publish thousands of caches)."""
    if isinstance(table, TableSnapshot):
        return None if cache_id is None else table.by_id.get(cache_id)
    return next((c for c in Table.of(table).caches if c.cache_id == cache_id), None)


class PeerView:
    """The peer's table as this side of one link knows it.

    ``table`` is the snapshot keys and ids resolve against; ``regions``, ``caches`` and
    ``epoch`` come from the latest copy (:meth:`refresh`), all three from the same one.
    """

    def __init__(self, fetch: FetchTable, name: str = "the peer") -> None:
        """``name``: what errors call the peer (``cluster 3``)."""
        self._fetch = fetch
        self.name = name
        self.table: TableSnapshot | None = None
        #: the table's caches by id (as the peer described them; checked before any use)
        self.caches: dict[int, CacheInfo] = {}
        #: cache id -> (its table entry, the layout and the data type parsed from that entry)
        self._layouts: dict[int, tuple[CacheInfo, Layout | None, int | None, bool]] = {}
        #: prepared pairs of the peer's caches with ours (``prepared.plan_prepared``), each with
        #: the two layouts and the regions it was made from
        self.pairs: dict[tuple[Any, ...], tuple[Layout, Layout, Any, BlockPair | None, bool]] = {}
        #: (address, value) of the peer's epoch counter as of that view (one-sided pulls)
        self.epoch: tuple[int, int] | None = None
        #: (starts, ends) of the peer's memory that it let us reach directly, refreshed from
        #: its table when a grant names memory outside it (or an access needs a fresh copy)
        self.regions: tuple[np.ndarray, np.ndarray] = no_regions()
        self._fetching = anyio.Lock()
        #: fetches the peer did not answer in time: callers queued behind one fail with it,
        #: not each after a timeout of its own (a silent peer would cost K of them)
        self._unanswered = 0

    async def fetch_table(self, timeout_s: float, turns: BuildTurns | None = None) -> TableSnapshot:
        """The peer's published cache table, snapshotted on first use for the link's life.
        ``turns``: the tables fetched with it (:class:`BuildTurns`).

        Raises:
            LinkBroken: the link failed. LLMException(LLM_TIMEOUT): no answer in time, or
                the table then waited ``timeout_s`` for the endpoint's build slot;
                LLMException(LLM_FAILED): the peer's table is too big to be sent.
        """
        if self.table is None:
            unanswered = self._unanswered
            async with self._fetching:  # (every transfer of a new link asks at once: one fetch)
                if self.table is None:
                    table = None
                    if self._unanswered == unanswered:  # (else: as the fetch waited behind)
                        table = await self._ask(timeout_s, turns)
                    if table is None:
                        raise LLMException(
                            f"{self.name} did not send its cache table in time",
                            status_code=LLMStatusCode.LLM_TIMEOUT,
                        )
                    self.table = table
                    self.adopt(table)
        return self.table

    def layout(self, cache_id: int) -> Layout | None:
        """The layout of the peer's remote-accessible cache ``cache_id`` as this view of its
        table describes it, parsed once per view; None when it is not published as reachable
        or its entry is malformed."""
        return self._parsed(cache_id)[0]

    def dtype(self, cache_id: int) -> int | None:
        """The data type (a ``DataType`` value) the peer published for ``cache_id``; None when
        it did not say (earlier releases) or the entry is missing or malformed."""
        return self._parsed(cache_id)[1]

    def device_memory(self, cache_id: int) -> bool:
        """True if the peer published ``cache_id`` as memory its CPU cannot address (device
        memory: its bytes are staged there)."""
        return self._parsed(cache_id)[2]

    def _parsed(self, cache_id: int) -> tuple[Layout | None, int | None, bool]:
        info = self.caches.get(cache_id)
        cached = self._layouts.get(cache_id)
        if cached is not None and cached[0] is info:
            return cached[1], cached[2], cached[3]
        layout: Layout | None = None
        if info is not None and info.remote_accessible:
            layout = Layout.of(info.addrs, info.tensor_bytes, info.count, info.is_blocks)
            if layout.num_tensors == 0 or layout.count <= 0 or layout.tensor_bytes <= 0:
                layout = None
        dtype = info.dtype if info is not None else None
        device = info is not None and info.device
        if info is not None:
            self._layouts[cache_id] = (info, layout, dtype, device)
        return layout, dtype, device

    def adopt(self, table: Mapping[str, Any]) -> None:
        """What this side knows of the peer's memory, from a copy of its table: the reachable
        regions, the caches by id and the epoch (one-sided pulls), all from the same copy
        (malformed entries count as nothing, a malformed epoch as none)."""
        # (a snapshot was made in a worker thread: a peer's table may hold ~100k values)
        snap = table if isinstance(table, TableSnapshot) else TableSnapshot(table)
        self.regions = snap.regions
        self._layouts = {}
        self.pairs = {}  # (made from the last copy: they would keep it alive)
        # As the peer described them (checked by :meth:`layout` before any use)
        self.caches = dict(snap.by_id)  # (ours to change: the snapshot's stays as made)
        self.epoch = snap.typed.epoch

    async def refresh(self, timeout_s: float) -> bool:
        """Fetch the peer's table again for :meth:`adopt` (the snapshot that resolves keys and
        ids stays as it was). Returns False if the peer did not answer in time.

        Raises:
            LinkBroken: the link failed meanwhile. LLMException: as :meth:`refetch`.
        """
        return await self.refetch(timeout_s) is not None

    async def refetch(self, timeout_s: float) -> TableSnapshot | None:
        """Fetch the peer's table again and :meth:`adopt` it; the copy adopted, or None if the
        peer did not answer in time. Accesses that read entries of their own in the table
        (NIXL, Mooncake) take them from the copy this returns, so that what they use and
        what the view holds come from one copy.

        Raises:
            LinkBroken: the link failed meanwhile. LLMException: the peer's table is too big
                to be sent (it says so), or it waited the timeout for a build slot.
        """
        # One at a time, each asking anew (a request sent before the caller's need arose may
        # be answered by a table older than it), and adopted in the order they came.
        unanswered = self._unanswered
        async with self._fetching:
            if self._unanswered != unanswered:  # (as the fetch waited behind)
                return None
            table = await self._ask(timeout_s)
            if table is None:
                return None
            self.adopt(table)
            return table

    async def _ask(self, timeout_s: float, turns: BuildTurns | None = None) -> TableSnapshot | None:
        """One fetch of the peer's table, counted as unanswered if no answer came in time:
        None, or cancelled before the answer once (almost) its whole timeout had passed (a
        pull's deadline of the same length, set just before it, ends it first; the callers
        queued behind must still fail with it, not each ask again). A table that came and
        then waited for the build slot was answered."""
        start = anyio.current_time()
        came: list[bool] = []
        try:
            table = await self._fetch(timeout_s, turns, lambda: came.append(True))
        except anyio.get_cancelled_exc_class():
            if not came and anyio.current_time() - start >= _MOSTLY * timeout_s:
                self._unanswered += 1
            raise
        self._unanswered += table is None
        return table

    async def check_remote(self, remote: np.ndarray, nbytes: np.ndarray, timeout_s: float) -> None:
        """Every range a grant names in the peer's memory must lie in what the peer published
        as reachable (its remote-accessible caches); a miss refreshes that once.

        Raises:
            ProtocolError: the grant points elsewhere. LinkBroken / LLMException: the table
                could not be fetched.
        """
        if check_within(remote, nbytes, *self.regions):
            return
        if await self.refresh(timeout_s) and check_within(remote, nbytes, *self.regions):
            return
        raise ProtocolError("GRANT points outside the peer's published caches")


async def fetch_tables(
    views: Sequence[PeerView], timeout_s: float, on_failure: Callable[[int, Exception], None]
) -> list[TableSnapshot]:
    """The table snapshot of each view (:meth:`PeerView.fetch_table`): those not fetched yet
    are fetched at once, not one after another, each peer with ``timeout_s`` to answer;
    with none to fetch, no task or loop turn. Their builds take turns (:class:`BuildTurns`),
    so in all the fetches wait about one timeout for the answers and one for the build slot,
    as a single fetch may, besides their own builds. ``on_failure(i, exc)`` is told of each
    view whose fetch failed, before it raises.

    Raises:
        LLMException: the first fetch that failed other than by a timeout (it ends the others,
            which are then not reported), else LLM_TIMEOUT for the first view whose table
            was not ready in time; what a fetch raised that is no LLMException (a bug), as
            it is.
    """
    missing = [i for i, view in enumerate(views) if view.table is None]
    if missing:
        failed: dict[int, Exception] = {}
        turns = BuildTurns()

        def timed_out(exc: Exception) -> bool:
            return isinstance(exc, LLMException) and exc.status_code == LLMStatusCode.LLM_TIMEOUT

        async def fetch(i: int, group: anyio.CancelScope) -> None:
            try:
                await views[i].fetch_table(timeout_s, turns)
            except Exception as exc:
                failed[i] = exc
                if not timed_out(exc):
                    group.cancel()  # (the caller fails: the others need not be waited for)

        async with anyio.create_task_group() as tg:
            for i in missing:
                tg.start_soon(fetch, i, tg.cancel_scope)
        for i in sorted(failed):
            on_failure(i, failed[i])
        broken = [exc for _, exc in sorted(failed.items()) if not timed_out(exc)]
        if failed:
            raise broken[0] if broken else failed[min(failed)]
    return [cast(TableSnapshot, view.table) for view in views]  # (fetched above, or before)


class CapsPolicy:
    """The direct-access caps of one link, by its kind (its transport's access; None: a plain
    TCP link, the stream only)."""

    def __init__(self, access: PeerAccess | None) -> None:
        self._access = access

    def ours(self) -> dict[str, bool]:
        """How this side can reach the peer's memory directly (sent with each request)."""
        return self._access.caps() if self._access is not None else dict(NO_CAPS)

    def for_entry(self, entry: RegisteredCache, host_reachable: bool) -> dict[str, bool]:
        """The caps of a request from/to the local cache ``entry``: :meth:`ours`, unless the
        access cannot use that memory (device memory, ``host_reachable`` False; for NIXL, a
        cache not registered with the agent)."""
        if self._access is None:
            return dict(NO_CAPS)
        return self._access.caps_for(entry, host_reachable)

    def trusted(self, claimed: Any) -> dict[str, bool]:
        """The caps a peer sent with its request, limited to what this link's kind lets it
        use: a peer on a TCP link that claims direct access gets stream grants (and never
        learns our addresses), one on a NIXL link only NIXL grants."""
        if not isinstance(claimed, dict):
            return {}
        allowed = self._access.peer_caps if self._access is not None else ()
        return {k: True for k in allowed if claimed.get(k) is True}
