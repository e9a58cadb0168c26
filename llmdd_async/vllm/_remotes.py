"""The decode side's prefill ranks: a side channel and an llmdd_async link to each, kept.

Made on first use (:meth:`Remotes.get`): connect and authenticate the side channel, check the
prefill's KV layout and TP size against ours, then link the endpoints. A side channel that
fails, or a link that goes down, drops both (:meth:`Remotes.drop`); the next use makes them
again. Runs on the worker's loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._enums import LLMStatusCode
from .._errors import ControlError
from .._log import get_logger
from ._config import ConnectorConfig
from ._control import ControlClient
from ._endpoint import Endpoint, cluster_info
from ._layout import incompatibility

__all__ = ["Remote", "Remotes"]

log = get_logger("vllm")


@dataclass
class Remote:
    """A prefill rank this decode worker talks to: side channel + llmdd link, kept."""

    host: str
    port: int
    client: ControlClient
    cluster_id: int
    meta: dict[str, Any]
    #: ``pushed`` answers awaited, by capability
    waiters: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    #: why the side channel is gone (None while it is up)
    dead: str | None = None


class Remotes:
    """The kept :class:`Remote` of each prefill side channel address."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        endpoint: Endpoint,
        key: str,
        key_file: Path | None,
        tp_size: int,
    ) -> None:
        self._cfg = cfg
        self._ep = endpoint
        self._key = key
        #: the host key's file when no auth_key is configured (named in refusals)
        self._key_file = key_file
        self._tp_size = tp_size
        self._remotes: dict[tuple[str, int], Remote] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}

    async def get(self, host: str, port: int) -> Remote:
        """The kept side channel + link to one prefill rank, made on first use.

        Raises:
            ControlError: the side channel refused or failed, the prefill's KV layout or TP
                size differs from ours, or the endpoints could not link.
        """
        key = (host, port)
        r = self._remotes.get(key)
        if r is not None and r.dead is None:
            return r
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            r = self._remotes.get(key)
            if r is not None and r.dead is None:
                return r
            if r is not None:
                await self.drop(r)
            client = ControlClient(self._key)
            try:
                meta = await client.connect(host, port, self._cfg.transfer_timeout_s)
            except ControlError as e:
                if self._key_file is None:
                    raise
                raise ControlError(
                    f"{e} (no auth_key is set: this engine uses its user's host key "
                    f"{self._key_file}, which only engines of this user on this host share; "
                    "set the same auth_key on both engines otherwise)"
                ) from e
            try:
                cid = await self._link(host, port, meta)
            except BaseException:
                client.close()
                raise
            r = Remote(host, port, client, cid, meta)
            r.reader = asyncio.ensure_future(self._read(r))
            self._remotes[key] = r
            log.info("vllm.remote_up", host=host, port=port, engine=meta.get("engine_id"))
            return r

    async def _link(self, host: str, port: int, meta: dict[str, Any]) -> int:
        """Check the prefill's welcome ``meta`` and link to its data endpoint; its cluster id.

        Raises:
            ControlError: another KV layout or TP size, or the link failed.
        """
        bad = incompatibility(self._ep.layout, dict(meta.get("layout") or {}))
        if bad:
            raise ControlError(
                f"prefill {meta.get('engine_id')} at {host}:{port} has another KV layout: {bad}"
            )
        if int(meta.get("tp_size", 1)) != self._tp_size:
            raise ControlError(
                f"prefill {meta.get('engine_id')} runs TP {meta.get('tp_size')}, "
                f"this engine TP {self._tp_size}: equal TP is required"
            )
        cid = int(meta["cluster_id"])
        dd = self._ep.dd
        info = cluster_info(cid, str(meta["data_host"]), int(meta["data_port"]))
        code, _ = await dd.link_clusters([info], timeout=int(self._cfg.transfer_timeout_s * 1000))
        if code not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
            raise ControlError(
                f"cannot link to prefill {meta.get('engine_id')}: "
                f"{dd.link_failure(cid) or code.name}"
            )
        return cid

    async def _read(self, r: Remote) -> None:
        """Hand each ``pushed`` to its waiter until the side channel ends; then fail the rest."""
        try:
            while True:
                msg = await r.client.recv()
                if msg["op"] == "pushed":
                    fut = r.waiters.pop(str(msg.get("cap")), None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except ControlError as e:
            r.dead = str(e)
        except asyncio.CancelledError:
            r.dead = "closed"
        for fut in r.waiters.values():
            if not fut.done():
                fut.set_exception(ControlError(f"prefill side channel lost: {r.dead}"))
        r.waiters.clear()

    async def drop(self, r: Remote) -> None:
        """Close ``r``'s side channel and unlink its endpoint (never raises)."""
        r.dead = r.dead or "dropped"
        r.client.close()
        if r.reader is not None:
            r.reader.cancel()
        if self._remotes.get((r.host, r.port)) is r:
            del self._remotes[(r.host, r.port)]
        with contextlib.suppress(Exception):
            info = cluster_info(r.cluster_id, str(r.meta["data_host"]), int(r.meta["data_port"]))
            await self._ep.dd.unlink_clusters([info], timeout=1000)

    def close(self) -> None:
        """Close every side channel (shutdown: the endpoint's finalize drops the links)."""
        for r in list(self._remotes.values()):
            r.client.close()
