"""What the kernel says about a process on this host, and passing it descriptors: the facts the
same-host side channel (``side_channel``) is built on.

Who a peer is comes from the kernel, never from its messages: on a connected ``AF_UNIX``
socket, ``SO_PEERPIDFD`` / ``SO_PEERCRED`` name its process (pid and uid). :func:`host_identity`
is a hint only (a peer may lie), which says whether trying the side channel is worth it. The
side channel's frames carry descriptors (``SCM_RIGHTS``) and are bound to one TCP connection
(:func:`tcp_binding`) and, on a keyed link, to the link's key (:func:`side_mac`).
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import hmac
import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import anyio

from .._errors import ProtocolError
from .._messages import Host
from .._protocol import MT, NEED_DATA, Decoder, Message, encode
from .._transports._pvm import pidfd_exited

__all__ = [
    "MAX_FDS",
    "close_fds",
    "forget_side_channel",
    "host_identity",
    "is_own_side_channel",
    "mac_ok",
    "peer_pid",
    "peer_process",
    "peer_uid",
    "recv_with_fds",
    "same_user",
    "send_with_fds",
    "side_channel_name",
    "side_mac",
    "tcp_binding",
    "valid_side_channel_name",
]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns(name: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{name}").st_ino
    except OSError:
        return 0


def host_identity() -> Host:
    """What two processes compare to know they may share a kernel, pid and network namespace
    (:meth:`Host.shares`).

    A hint only (a peer may lie): proof comes from :func:`peer_pid` on the side channel.
    """
    return Host(
        socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), _ns("pid"), _ns("net")
    )


def _peer_cred(sock: socket.socket) -> tuple[int, int]:
    # struct ucred: pid_t pid; uid_t uid; gid_t gid (uids are unsigned)
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, _gid = struct.unpack("iII", creds)
    return int(pid), int(uid)


def _overflow_uid() -> int:
    """The uid the kernel shows for a uid not mapped into our user namespace (65534 unless
    changed): every such process looks like it, so it never proves "the same user"."""
    try:
        return int(_read("/proc/sys/kernel/overflowuid"))
    except ValueError:
        return 65534


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected ``AF_UNIX`` socket, as the kernel
    knows it (0 when it lives in a pid namespace we cannot see)."""
    return _peer_cred(sock)[0]


def peer_uid(sock: socket.socket) -> int:
    """The effective uid the process at the other end of a connected ``AF_UNIX`` socket had
    when it called ``connect()`` or ``listen()`` (the kernel's ``SO_PEERCRED``)."""
    return _peer_cred(sock)[1]


def same_user(sock: socket.socket) -> bool:
    """True if the process at the other end of ``sock`` runs as this process's effective uid:
    when it connected or listened (``SO_PEERCRED``) and now (a listener may have dropped its
    privileges since it called ``listen()``). Only such a peer may share memory with us
    directly: the kernel already lets it ptrace us, so that opens nothing new."""
    pid, uid = _peer_cred(sock)
    me = os.geteuid()
    if pid <= 0 or uid != me or me == _overflow_uid():
        return False
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return len(fields) >= 3 and fields[2] == str(me)
    return False  # gone, or a process we cannot see


_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def _pidfd_pid(pidfd: int) -> int:
    for line in _read(f"/proc/self/fdinfo/{pidfd}").splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    return -1


def peer_process(sock: socket.socket) -> tuple[int, int | None]:
    """``(pid, pidfd)`` of the process at the other end of a connected ``AF_UNIX`` socket.

    ``SO_PEERCRED`` records who called ``connect()`` or ``listen()``, and that process may
    have exited since (handing the socket on), its pid free for reuse. ``SO_PEERPIDFD``
    (Linux >= 6.5) names that very process: if it has exited, pid is 0 (nothing to reach).
    Older kernels (which do not know the option) give ``(pid, None)``; the caller then opens a
    pidfd by pid, which leaves a pid-reuse window (README: Security model)."""
    pid = peer_pid(sock)
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, struct.calcsize("i"))
    except OSError as exc:
        # Kernels 6.5 to 6.15 refuse a pidfd of a process that has exited (EINVAL): its pid
        # may be another process's by now, so nothing is reached by it.
        return (pid, None) if exc.errno == errno.ENOPROTOOPT else (0, None)
    (pidfd,) = struct.unpack("i", raw)
    if pidfd_exited(pidfd) or _pidfd_pid(pidfd) != pid:
        os.close(pidfd)
        return 0, None
    return pid, pidfd


#: side-channel names of this process's own endpoints (a peer proven to be this very process
#: must have answered on one of them)
_OWN_NAMES: set[str] = set()


def side_channel_name() -> str:
    """A fresh abstract socket name of this process, remembered as one of its own."""
    name = f"llmdd-async/{os.getpid()}/{os.urandom(8).hex()}"
    _OWN_NAMES.add(name)
    return name


def forget_side_channel(name: str) -> None:
    _OWN_NAMES.discard(name)


def is_own_side_channel(name: str) -> bool:
    return name in _OWN_NAMES


def valid_side_channel_name(name: object) -> bool:
    """Only names our endpoints make are ever connected to (not any abstract socket a peer
    names, such as a display server's)."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    return (
        len(parts) == 3
        and parts[0] == "llmdd-async"
        and parts[1].isdigit()
        and len(parts[2]) == 16
        and all(c in "0123456789abcdef" for c in parts[2])
    )


def tcp_binding(sock: socket.socket, mirrored: bool = False) -> list[list[Any]]:
    """``[local, remote]`` addresses of a TCP connection (``[remote, local]`` if mirrored): what
    the other end of the very same connection reports, and nobody else on this host."""
    here = [list(sock.getsockname()[:2]), list(sock.getpeername()[:2])]
    return here[::-1] if mirrored else here


def side_mac(key: bytes, label: bytes, nonces: Any, tcp: Any) -> str:
    """The MAC a side of a keyed link puts on its side-channel message: over the handshake's
    nonces and the TCP connection's addresses (as the server sees them), under the link's
    side-channel key (``Binding.side_key``). A relay without ``llm.AuthKey`` cannot make it."""
    body = json.dumps([nonces, tcp], sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, label + b"|" + body, hashlib.sha256).hexdigest()


def mac_ok(expected: str, got: Any) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got, expected)


#: the most descriptors one side-channel message may carry (an endpoint's pools and epoch
#: page: a few); a message with more is refused, and every descriptor it brought closed
MAX_FDS = 16
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


async def send_with_fds(sock: socket.socket, msg: Message, fds: Sequence[int]) -> None:
    """Send one frame on a non-blocking ``AF_UNIX`` socket, passing ``fds`` with its first
    bytes (``SCM_RIGHTS``: the peer gets its own descriptors of the same files). Raises
    OSError."""
    data = memoryview(encode(msg))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while data:
        try:
            n = sock.sendmsg([data], anc, socket.MSG_DONTWAIT)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        anc = []  # passed with the bytes that went
        data = data[n:]


def _fds_in(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(raw[: len(raw) - len(raw) % a.itemsize])
            out.extend(a)
    return out


async def recv_with_fds(
    sock: socket.socket, decoder: Decoder, expect: MT
) -> tuple[Message, list[int]]:
    """The next frame on a side channel, which must be an ``expect`` without payload, and the
    descriptors that came with it (close-on-exec; the caller closes them).

    Raises:
        ProtocolError: anything else, or more than ``MAX_FDS`` descriptors. EOFError / OSError:
            the connection failed. Every descriptor received is closed when this raises.
    """
    fds: list[int] = []
    try:
        while True:
            ev = decoder.next_event()
            if isinstance(ev, Message):
                if ev.type != expect or ev.payload_len:
                    raise ProtocolError(f"expected {expect.name}, got {ev.type.name}")
                return ev, fds
            if ev is not NEED_DATA:
                raise ProtocolError("payload on the side channel")
            try:
                data, anc, flags, _ = sock.recvmsg(
                    1 << 16, _ANC_SPACE, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                await anyio.wait_readable(sock)
                continue
            fds.extend(_fds_in(anc))  # (the kernel closed any that did not fit: MSG_CTRUNC)
            if len(fds) > MAX_FDS or flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"more than {MAX_FDS} descriptors on the side channel")
            if not data:
                raise EOFError("peer closed the side channel")
            decoder.receive_data(data)
    except BaseException:
        close_fds(fds)
        raise
