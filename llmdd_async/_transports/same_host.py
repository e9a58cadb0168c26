"""Same host: one copy straight from/to the peer's memory.

Who the peer is comes from the kernel, never from its messages: after the TCP handshake the
server connects to the client's abstract ``AF_UNIX`` socket (named in the handshake), and each
side reads the other's process (``SO_PEERPIDFD``, ``SO_PEERCRED``: pid and uid). The exchange
is bound to the TCP link by the handshake's nonces *and* the TCP connection's two addresses
seen mirrored from the other end, and, with ``llm.AuthKey``, by MACs under a key derived from
the handshake transcript, so a relay can neither make one honest endpoint act on the other's
memory nor win the exchange itself.

Direct access is only ever given between processes of the same effective uid (anything else
moves bytes over TCP), and never with this process's own rights on a peer's word: pool memory
is a ``memfd`` whose descriptor its owner passes over the side channel (``SCM_RIGHTS``), mapped
only if it is sealed against shrinking (no SIGBUS can come from the peer) and holds the size it
claims; other registered memory is reached with ``process_vm_readv`` / ``process_vm_writev``
when the kernel allows it (its ptrace check), which a probe checks. A ``pidfd`` guards against
pid reuse after the peer exits. When nothing can be proven the link moves bytes over TCP.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import hashlib
import hmac
import json
import mmap
import os
import select
import socket
import stat
import struct
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._memory import CancelToken, CopyCancelled, run_parts
from .._planner import Plan, split_plan
from .._protocol import MT, NEED_DATA, Decoder, Message, ProtocolError, encode

__all__ = [
    "MAX_FDS",
    "SameHostAccess",
    "check_pool_fd",
    "close_fds",
    "host_identity",
    "on_same_host",
    "forget_side_channel",
    "is_own_side_channel",
    "peer_pid",
    "peer_process",
    "peer_uid",
    "side_channel_name",
    "valid_side_channel_name",
    "pvr_probe",
    "recv_with_fds",
    "same_user",
    "send_with_fds",
    "side_mac",
    "tcp_binding",
]

_IOV_MAX = 1024
_BATCH_BYTES = 64 << 20
#: above this, a process_vm_* plan is cut in two and runs on two threads: one stream tops out
#: near 5.4 GB/s here (page-table walks of both processes), two reach memcpy's rate
_VM_SPLIT_BYTES = 8 << 20
#: process_vm_* of at most this much runs on the loop, as TCP frames do (tcp.INLINE_BYTES):
#: 64 requests of 1 MiB in flight went from 1330 to about 1700 req/s here when they stopped
#: hopping to threads
_VM_INLINE_BYTES = 1 << 20


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


def host_identity() -> dict[str, Any]:
    """What two processes compare to know they may share a kernel, pid and network namespace.

    A hint only (a peer may lie): proof comes from :func:`peer_pid` on the side channel.
    """
    return {
        "hostname": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": _ns("pid"),
        "netns": _ns("net"),
    }


def on_same_host(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return (
        bool(a.get("boot_id"))
        and a.get("boot_id") == b.get("boot_id")
        and a.get("pidns") == b.get("pidns")
        and a.get("netns") == b.get("netns")
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
    Older kernels give ``(pid, None)``; the caller then opens a pidfd by pid, which leaves a
    pid-reuse window (README: Security model)."""
    pid = peer_pid(sock)
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, struct.calcsize("i"))
    except OSError:
        return pid, None
    (pidfd,) = struct.unpack("i", raw)
    if _exited(pidfd) or _pidfd_pid(pidfd) != pid:
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


def check_pool_fd(fd: int, size: int) -> None:
    """Accept a descriptor a peer passed as a pool only if mapping ``size`` bytes of it is
    safe: a memfd (only memfds and shmem files have seals), sealed against shrinking (the
    peer can never make our accesses fault: SIGBUS), open read-write, holding ``size``.

    Raises:
        OSError: it is none of that (the pool is refused).
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise OSError("not a memfd") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise OSError("a memfd not sealed against shrinking (F_SEAL_SHRINK)")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise OSError("a memfd not open for reading and writing")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise OSError(f"a memfd of {st.st_size} bytes, not the {size} stated")
    if st.st_blksize != mmap.PAGESIZE:
        # hugetlb memfds: a hole the peer punches (which F_SEAL_SHRINK allows) faults with
        # SIGBUS once huge pages run out; ordinary shmem refills a hole with a fresh page
        raise OSError("a memfd of huge pages (its holes could fault)")


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.cache
def _vm_call(name: str) -> Any:
    """libc's ``process_vm_readv`` / ``process_vm_writev``, typed once."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


#: plans of at most this many ranges go to the kernel from Python lists (numpy costs
#: microseconds per call on arrays this small)
_VM_FEW = 16


def _exited(pidfd: int | None) -> bool:
    """True once the process behind ``pidfd`` has exited (its pid may then be reused)."""
    if pidfd is None:
        return False
    return bool(select.select([pidfd], [], [], 0)[0])


def _vm_copy(
    name: str,
    pid: int,
    local: np.ndarray,
    remote: np.ndarray,
    nbytes: np.ndarray,
    token: CancelToken | None,
    pidfd: int | None = None,
) -> int:
    """process_vm_readv/writev over descriptor arrays, up to IOV_MAX ranges per call.

    Raises:
        CopyCancelled: ``token`` tripped. OSError: the kernel refused, or the peer exited.
    """
    fn = _vm_call(name)
    done = 0
    n = len(nbytes)
    i = 0
    while i < n:
        if token is not None and token.cancelled:
            raise CopyCancelled
        if _exited(pidfd):
            raise OSError(f"peer process {pid} exited")
        liov: Any
        riov: Any
        if n <= _VM_FEW:
            # A few ranges: one call, iovecs built from Python ints (numpy's fixed cost per
            # call is most of a small copy's time).
            j = n
            lens = nbytes.tolist()
            liov = (_Iovec * n)(*[_Iovec(a, k) for a, k in zip(local.tolist(), lens, strict=True)])
            riov = (_Iovec * n)(*[_Iovec(a, k) for a, k in zip(remote.tolist(), lens, strict=True)])
            want = sum(lens)
        else:
            # Batches bounded in count and bytes, so cancellation is checked regularly.
            j = min(n, i + _IOV_MAX)
            csum = np.cumsum(nbytes[i:j])
            cut = int(np.searchsorted(csum, _BATCH_BYTES, side="right")) + 1
            j = min(j, i + max(1, cut))
            lv = np.empty((j - i, 2), dtype=np.uint64)
            rv = np.empty((j - i, 2), dtype=np.uint64)
            lv[:, 0], rv[:, 0] = local[i:j], remote[i:j]
            lv[:, 1] = rv[:, 1] = nbytes[i:j]
            liov, riov = lv.ctypes.data, rv.ctypes.data
            want = int(nbytes[i:j].sum())
        got = fn(pid, liov, j - i, riov, j - i, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name} from pid {pid}: {os.strerror(err)}")
        if got != want:
            raise OSError(f"{name} moved {got} of {want} bytes (peer memory went away?)")
        done += got
        i = j
    return int(done)


def pvr_probe(pid: int, addr: int, expect: bytes) -> bool:
    """True if ``process_vm_readv`` of the peer's probe buffer returns the expected token."""
    buf = (ctypes.c_ubyte * len(expect))()
    try:
        _vm_copy(
            "process_vm_readv",
            pid,
            np.array([ctypes.addressof(buf)], np.uint64),
            np.array([addr], np.uint64),
            np.array([len(expect)], np.uint64),
            None,
        )
    except OSError:
        return False
    return bytes(buf) == expect


class _MappedPool:
    def __init__(self, fd: int, base: int, size: int) -> None:
        """Map exactly ``size`` bytes of a pool the peer passed (``fd`` stays the caller's).

        Raises:
            OSError: a bogus pool, or a descriptor :func:`check_pool_fd` refuses.
        """
        base, size = int(base), int(size)
        if size <= 0 or not 0 < base < 2**63 - size:
            raise OSError("empty or bogus pool")
        check_pool_fd(fd, size)
        self.map = mmap.mmap(fd, size)
        self.remote_base, self.size = base, size
        self.local_base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.map.close()


class SameHostAccess:
    """Initiator-side access to a peer process on this host, whose pid the kernel proved."""

    name = "same-host"

    def __init__(
        self,
        pid: int,
        pidfd: int | None,
        pools: Sequence[tuple[int, Any, Any]],
        probe: Any,
        copy: Any,
    ) -> None:
        """``pools``: ``(fd, base, size)`` of each pool the peer passed; the descriptors stay
        the caller's (a pool that is mapped holds its own reference). Takes ownership of
        ``pidfd`` (None: one is opened by pid, on older kernels)."""
        self.pid = pid
        self._vm_limiter: anyio.CapacityLimiter | None = None
        self._copy = copy  # async (Plan, token) -> int, the device adapter's memmove runner
        self.pidfd: int | None = pidfd
        if pidfd is None:
            with contextlib.suppress(OSError, AttributeError):
                self.pidfd = os.pidfd_open(pid)
        try:
            addr, token = int(probe[0]), bytes.fromhex(str(probe[1]))
        except (TypeError, ValueError, IndexError):
            addr, token = 0, b""
        # Without a pidfd a recycled pid could not be told apart: no process_vm_* then.
        self.pvr = self.pidfd is not None and bool(token) and pvr_probe(pid, addr, token)
        self.pools: list[_MappedPool] = []
        #: why each pool the peer passed was not mapped
        self.refused: list[str] = []
        for fd, base, size in pools:
            try:
                self.pools.append(_MappedPool(fd, base, size))
            except (OSError, TypeError, ValueError, OverflowError) as exc:
                # Not safe to map: those ranges go through pvr or the stream.
                self.refused.append(str(exc))
        if _exited(self.pidfd):  # the pid may have been reused while we opened its files
            self.close()
        self.pools.sort(key=lambda p: p.remote_base)
        self._bases = np.array([p.remote_base for p in self.pools], dtype=np.uint64)
        self._ends = np.array([p.remote_base + p.size for p in self.pools], dtype=np.uint64)
        self._delta = np.array([p.local_base - p.remote_base for p in self.pools], dtype=np.int64)
        self._base_list = [p.remote_base for p in self.pools]
        self._end_list = [p.remote_base + p.size for p in self.pools]

    def _touches_pool(self, remote: np.ndarray) -> bool:
        """True if any range starts inside a mapped pool (a few ranges; plain Python)."""
        if not self.pools:
            return False
        for a in remote.tolist():
            j = bisect.bisect_right(self._base_list, a) - 1
            if j >= 0 and a < self._end_list[j]:
                return True
        return False

    def _pool_index(self, remote: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Index of the mapped pool holding each range, or -1."""
        if not len(self.pools):
            return np.full(len(remote), -1, dtype=np.int64)
        j = np.searchsorted(self._bases, remote, side="right").astype(np.int64) - 1
        jj = np.maximum(j, 0)
        end = remote + nbytes
        inside = (j >= 0) & (end >= remote) & (end <= self._ends[jj])  # no wrap-around
        return np.where(inside, j, -1)

    def caps(self) -> dict[str, bool]:
        return {"inproc": False, "pools": bool(self.pools), "pvr": self.pvr}

    async def _move(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
        read: bool,
    ) -> int:
        name = "process_vm_readv" if read else "process_vm_writev"
        if len(remote) <= _VM_FEW and self.pvr and not self._touches_pool(remote):
            # A few ranges outside the mapped pools (user-registered memory): no numpy.
            return await self._vm_plan(name, Plan(remote, local, nbytes), token)
        where = self._pool_index(remote, nbytes)
        mapped = where >= 0
        done = 0
        if mapped.any():
            translated = (remote[mapped].astype(np.int64) + self._delta[where[mapped]]).astype(
                np.uint64
            )
            plan = (
                Plan(translated, local[mapped], nbytes[mapped])
                if read
                else Plan(local[mapped], translated, nbytes[mapped])
            )
            done += await self._copy(plan, token)
        if (~mapped).any():
            if not self.pvr:
                raise OSError("process_vm_* is not permitted for this peer")
            rest = Plan(remote[~mapped], local[~mapped], nbytes[~mapped])
            done += await self._vm_plan(name, rest, token)
        return done

    async def _vm_plan(self, name: str, plan: Plan, token: CancelToken) -> int:
        """process_vm_* over ``plan`` (src: peer, dst: ours): small plans inline, big ones on
        two threads. Raises CopyCancelled, OSError (every thread stopped when it raises)."""
        if plan.total_bytes <= _VM_INLINE_BYTES and len(plan) <= 64:
            # Small copies on the loop, as for local memcpy: a thread hop costs more (measured:
            # one-block p50 110 against 250 us). Such a syscall blocks for long only on memory
            # the peer made slow (swapped out, userfaultfd): a process of the same user, which
            # the kernel already lets stop or trace us at will, so this opens nothing new.
            return _vm_copy(name, self.pid, plan.dst, plan.src, plan.nbytes, token, self.pidfd)
        parts = split_plan(plan, 2 if plan.total_bytes >= _VM_SPLIT_BYTES else 1)
        if self._vm_limiter is None:  # made on first use: it needs the running backend
            self._vm_limiter = anyio.CapacityLimiter(2)
        # Two threads at most: many concurrent requests queue rather than thrash the cores.
        return await run_parts(
            [
                functools.partial(
                    _vm_copy, name, self.pid, p.dst, p.src, p.nbytes, token, self.pidfd
                )
                for p in parts
            ],
            self._vm_limiter,
        )

    def read_word(self, addr: int) -> int | None:
        """The uint64 at the peer's ``addr`` if it lies in a mapped pool (a plain load from
        our own mapping: the peer cannot make it block), else None."""
        for p in self.pools:
            if p.remote_base <= addr and addr + 8 <= p.remote_base + p.size:
                return int(ctypes.c_uint64.from_address(p.local_base + addr - p.remote_base).value)
        return None

    def reaches(self, remote: np.ndarray, nbytes: np.ndarray) -> bool:
        """True if every range of the peer's memory can be copied without the peer's help:
        through a mapped pool, or with process_vm_*."""
        return self.pvr or bool(np.all(self._pool_index(remote, nbytes) >= 0))

    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        return await self._move(local, remote, nbytes, token, read=True)

    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        return await self._move(local, remote, nbytes, token, read=False)

    def close(self) -> None:
        for p in self.pools:
            p.close()
        self.pools = []
        self._bases = self._ends = np.zeros(0, dtype=np.uint64)
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        self.pvr = False
