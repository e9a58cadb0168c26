"""``process_vm_readv`` / ``process_vm_writev``: copies between this process and a peer's
memory by address, with the kernel's ptrace check (the same-host access's path to memory that
is not in a shared pool), and whether the process behind a ``pidfd`` has exited."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import select
import struct
from typing import Any

import numpy as np

from .._errors import CopyCancelled
from .._memory import CancelToken

__all__ = ["VM_FEW", "pidfd_exited", "pvr_probe", "vm_copy"]

_IOV_MAX = 1024
_BATCH_BYTES = 64 << 20


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
VM_FEW = 16
#: ``struct iovec`` arrays of n entries (base, length: two native 64-bit words each)
_IOVECS = {n: struct.Struct(f"={2 * n}Q") for n in range(1, VM_FEW + 1)}


def _iovecs(addrs: list[int], lens: list[int]) -> bytes:
    """A few iovecs, packed (a ctypes Structure per entry costs microseconds each)."""
    return _IOVECS[len(lens)].pack(*[x for pair in zip(addrs, lens, strict=True) for x in pair])


def pidfd_exited(pidfd: int | None) -> bool:
    """True once the process behind ``pidfd`` has exited (its pid may then be reused)."""
    if pidfd is None:
        return False
    return bool(select.select([pidfd], [], [], 0)[0])


def vm_copy(
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
        if pidfd_exited(pidfd):
            raise OSError(f"peer process {pid} exited")
        liov: Any
        riov: Any
        if n <= VM_FEW:
            # A few ranges: one call, iovecs built from Python ints (numpy's fixed cost per
            # call is most of a small copy's time).
            j = n
            lens = nbytes.tolist()
            liov = _iovecs(local.tolist(), lens)
            riov = _iovecs(remote.tolist(), lens)
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
        vm_copy(
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
