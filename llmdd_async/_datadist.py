"""``LLMDataDist``: the async endpoint (reference §6, DESIGN §2)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._api_checks import check_clusters
from ._checks import check_int32, check_isinstance, check_uint64
from ._cluster import LLMClusterInfo
from ._config import LLMConfig
from ._enums import LLMRole, LLMStatusCode, RegisterMemStatus
from ._errors import LLMException, raise_if_false, raise_param
from ._net.requests import LinkStatistics
from ._observe import Observers
from ._options import parse_listen, parse_options, warn_unknown_options

if TYPE_CHECKING:
    from ._cache_manager import CacheManager
    from ._engine import Engine
    from ._kv_cache_manager import KvCacheManager

__all__ = ["LLMDataDist"]


class LLMDataDist:
    """One endpoint ("cluster") that moves KV caches to and from linked peers.

    Start it with ``async with LLMDataDist(role, cluster_id).running(options) as dd:`` (asyncio,
    uvloop or trio), or ``await dd.init(options)`` / ``await dd.finalize()`` on asyncio.
    Several endpoints may live in one process.

    Raises:
        TypeError: ``role`` is not an LLMRole. TypeError / ValueError: bad ``cluster_id``.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = int(cluster_id)
        self._engine: Engine | None = None
        self._cache_manager: CacheManager | KvCacheManager | None = None
        self._holder: Any = None
        #: told of transfers and links (``llmdd_async.metrics``), across re-initialisations
        self._observers = Observers()

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    def is_initialized(self) -> bool:
        return self._engine is not None and not self._engine.closed

    def _live_engine(self) -> Engine:
        engine = self._engine
        if engine is None or engine.closed:
            raise RuntimeError("llm datadist is not initialized")
        engine.check_thread()
        return engine

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def running(self, options: Mapping[str, str] | LLMConfig) -> AsyncIterator[LLMDataDist]:
        """Initialise, yield this endpoint, and finalize on exit (even on error or cancel).

        ``options`` is the dict of ``LLMConfig.generate_options()`` (or the LLMConfig itself).

        Raises:
            TypeError: options not a dict of str.
            LLMException: LLM_PARAM_INVALID for invalid options; LLM_OUT_OF_MEMORY when a pool
                cannot be created; LLM_LINK_FAILED when the listen address cannot be bound.
            RuntimeError: the endpoint is already initialised.
        """
        from ._engine import Engine

        if isinstance(options, LLMConfig):
            options = options.generate_options()
        if self.is_initialized():
            raise RuntimeError("llm datadist is already initialized")
        parsed = parse_options(options)
        warn_unknown_options(options, self._cluster_id)
        raise_if_false(
            parsed.cache_manager or self._role != LLMRole.PROMPT or parsed.listen is not None,
            "a PROMPT endpoint in legacy mode needs llm.listenIpInfo",
        )
        engine = Engine(self._role, self._cluster_id, parsed, self._observers)
        async with engine.run():
            self._engine = engine
            self._cache_manager = None
            try:
                yield self
            finally:
                self._engine = None
                self._cache_manager = None

    async def init(self, options: Mapping[str, str] | LLMConfig) -> None:
        """Initialise in the background of the running asyncio loop (migration helper).

        Returns at once if already initialised. On trio, use :meth:`running` instead: trio
        has no tasks without a nursery.

        Raises:
            RuntimeError: not running on asyncio.
            TypeError / LLMException: as :meth:`running`.
        """
        if self.is_initialized():
            return
        import asyncio

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "init() runs the engine as a background asyncio task; on trio use "
                "`async with LLMDataDist(...).running(options)`"
            ) from None
        started = asyncio.Event()
        stop = asyncio.Event()
        failure: list[BaseException] = []

        async def holder() -> None:
            try:
                async with self.running(options):
                    started.set()
                    await stop.wait()
            except BaseException as exc:
                failure.append(exc)
                started.set()
                if not isinstance(exc, Exception):
                    raise

        task = loop.create_task(holder(), name=f"llmdd-{self._cluster_id}")
        await started.wait()
        if failure:
            await asyncio.gather(task, return_exceptions=True)
            raise failure[0]
        self._holder = (task, stop)

    async def finalize(self) -> None:
        """Stop the engine: unlink, cancel and fence every task, free pools. Idempotent."""
        holder, self._holder = self._holder, None
        if holder is not None:
            import asyncio

            task, stop = holder
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
        elif self.is_initialized():
            raise RuntimeError(
                "this endpoint was started with running(); leave its `async with` block to stop it"
            )

    # ------------------------------------------------------------------ links
    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` this endpoint listens on (the real port when 0 was asked), or None."""
        engine = self._live_engine()
        return engine.links.listen_address

    def link_statistics(self, cluster_id: int) -> LinkStatistics:
        """Bytes, transfers, transport and recent transfers of the link to ``cluster_id``.

        Raises:
            RuntimeError: not initialised. LLMException: LLM_NOT_YET_LINK without a link.
        """
        return self._live_engine().links.get(cluster_id).statistics()

    async def wait_for_link(self, cluster_id: int, timeout_in_millis: int | None = None) -> None:
        """Return once a live link to ``cluster_id`` exists, whichever side made it (a prompt
        endpoint waiting for its decoder to link, without polling).

        Raises:
            TypeError: ``cluster_id`` is not an int. RuntimeError: not initialised.
            LLMException: LLM_TIMEOUT when no link came within ``timeout_in_millis``.
        """
        check_uint64("cluster_id", cluster_id)
        check_int32("timeout_in_millis", timeout_in_millis, optional=True)
        timeout = None if timeout_in_millis is None else max(0, timeout_in_millis) / 1000
        await self._live_engine().links.wait_for(int(cluster_id), timeout)

    def link_failure(self, cluster_id: int) -> str | None:
        """Why the last link to ``cluster_id`` failed or broke (refused port, wrong cluster
        id, silent listener, peer closed the connection, ...); None once a link is up.

        Raises:
            RuntimeError: not initialised.
        """
        return self._live_engine().links.failures.get(int(cluster_id))

    async def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Connect to each cluster's listener and handshake (this side is the client).

        Link failures never raise: the result is ``(overall, per_cluster)`` where overall is
        SUCCESS only if every cluster linked, else one of the failing codes. Per-cluster codes:
        LLM_ALREADY_LINK, LLM_LINK_FAILED (connect, handshake, authentication, timeout),
        LLM_PARAM_INVALID (own cluster id, not exactly one remote address, mismatched
        remote-accessible mode), LLM_PROCESSING_LINK (a link to it is being set up).

        Raises:
            RuntimeError: not initialised. TypeError / ValueError: bad argument types (a
                ``remote_cluster_id`` left None included). LLMException: LLM_PARAM_INVALID for
                ``timeout <= 0`` or a cluster without a local address (unless local_comm_res).
        """
        engine = self._live_engine()
        check_clusters(clusters, timeout)
        if not clusters:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        if not engine.options.local_comm_res:
            for i, c in enumerate(clusters):
                raise_if_false(
                    len(c.local_ip_info_list) > 0,
                    f"clusters[{i}] needs a local ip info (append_local_ip_info)",
                )
        codes = await engine.links.link_clusters(list(clusters), timeout / 1000)
        return _overall(codes), codes

    async def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Drop links. Without ``force`` the peer is told first (over the link itself);
        failing that gives LLM_NOTIFY_PROMPT_UNLINK_FAILED, and the local side is dropped
        anyway. No link gives LLM_NOT_YET_LINK. Transfers still running on a dropped link fail
        with LLM_NOT_YET_LINK. Never raises for link failures.

        Raises:
            RuntimeError / TypeError / ValueError / LLMException: as :meth:`link_clusters`.
        """
        engine = self._live_engine()
        check_clusters(clusters, timeout)
        check_isinstance("force", force, bool)
        if not clusters:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        codes = await engine.links.unlink_clusters(list(clusters), timeout / 1000, force)
        return _overall(codes), codes

    async def switch_role(
        self, role: LLMRole, switch_options: Mapping[str, str] | None = None
    ) -> None:
        """Change the role label and the listener: with ``llm.listenIpInfo`` in
        ``switch_options`` the endpoint (re)listens there, without it it stops listening.

        Raises:
            RuntimeError: not initialised. TypeError: bad argument types.
            LLMException: LLM_EXIST_LINK while links exist; LLM_PARAM_INVALID for a bad
                address; LLM_LINK_FAILED when the new address cannot be bound.
        """
        engine = self._live_engine()
        check_isinstance("role", role, LLMRole)
        check_isinstance("switch_options", switch_options, dict, optional=True)
        if engine.links.links:
            raise LLMException(
                f"switch_role needs all links removed first ({len(engine.links.links)} remain)",
                status_code=LLMStatusCode.LLM_EXIST_LINK,
            )
        listen_s = (switch_options or {}).get("llm.listenIpInfo")
        new = parse_listen(listen_s) if listen_s else None
        links = engine.links
        if new != engine.options.listen or (new is not None and links.listen_address is None):
            await links.stop_listening()
            if new is not None:
                await links.listen(new)
            engine.options = dataclasses.replace(engine.options, listen=new)
        self._role = role
        engine.role = role

    # ------------------------------------------------------------------ managers
    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager` (cache-manager mode only).

        Raises:
            RuntimeError: not initialised. LLMException: LLM_PARAM_INVALID in legacy mode.
        """
        engine = self._live_engine()
        if not engine.options.cache_manager:
            raise_param("cache_manager needs llm.EnableCacheManager=1 (cache-manager mode)")
        from ._cache_manager import CacheManager

        if self._cache_manager is None:
            self._cache_manager = CacheManager(engine)
        assert isinstance(self._cache_manager, CacheManager)  # the mode is fixed at init
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The legacy :class:`KvCacheManager` (cache-manager mode off, the upstream default).

        Raises:
            RuntimeError: not initialised. LLMException: LLM_PARAM_INVALID in cache-manager mode.
        """
        engine = self._live_engine()
        if engine.options.cache_manager:
            raise_param("kv_cache_manager is only available when cache-manager mode is off")
        from ._kv_cache_manager import KvCacheManager

        if self._cache_manager is None:
            self._cache_manager = KvCacheManager(engine, self)
        assert isinstance(self._cache_manager, KvCacheManager)  # the mode is fixed at init
        return self._cache_manager

    async def check_link_status(self, remote_cluster_id: int) -> None:
        """Probe a link with one round trip (legacy mode, decoder side).

        Raises:
            RuntimeError: not initialised. TypeError / ValueError: bad id.
            LLMException: LLM_PARAM_INVALID in cache-manager mode or on a prompt endpoint;
                LLM_NOT_YET_LINK without a link; LLM_WAIT_PROCESS_TIMEOUT when the peer does not
                answer within ``sync_kv_timeout``.
        """
        engine = self._live_engine()
        check_uint64("remote_cluster_id", remote_cluster_id)
        if engine.options.cache_manager:
            raise_param("check_link_status is only available when cache-manager mode is off")
        raise_if_false(self._role == LLMRole.DECODER, "check_link_status is for decoders")
        link = engine.links.get(int(remote_cluster_id))
        from ._protocol import MT, Message

        if await link.roundtrip(Message(MT.PING), MT.PONG, engine.sync_kv_timeout_s) is None:
            raise LLMException(
                f"cluster {remote_cluster_id} did not answer within sync_kv_timeout",
                status_code=LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
            )

    # ------------------------------------------------------------------ comm-domain links
    async def link(
        self, comm_name: str, cluster_rank_info: Mapping[int, int], rank_table: str
    ) -> int:
        """Join a communication domain (2 to 4 endpoints that all call ``link`` at the same
        time) and return its ``comm_id``; poll :meth:`query_register_mem_status` until OK.

        The HCCL rank table is mapped to addresses: the member of rank ``r`` is reached at the
        ``device_ip`` of the rank table's device whose ``rank_id`` is ``r``, on port
        ``llmdd_port`` of that device entry if present, else
        ``llm.CommPortBase (30000) + 4 * (crc32(comm_name) % 8192) + r``. Lower ranks listen
        there, higher ranks connect, until every pair is linked (budget ``llm.LinkTotalTime``
        seconds, default 120). Caches registered afterwards are not remote accessible by
        default.

        Raises:
            RuntimeError: not initialised. LLMException: LLM_PARAM_INVALID for a bad name,
                rank map, rank table, legacy mode, or an endpoint not in the map.
        """
        engine = self._live_engine()
        if not engine.options.cache_manager:
            raise_param("link() needs cache-manager mode")
        return await engine.links.comms.link(comm_name, cluster_rank_info, rank_table)

    async def unlink(self, comm_id: int) -> None:
        """Leave a communication domain: its links are dropped.

        Raises:
            RuntimeError: not initialised. TypeError / ValueError: bad id.
            LLMException: LLM_PARAM_INVALID for an unknown comm_id.
        """
        engine = self._live_engine()
        check_uint64("comm_id", comm_id)
        await engine.links.comms.unlink(int(comm_id))

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING while the domain's links are being set up, then OK or FAILED.

        Raises:
            RuntimeError: not initialised. TypeError / ValueError: bad id.
            LLMException: LLM_PARAM_INVALID for an unknown comm_id.
        """
        engine = self._live_engine()
        check_uint64("comm_id", comm_id)
        return engine.links.comms.status(int(comm_id))

    def __repr__(self) -> str:
        state = "running" if self.is_initialized() else "stopped"
        return f"<LLMDataDist {self._role} cluster_id={self._cluster_id} {state}>"


def _overall(codes: list[LLMStatusCode]) -> LLMStatusCode:
    for c in codes:
        if c != LLMStatusCode.LLM_SUCCESS:
            return c
    return LLMStatusCode.LLM_SUCCESS
