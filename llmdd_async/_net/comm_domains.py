"""HCCL-style comm domains (``LLMDataDist.link`` / ``unlink`` / ``query_register_mem_status``):
2 to 4 clusters, each at the address its rank has in a rank table, linked all to all in the
background (each rank links to every lower one; a rank with higher ones listens on its own
address meanwhile)."""

from __future__ import annotations

import dataclasses
import json
import socket
import zlib
from typing import TYPE_CHECKING, Any

import anyio

from .._checks import check_isinstance, check_uint32, check_uint64
from .._cluster import LLMClusterInfo
from .._enums import LLMStatusCode, RegisterMemStatus
from .._errors import LLMException, raise_if_false, raise_param

if TYPE_CHECKING:
    from .link_manager import LinkManager

__all__ = ["CommDomains"]


@dataclasses.dataclass
class _Comm:
    members: dict[int, tuple[int, tuple[str, int]]]  # cluster id -> (rank, address)
    status: RegisterMemStatus


class CommDomains:
    """The comm domains of one engine, by id (from 1), over its link manager."""

    def __init__(self, links: LinkManager) -> None:
        self.links = links
        self._comms: dict[int, _Comm] = {}
        self._comm_ids = 0

    async def link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """Validate, then set the domain's links up in the background; returns its id.

        Raises:
            TypeError / ValueError / LLMException(LLM_PARAM_INVALID): as ``LLMDataDist.link``.
        """
        check_isinstance("comm_name", comm_name, str)
        check_isinstance("cluster_rank_info", cluster_rank_info, dict)
        check_isinstance("rank_table", rank_table, str)
        raise_if_false(0 < len(comm_name) < 128, "comm_name must have 1 to 127 characters")
        raise_if_false(2 <= len(cluster_rank_info) <= 4, "a comm domain has 2 to 4 members")
        ranks = []
        for cid, rank in cluster_rank_info.items():
            check_uint64("cluster id", cid)
            check_uint32("rank", rank)
            ranks.append(int(rank))
        raise_if_false(ranks == sorted(set(ranks)), "ranks must be unique and ascending")
        engine = self.links.engine
        me = engine.cluster_id
        raise_if_false(me in cluster_rank_info, f"this endpoint ({me}) is not in the rank map")
        addresses = _rank_addresses(comm_name, rank_table, engine.options.raw)
        for rank in ranks:
            raise_if_false(rank in addresses, f"rank {rank} has no device in the rank table")
        self._comm_ids += 1
        comm_id = self._comm_ids
        members = {int(c): (int(r), addresses[int(r)]) for c, r in cluster_rank_info.items()}
        self._comms[comm_id] = _Comm(members, RegisterMemStatus.PREPARING)
        engine.spawn(self._job, comm_id)
        self.links.log.info("comm.link", comm_id=comm_id, comm_name=comm_name, members=len(members))
        return comm_id

    async def _job(self, comm_id: int) -> None:
        comm = self._comms[comm_id]
        links = self.links
        engine = links.engine
        me = engine.cluster_id
        my_rank, my_addr = comm.members[me]
        budget = engine.options.link_total_time_s or 120
        listener: tuple[anyio.CancelScope, anyio.Event] | None = None
        try:
            with anyio.fail_after(budget):
                if any(r > my_rank for r, _ in comm.members.values()):
                    listener = links.listen_extra(my_addr)
                for cid, (rank, addr) in sorted(comm.members.items(), key=lambda kv: kv[1][0]):
                    if rank >= my_rank or (cid in links.links and links.links[cid].alive):
                        continue
                    info = LLMClusterInfo()
                    info.remote_cluster_id = cid
                    info.append_local_ip_info(my_addr[0], 0)
                    info.append_remote_ip_info(addr[0], addr[1])
                    # Retry: the peer may not be listening yet.
                    ok = (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)
                    while await links.link_one(info, 2.0) not in ok:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                while not all(
                    cid in links.links and links.links[cid].alive
                    for cid in comm.members
                    if cid != me
                ):
                    await links.changed()
            comm.status = RegisterMemStatus.OK
            engine.comm_linked = True
            links.log.info("comm.up", comm_id=comm_id)
        except TimeoutError:
            comm.status = RegisterMemStatus.FAILED
            links.log.warning("comm.failed", comm_id=comm_id, reason=f"not linked in {budget} s")
        except LLMException as exc:
            comm.status = RegisterMemStatus.FAILED
            links.log.warning("comm.failed", comm_id=comm_id, reason=str(exc))
        finally:
            if listener is not None:
                listener[0].cancel()
                await listener[1].wait()

    def status(self, comm_id: int) -> RegisterMemStatus:
        """Raises LLMException(LLM_PARAM_INVALID) for an unknown id."""
        comm = self._comms.get(comm_id)
        raise_if_false(comm is not None, f"unknown comm_id {comm_id}")
        assert comm is not None
        return comm.status

    async def unlink(self, comm_id: int) -> None:
        """Close the domain's links (telling the peers). Raises LLMException(LLM_PARAM_INVALID)
        for an unknown id."""
        comm = self._comms.pop(comm_id, None)
        raise_if_false(comm is not None, f"unknown comm_id {comm_id}")
        assert comm is not None
        links = self.links
        for cid in comm.members:
            link = links.links.get(cid)
            if link is not None and cid != links.engine.cluster_id:
                links.forget(link)
                await link.close(notify=True)


def _rank_addresses(comm_name: str, rank_table: str, options: Any) -> dict[int, tuple[str, int]]:
    """Rank -> (ip, port) from an HCCL rank table (see ``LLMDataDist.link``).

    Raises:
        LLMException: LLM_PARAM_INVALID for a rank table without devices, IPs or ranks.
    """
    try:
        table = json.loads(rank_table)
    except json.JSONDecodeError as exc:
        raise_param(f"rank_table is not JSON: {exc}")
    raise_if_false(isinstance(table, dict), "rank_table must be a JSON object")
    base = options.get("llm.CommPortBase", "30000")
    raise_if_false(base.isdigit(), f"llm.CommPortBase must be a port number, got {base!r}")
    salt = 4 * (zlib.crc32(comm_name.encode()) % 8192)
    out: dict[int, tuple[str, int]] = {}
    for server in table.get("server_list") or []:
        for dev in (server or {}).get("device") or []:
            try:
                rank = int(dev["rank_id"])
                ip = str(dev.get("device_ip") or server.get("server_id"))
                socket.inet_aton(ip)
            except (KeyError, TypeError, ValueError, OSError):
                raise_param(f"rank table device entry without a usable rank_id/device_ip: {dev}")
            port = int(dev.get("llmdd_port") or int(base) + salt + rank)
            raise_if_false(0 < port < 65536, f"port {port} for rank {rank} is out of range")
            out[rank] = (ip, port)
    raise_if_false(out, "rank_table lists no devices (server_list[].device[])")
    return out
