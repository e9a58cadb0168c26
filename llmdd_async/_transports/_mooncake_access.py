"""Mooncake Transfer Engine: one link's access to its peer's engine (``mooncake`` explains the
design): the peer's entry fetched over the link and checked, granted ranges moved by the
endpoint's engine."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread
import numpy as np

from .._errors import CopyCancelled, ProtocolError
from .._memory import CancelToken
from .._messages import Cap, MooncakeInfo
from .._planner import check_within
from . import NO_CAPS, EngineAccess, RegisteredCache
from ._runs import U64, tensor_regions

if TYPE_CHECKING:
    from .mooncake import MooncakeEndpoint

__all__ = ["MooncakeAccess"]


def _same_address(a: str, b: str) -> bool:
    """True if two address literals name the same address (``fd00::1`` is ``fd00:0::1``)."""
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


class MooncakeAccess(EngineAccess):
    """Initiator-side access to a linked peer through Mooncake. Its ``regions`` are the peer's
    reachable regions (as ``Link.view`` has them) once its table was fetched."""

    name: ClassVar[str] = "mooncake"
    peer_caps: ClassVar[tuple[str, ...]] = (Cap.MOONCAKE.value,)

    label: ClassVar[str] = "Mooncake"

    def __init__(self, ep: MooncakeEndpoint) -> None:
        super().__init__(ep.host)
        self.ep = ep
        #: the peer engine's name and instance, once its table was fetched and checked
        self.session: str | None = None
        self.instance = 0
        self._starts = np.zeros(0, dtype=U64)
        self._ends = np.zeros(0, dtype=U64)

    def caps(self) -> dict[str, bool]:
        return {**NO_CAPS, Cap.MOONCAKE.value: True}

    def caps_for(self, entry: RegisteredCache, host_reachable: bool) -> dict[str, bool]:
        """Caps of a request from/to ``entry``: Mooncake only when that cache is registered with
        our engine (remote accessible, host memory) and the peer's engine is known (its table
        fetched, naming the link's host); otherwise the request moves over the stream."""
        if self.session is not None and self.ep.registered(entry):
            return self.caps()
        return dict(NO_CAPS)

    def table_fields(self) -> dict[str, Any]:
        """Our engine's entry: only a peer linked over Mooncake is told where it is."""
        entry = self.ep.table_entry()
        return {} if entry is None else {"mooncake": entry}

    async def refresh(self, timeout_s: float) -> None:
        """Fetch the peer's table over the link and take its Mooncake entry. A peer that
        publishes none (it does not listen), or whose engine has the name of another that our
        engine knew, is reached over the link's stream.

        Raises:
            OSError: no answer, a malformed entry, or one naming another host.
            LLMException: the link failed meanwhile, the peer's table is too big to be sent
                (it says so), or it waited ``timeout_s`` for a build slot (LLM_TIMEOUT).
        """
        link = self._served
        async with self._refresh_lock:
            snap = await link.view.refetch(timeout_s)
            if snap is None:
                raise OSError("the peer did not send its cache table in time")
            table = snap.typed
            try:
                info = MooncakeInfo.of(table.mooncake)
            except ProtocolError as exc:
                raise OSError(f"malformed Mooncake entry: {exc}") from exc
            # What the peer publishes, for its requests over the stream too.
            self.regions = snap.regions
            if self.closed or not link.alive:
                raise OSError("the link closed")
            self.session = None  # until the entry passed every check: the stream
            if info is None:
                return
            if not _same_address(info.session_host, link.peer_host):
                # Never open a Mooncake session where the peer says: only where it is.
                link.log.warning(
                    "mooncake.peer_refused",
                    named=info.session_host,
                    linked=link.peer_host,
                    reason="the peer names another host for its engine: its transfers use "
                    "the link's stream",
                )
                raise OSError(
                    f"the peer's Mooncake engine is on {info.session_host!r}, not on the "
                    f"link's address {link.peer_host!r}: refused"
                )
            if not self.ep.reaches(info.session, info.instance):
                link.log.warning(
                    "mooncake.stale_peer",
                    session=info.session,
                    reason="our Mooncake engine knew another engine by this name (a process "
                    "that is gone; Mooncake cannot forget it): transfers use the link's stream",
                )
                return
            ids = set(info.caches)
            mine = [c for c in snap.by_id.values() if c.cache_id in ids and c.remote_accessible]
            self._starts, self._ends = tensor_regions(
                [np.asarray(c.addrs, dtype=U64) for c in mine], [c.tensor_bytes for c in mine]
            )
            self.session = info.session
            self.instance = info.instance
            self.peer_gen = info.gen

    async def _move(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
    ) -> int:
        if self.closed or self.link is None:
            raise OSError("the link's Mooncake access is closed")
        if not len(nbytes):
            return 0
        if token.cancelled:
            raise CopyCancelled
        if self._primed is not None and not self._primed.is_set():
            await self._primed.wait()  # bounded by the task's deadline
        if self.session is None or not check_within(remote, nbytes, self._starts, self._ends):
            await self.refresh(self.ep.host.sync_kv_timeout_s)
            if self.session is None:
                raise OSError("the peer publishes no Mooncake engine")
            if not check_within(remote, nbytes, self._starts, self._ends):
                raise OSError("the peer's Mooncake registrations do not cover the granted ranges")
        if not self.ep.covers(local, nbytes):
            raise OSError("local ranges are not registered with Mooncake")
        session = self.session
        assert session is not None
        self.ep.opening(session, self.instance)
        try:
            return int(
                await anyio.to_thread.run_sync(
                    self.ep.pump,
                    op,
                    session,
                    local,
                    remote,
                    nbytes,
                    token,
                    limiter=self._served.threads,
                )
            )
        except OSError:
            if not token.cancelled:  # (past its deadline the task fails by it, at once)
                await self._settle()
            raise

    async def _settle(self) -> None:
        """A Mooncake failure is most often the peer dying: give the link a moment to notice,
        so the task fails with the link's reason (LLM_LINK_FAILED), not a bare Mooncake
        error."""
        with anyio.move_on_after(1.0):
            while self._served.alive:  # noqa: ASYNC110 (the link has no event for this)
                await anyio.sleep(0.01)

    def close(self) -> None:
        """Forget the peer (called once no request of the link runs; Mooncake keeps what it
        learned of the peer's engine). Never raises."""
        if self.closed:
            return
        self.closed = True
        self.session = None
        self.ep.accesses.discard(self)
