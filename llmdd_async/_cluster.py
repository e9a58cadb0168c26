"""Where a remote cluster listens (reference §5): ``LLMClusterInfo`` and upstream's integer
form of IPv4 addresses.

Upstream takes IPv4 only (as text or its integer form). This library also takes IPv6
literals (``"::1"``, ``"[::1]"``) and host names (``"localhost"``): they are kept as text, and
a host name is resolved when the link is made (once per ``link_clusters``).
"""

from __future__ import annotations

import ipaddress
import re
import socket

from ._checks import check_isinstance, check_uint16, check_uint64
from ._enums import LLMRole

__all__ = ["LLMClusterInfo", "address_of", "host_text", "int_to_ip", "ip_to_int", "split_host"]

#: RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens
_HOST_NAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


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


def address_of(ip: str | int) -> str | int:
    """What ``append_*_ip_info`` keeps of ``ip``: upstream's integer for an int or IPv4 text;
    the text of an IPv6 literal (brackets dropped, compressed) or of a host name.

    Raises:
        TypeError: neither str nor int.
        RuntimeError: text that is none of these (as upstream, for unparsable text).
    """
    if isinstance(ip, int) and not isinstance(ip, bool):
        return ip
    if not isinstance(ip, str):
        raise TypeError(f"ip must be str or int, got {type(ip).__name__}")
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError:
        pass
    literal = ip[1:-1] if ip.startswith("[") and ip.endswith("]") else ip
    try:
        return str(ipaddress.IPv6Address(literal))
    except ValueError:
        pass
    if _HOST_NAME.fullmatch(ip) and not ip.replace(".", "").isdigit():
        return ip
    raise RuntimeError(
        f"invalid ip address {ip!r} (an IPv4 or IPv6 address, or a host name, is expected)"
    )


def host_text(value: str | int) -> str:
    """An address as :func:`address_of` keeps it, as text to connect to or print."""
    return int_to_ip(value) if isinstance(value, int) else value


def split_host(value: str, what: str) -> tuple[str, str]:
    """``"host:port"`` as ``(host, port text)``; an IPv6 host is written ``[addr]:port``.

    Raises:
        ValueError: not of that form (``what`` names the setting in the message).
    """
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep or "]" in host:
            raise ValueError(f"{what} must be 'host:port' or '[ipv6]:port', got {value!r}")
        return host, port
    if value.count(":") != 1:
        raise ValueError(
            f"{what} must be 'host:port' (an IPv6 address as '[addr]:port'), got {value!r}"
        )
    host, _, port = value.partition(":")
    return host, port


def int_to_ip(value: int) -> str:
    """Inverse of :func:`ip_to_int`."""
    return socket.inet_ntoa(int(value).to_bytes(4, "little"))


class LLMClusterInfo:
    """Where a remote cluster listens, for ``link_clusters`` / ``unlink_clusters``."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int = 0
        self._local_ip_info: list[tuple[int | str, int]] = []
        self._remote_ip_info: list[tuple[int | str, int]] = []

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
        """Add a local address: IPv4 (text or upstream's int), an IPv6 literal or a host name
        (kept as text, see :func:`address_of`).

        Raises:
            TypeError / ValueError: a bad port or ip type. RuntimeError: unparsable ip text.
        """
        check_uint16("port", port)
        self._local_ip_info.append((address_of(ip), int(port)))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add the address the remote cluster listens on: IPv4 (text or upstream's int), an
        IPv6 literal or a host name (resolved when linking).

        Raises:
            TypeError / ValueError: a bad port or ip type. RuntimeError: unparsable ip text.
        """
        check_uint16("port", port)
        self._remote_ip_info.append((address_of(ip), int(port)))

    @property
    def local_ip_info_list(self) -> list[tuple[int | str, int]]:
        """``(ip, port)`` pairs: IPv4 as upstream's int, IPv6 and host names as text."""
        return list(self._local_ip_info)

    @property
    def remote_ip_info_list(self) -> list[tuple[int | str, int]]:
        """``(ip, port)`` pairs: IPv4 as upstream's int, IPv6 and host names as text."""
        return list(self._remote_ip_info)

    def __repr__(self) -> str:
        remotes = [_host_port(host_text(ip), port) for ip, port in self._remote_ip_info]
        return f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, remote={remotes})"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
