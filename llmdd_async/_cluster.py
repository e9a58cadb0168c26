"""Where a remote cluster listens (reference §5): ``LLMClusterInfo`` and upstream's integer
form of IPv4 addresses."""

from __future__ import annotations

import socket

from ._checks import check_isinstance, check_uint16, check_uint64
from ._enums import LLMRole

__all__ = ["LLMClusterInfo", "int_to_ip", "ip_to_int"]


def ip_to_int(ip: str | int) -> int:
    """IPv4 text to upstream's integer form (``inet_aton`` bytes read little-endian).

    Raises:
        RuntimeError: the text is not an IPv4 address.
        TypeError: neither str nor int.
    """
    if isinstance(ip, int):
        return ip
    check_isinstance("ip", ip, str)
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError:
        raise RuntimeError(f"invalid ip address {ip!r}") from None


def int_to_ip(value: int) -> str:
    """Inverse of :func:`ip_to_int`."""
    return socket.inet_ntoa(int(value).to_bytes(4, "little"))


class LLMClusterInfo:
    """Where a remote cluster listens, for ``link_clusters`` / ``unlink_clusters``."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int = 0
        self._local_ip_info: list[tuple[int, int]] = []
        self._remote_ip_info: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        check_uint64("remote_cluster_id", value)
        self._remote_cluster_id = int(value)

    @property
    def remote_role_type(self) -> LLMRole | int:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        check_isinstance("remote_role_type", value, (LLMRole, int))
        self._remote_role_type = value

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Raises TypeError/ValueError for a bad port, RuntimeError for unparsable ip text."""
        check_uint16("port", port)
        self._local_ip_info.append((ip_to_int(ip), int(port)))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Raises TypeError/ValueError for a bad port, RuntimeError for unparsable ip text."""
        check_uint16("port", port)
        self._remote_ip_info.append((ip_to_int(ip), int(port)))

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        return list(self._local_ip_info)

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        return list(self._remote_ip_info)

    def __repr__(self) -> str:
        remotes = [f"{int_to_ip(ip)}:{port}" for ip, port in self._remote_ip_info]
        return f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, remote={remotes})"
