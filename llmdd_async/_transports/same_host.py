"""Same host: one copy straight from/to the peer's memory.

The peer is a process the same-host side channel proved (``_net/side_channel``: the kernel
names it, the exchange is bound to the TCP link and, with ``llm.AuthKey``, to the link's key),
of this process's effective uid. Direct access is never given with this process's own rights
on a peer's word: pool memory is a ``memfd`` whose descriptor its owner passed over the side
channel (``SCM_RIGHTS``), mapped only if it is sealed against shrinking (no SIGBUS can come
from the peer) and holds the size it claims; other registered memory is reached with
``process_vm_readv`` / ``process_vm_writev`` (``_pvm``) when the kernel allows it (its ptrace
check), which a probe checks. A ``pidfd`` guards against pid reuse after the peer exits. When
nothing can be proven the link moves bytes over TCP.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import functools
import mmap
import operator
import os
import stat
from collections.abc import Sequence
from typing import Any, ClassVar

import anyio
import anyio.to_thread
import numpy as np

from .._errors import CopyCancelled
from .._memory import INLINE_RANGES, CancelToken, copy_inline, run_parts
from .._messages import Proof
from .._planner import Plan, split_plan, u64_sum
from . import CopyRunner, PeerAccess
from ._pvm import VM_FEW, pidfd_exited, pvr_probe, vm_copy

__all__ = ["SameHostAccess", "check_pool_fd", "open_access"]

#: above this, a process_vm_* plan is cut in two and runs on two threads: one stream tops out
#: near 5.4 GB/s here (page-table walks of both processes), two reach memcpy's rate
_VM_SPLIT_BYTES = 8 << 20
#: copies of at most this much (process_vm_* or a memmove through a mapped pool) run on the
#: loop, as TCP frames do (tcp.INLINE_BYTES) and the host adapter's memmoves: a thread hop
#: costs more than the copy (a MiB is 100-200 us, far below the loop's 50 ms bound). 64
#: requests of 1 MiB in flight went from 1330 to about 1700 req/s here when pvr stopped
#: hopping to threads, and from about 1900 to 2400 when pool memmoves did too
_VM_INLINE_BYTES = _POOL_INLINE_BYTES = 1 << 20
#: ranges up to this many are found in the mapped pools with Python ints, more with numpy
_TRANSLATE_FEW = 32
#: up to this many ranges, each is searched for its pool (cheaper than testing all at once)
_TRANSLATE_ONE_SEARCH = 4


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


class SameHostAccess(PeerAccess):
    """Initiator-side access to a peer process on this host, whose pid the kernel proved."""

    name: ClassVar[str] = "same-host"
    peer_caps: ClassVar[tuple[str, ...]] = ("pools", "pvr", "key_reads")
    one_sided: ClassVar[bool] = True

    def __init__(
        self,
        pid: int,
        pidfd: int | None,
        pools: Sequence[tuple[int, Any, Any]],
        probe: Any,
        copy: CopyRunner,
    ) -> None:
        """``pools``: ``(fd, base, size)`` of each pool the peer passed; the descriptors stay
        the caller's (a pool that is mapped holds its own reference). Takes ownership of
        ``pidfd`` (None: one is opened by pid, on older kernels)."""
        super().__init__()
        self.pid = pid
        self._vm_limiter: anyio.CapacityLimiter | None = None
        self._copy = copy  # the device adapter's memmove runner
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
        if pidfd_exited(self.pidfd):  # the pid may have been reused while we opened its files
            self.close()
        self._index_pools()

    def _index_pools(self) -> None:
        """Where each mapped pool lies in the peer's memory and in ours, sorted; a pool over
        addresses a lower one holds is unmapped and refused (the peer names each pool's base:
        two pools there would give one address two meanings)."""
        self.pools.sort(key=lambda p: p.remote_base)
        kept: list[_MappedPool] = []
        for pool in self.pools:
            if kept and pool.remote_base < kept[-1].remote_base + kept[-1].size:
                pool.close()
                self.refused.append("a pool over addresses another pool of the peer holds")
            else:
                kept.append(pool)
        self.pools = kept
        self._bases = np.array([p.remote_base for p in self.pools], dtype=np.uint64)
        self._ends = np.array([p.remote_base + p.size for p in self.pools], dtype=np.uint64)
        self._delta = np.array([p.local_base - p.remote_base for p in self.pools], dtype=np.int64)
        self._base_list = [p.remote_base for p in self.pools]
        self._delta_list = [p.local_base - p.remote_base for p in self.pools]
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
        if len(remote) <= VM_FEW and self.pvr and not self._touches_pool(remote):
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
        if plan.total_bytes <= _VM_INLINE_BYTES and len(plan) <= INLINE_RANGES:
            # Small copies on the loop, as for local memcpy: a thread hop costs more (measured:
            # one-block p50 110 against 250 us). Such a syscall blocks for long only on memory
            # the peer made slow (swapped out, userfaultfd): a process of the same user, which
            # the kernel already lets stop or trace us at will, so this opens nothing new.
            return vm_copy(name, self.pid, plan.dst, plan.src, plan.nbytes, token, self.pidfd)
        parts = split_plan(plan, 2 if plan.total_bytes >= _VM_SPLIT_BYTES else 1)
        if self._vm_limiter is None:  # made on first use: it needs the running backend
            self._vm_limiter = anyio.CapacityLimiter(2)
        # Two threads at most: many concurrent requests queue rather than thrash the cores.
        return await run_parts(
            [
                functools.partial(
                    vm_copy, name, self.pid, p.dst, p.src, p.nbytes, token, self.pidfd
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

    def copy_now(
        self,
        remote: np.ndarray,
        local: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
        read: bool,
    ) -> int | None:
        """A few ranges on the loop, as :meth:`_move` does for small plans: inside the peer's
        mapped pools, one memmove each (up to ``_POOL_INLINE_BYTES``); in user-registered
        memory, one ``process_vm_*`` (up to ``_VM_INLINE_BYTES``)."""
        if len(remote) > INLINE_RANGES:
            return None
        total = u64_sum(nbytes)
        mapped = self._translate(remote, nbytes) if self.pools else None
        # (found in the pools, and not only zero-length ranges at a pool's end: those, and no
        # range at all, go where a first look for the pools sent them)
        if mapped is not None and (total or self._touches_pool(remote)):
            if total > _POOL_INLINE_BYTES:
                return None
            if token.cancelled:
                raise CopyCancelled
            ours = local.tolist()
            src, dst = (mapped, ours) if read else (ours, mapped)
            return copy_inline(src, dst, nbytes.tolist(), token)
        if self._touches_pool(remote):
            return None  # partly in a mapped pool: _move splits it
        if not self.pvr or total > _VM_INLINE_BYTES:
            return None
        name = "process_vm_readv" if read else "process_vm_writev"
        return vm_copy(name, self.pid, local, remote, nbytes, token, self.pidfd)

    def _translate(self, remote: np.ndarray, nbytes: np.ndarray) -> list[int] | None:
        """Our addresses of a few ranges of the peer's, each inside one mapped pool; None if
        any is not (Python ints for a few ranges, numpy for many)."""
        if len(remote) > _TRANSLATE_FEW:
            where = self._pool_index(remote, nbytes)
            if bool((where < 0).any()):
                return None
            ours: list[int] = (
                (remote.astype(np.int64) + self._delta[where]).astype(np.uint64).tolist()
            )
            return ours
        addrs, lens = remote.tolist(), nbytes.tolist()
        if len(addrs) > _TRANSLATE_ONE_SEARCH and len(lens) == len(addrs):
            # Most requests lie in one pool (a cache is one): a few reductions in C then stand
            # for a search per range. The pool is the highest address's: every address lies
            # between its base and the next pool's, where each one's own search finds it too.
            j = bisect.bisect_right(self._base_list, max(addrs)) - 1
            if (
                j >= 0
                and min(addrs) >= self._base_list[j]
                and max(map(operator.add, addrs, lens)) <= self._end_list[j]
            ):
                delta = self._delta_list[j]
                return [a + delta for a in addrs]
        out: list[int] = []
        for a, n in zip(addrs, lens, strict=True):
            j = bisect.bisect_right(self._base_list, a) - 1
            if j < 0 or a + n > self._end_list[j]:
                return None
            out.append(a + self._delta_list[j])
        return out

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


def open_access(
    pid: int,
    pidfd: int | None,
    proof: Proof,
    fds: Sequence[int],
    copy: CopyRunner,
    log: Any,
) -> SameHostAccess | None:
    """Access to peer process ``pid`` (another process of our uid the kernel named) from its
    side-channel ``proof`` and the pool descriptors that came with it (they stay the caller's);
    None, its refusals logged, when neither a pool nor ``process_vm_*`` reaches it. Takes
    ``pidfd``."""
    claimed = proof.pools  # None: a malformed claim
    pools: list[tuple[int, Any, Any]] = []
    if claimed is not None and len(claimed) == len(fds):
        pools = [(fd, p[0], p[1]) for fd, p in zip(fds, claimed, strict=True)]
    elif claimed is None or claimed or fds:
        log.info(
            "side_channel.pools_refused",
            reason=f"{len(fds)} descriptors for {len(claimed or ())} pools",
        )
    access = SameHostAccess(pid, pidfd, pools, proof.probe, copy)
    if access.refused:
        log.info("side_channel.pools_refused", reason="; ".join(access.refused))
    if not access.pools and not access.pvr:
        access.close()
        return None
    if not access.pvr:
        log.info(
            "transport.fallback",
            reason="process_vm_readv is not permitted here: registered (non-pool) "
            "memory of this peer moves over TCP; pool memory is still shared",
        )
    return access
