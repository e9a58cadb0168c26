"""Host memory: views of raw addresses, user objects as memory, and shareable memory pools.

Pools are ``memfd`` files mapped into this process, sealed against shrinking and growing once
sized. A peer on the same host (of our user) maps the very same pages from the descriptor we
pass it over the side channel, which is what makes same-host transfers a single copy; the seal
is what lets it map them without fearing SIGBUS.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import mmap
import operator
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from ._enums import LLMStatusCode
from ._errors import CopyCancelled, LLMException, raise_if_false

__all__ = [
    "CancelToken",
    "EpochPage",
    "MemoryPool",
    "PageAllocator",
    "PoolAllocation",
    "check_memory_dtype",
    "copy_inline",
    "copy_lists",
    "copy_ranges",
    "host_view",
    "memory_view",
    "resolve_host_memory",
    "run_parts",
]


# A view of raw memory straight from the interpreter: ``(c_ubyte * n).from_address`` makes a
# new ctypes type for every new ``n`` (16 us, then the collector's work), and the spans of
# shuffled blocks are new sizes on nearly every request.
_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``addr`` in this process (no copy), at the same
    cost whatever its size.

    The caller guarantees that the memory stays mapped while the view is used.

    Raises:
        ValueError: a negative ``nbytes``.
    """
    if nbytes < 0:
        raise ValueError(f"a view of {nbytes} bytes")
    view: memoryview = _from_memory(addr, nbytes, _PYBUF_WRITE)
    return view


def host_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of ``nbytes`` at ``addr`` in this process (no copy).

    The caller guarantees that the memory stays mapped while the view is used.

    Raises:
        ValueError: a negative ``nbytes``.
    """
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(memory_view(addr, nbytes), dtype=np.uint8)


def _numpy_typed(obj: Any) -> Any:
    """A CPU torch tensor of a type numpy lacks (bfloat16, float8...) as a uint8 view of the
    same memory (no copy); anything else unchanged."""
    dtype = getattr(obj, "dtype", None)
    if dtype is None or not type(dtype).__module__.startswith("torch"):
        return obj
    if isinstance(memory_dtype(obj), np.dtype) or getattr(obj.device, "type", None) != "cpu":
        return obj
    import torch

    try:
        return obj.view(torch.uint8)
    except RuntimeError:
        return obj


def resolve_host_memory(obj: Any, nbytes: int, name: str) -> tuple[int, Any]:
    """Turn a registration argument into ``(address, keepalive)``.

    Accepts a raw integer address (the caller owns the memory), or any object exposing
    ``__dlpack__``, ``__array_interface__`` or the buffer protocol (numpy arrays, CPU torch
    tensors, bytearray, mmap...). Objects must be C-contiguous, writable and hold at least
    ``nbytes`` bytes; they are kept alive by the returned keepalive.

    Raises:
        TypeError: an object that exposes no memory.
        LLMException: LLM_PARAM_INVALID for address 0, or memory that is too small,
            not contiguous, read-only or not in host memory.
    """
    if isinstance(obj, int | np.integer) and not isinstance(obj, bool):
        raise_if_false(int(obj) != 0, f"{name} is address 0")
        raise_if_false(int(obj) > 0, f"{name} is a negative address")
        return int(obj), None
    arr: np.ndarray | None = None
    if hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray):
        try:
            arr = np.from_dlpack(_numpy_typed(obj))
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise LLMException(
                f"{name}: {type(obj).__name__} is not in host memory ({exc}); accelerator "
                "tensors need the torch device adapter (llm.DeviceAdapter=torch)",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from None
    if arr is None:
        try:
            arr = np.asarray(obj) if hasattr(obj, "__array_interface__") else None
            if arr is None:
                arr = np.frombuffer(memoryview(obj), dtype=np.uint8)
        except TypeError:
            raise TypeError(
                f"{name} must be an int address or an object with the buffer protocol, "
                f"__array_interface__ or __dlpack__, got {type(obj).__name__}"
            ) from None
    raise_if_false(arr.flags.c_contiguous, f"{name} is not C-contiguous")
    raise_if_false(arr.flags.writeable, f"{name} is read-only")
    raise_if_false(
        arr.nbytes >= nbytes, f"{name} holds {arr.nbytes} bytes but the tensor needs {nbytes}"
    )
    raise_if_false(arr.nbytes > 0, f"{name} is empty")
    return int(arr.ctypes.data), (obj, arr)


def memory_dtype(obj: Any) -> np.dtype[Any] | str | None:
    """The element type of a memory object without touching its memory: a numpy dtype, a
    torch dtype's name (``"bfloat16"``, ...) when numpy has no such type, or None when the
    object carries none (a raw address, an untyped buffer, an object it cannot tell)."""
    if isinstance(obj, int | np.integer):
        return None
    if isinstance(obj, np.ndarray):
        return obj.dtype
    try:
        iface = getattr(obj, "__array_interface__", None)
        if isinstance(iface, dict) and "typestr" in iface:
            return np.dtype(iface["typestr"])
        dtype = getattr(obj, "dtype", None)
        if dtype is not None and type(dtype).__module__.startswith("torch"):
            name = str(dtype).removeprefix("torch.")
            try:
                return np.dtype(name)
            except TypeError:
                return name  # bfloat16, float8 variants: no numpy equivalent
        if hasattr(obj, "__dlpack__"):
            return np.from_dlpack(obj).dtype
        fmt = memoryview(obj).format
    except (BufferError, RuntimeError, TypeError, ValueError, AttributeError):
        return None
    try:
        return np.dtype(fmt) if fmt not in ("B", "b", "c") else None
    except TypeError:
        return None


#: element type names that also match a ``DataType`` (numpy has no bfloat16; ml_dtypes and torch
#: call it so)
_DTYPE_ALIASES = {"DT_BF16": ("bfloat16",)}


def check_memory_dtype(obj: Any, data_type: Any, name: str) -> None:
    """Refuse a memory object whose element type is not ``data_type`` (a ``DataType``).

    Raw addresses, untyped buffers (bytearray, mmap, ...) and byte-typed arrays (uint8, void,
    bytes) describe no element type and pass; so does a ``uint16`` array for ``DT_BF16``
    (numpy has no bfloat16; the cache's views are raw uint16 too).

    Raises:
        LLMException: LLM_PARAM_INVALID when the types differ.
    """
    got = memory_dtype(obj)
    if got is None:
        return
    want = np.dtype(data_type.numpy_dtype)
    aliases = _DTYPE_ALIASES.get(data_type.name, ())
    if isinstance(got, np.dtype):
        if got.kind == "V" or (got.kind in "uS" and got.itemsize == 1):
            return  # bytes
        if got == want or got.name in aliases:
            return
        shown = got.name if got.isnative or got.byteorder == "|" else got.str
    else:
        if got in aliases:
            return
        shown = got
    raise LLMException(
        f"{name} holds {shown} elements but the CacheDesc says {data_type.name} "
        f"({want.name} in numpy); pass {want.name} memory, raw bytes (uint8) or an address",
        status_code=LLMStatusCode.LLM_PARAM_INVALID,
    )


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """A memory pool: ``memory_size`` bytes in pages of ``2**page_shift`` bytes."""

    memory_size: int
    page_shift: int = 16

    @property
    def page_size(self) -> int:
        return 1 << self.page_shift


@dataclasses.dataclass(frozen=True)
class PoolAllocation:
    """A run of pages handed out by a :class:`MemoryPool`."""

    offset: int
    nbytes: int
    addr: int


class PageAllocator:
    """First-fit page runs over ``pages`` pages; freed runs merge with their neighbours.

    Thread-safe. Knows offsets only; the pools around it own the memory.
    """

    def __init__(self, pages: int, page_size: int) -> None:
        self.pages = pages
        self.page_size = page_size
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0]
        self._free_len: dict[int, int] = {0: pages}

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_len.values()) * self.page_size

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """``(offset, nbytes rounded up to pages)``.

        Raises:
            LLMException: LLM_OUT_OF_MEMORY when no free run is large enough.
        """
        need = max(1, -(-nbytes // self.page_size))
        with self._lock:
            for start in self._free_starts:
                run = self._free_len[start]
                if run >= need:
                    i = bisect.bisect_left(self._free_starts, start)
                    del self._free_starts[i]
                    del self._free_len[start]
                    if run > need:
                        bisect.insort(self._free_starts, start + need)
                        self._free_len[start + need] = run - need
                    return start * self.page_size, need * self.page_size
            largest = max(self._free_len.values(), default=0) * self.page_size
            free = sum(self._free_len.values()) * self.page_size
        raise LLMException(
            f"memory pool exhausted: {nbytes} bytes requested, {free} free "
            f"(fragmented into runs of at most {largest} bytes)",
            status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
        )

    def free(self, offset: int, nbytes: int) -> None:
        start = offset // self.page_size
        n = nbytes // self.page_size
        with self._lock:
            i = bisect.bisect_left(self._free_starts, start)
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free_len[prev] == start:
                    start, n = prev, n + self._free_len.pop(prev)
                    del self._free_starts[i - 1]
                    i -= 1
            if i < len(self._free_starts) and self._free_starts[i] == start + n:
                n += self._free_len.pop(self._free_starts[i])
                del self._free_starts[i]
            self._free_starts.insert(i, start)
            self._free_len[start] = n


class PagedPool:
    """``[base, base + nbytes)`` handed out in whole-page runs; subclasses provide the memory
    (and set ``base``)."""

    base: int

    def __init__(self, config: PoolConfig, name: str) -> None:
        self.page_size = config.page_size
        pages = config.memory_size // self.page_size
        raise_if_false(pages > 0, f"{name} pool is smaller than one page")
        self.nbytes = pages * self.page_size
        self._pages = PageAllocator(pages, self.page_size)

    @property
    def free_bytes(self) -> int:
        return self._pages.free_bytes

    def allocate(self, nbytes: int) -> PoolAllocation:
        """Take ``nbytes`` rounded up to whole pages.

        Raises:
            LLMException: LLM_OUT_OF_MEMORY when no free run is large enough.
        """
        off, n = self._pages.allocate(nbytes)
        return PoolAllocation(off, n, self.base + off)

    def free(self, alloc: PoolAllocation) -> None:
        """Return an allocation's pages to the pool."""
        self._pages.free(alloc.offset, alloc.nbytes)


def sealed_memfd(name: str, nbytes: int) -> int:
    """A ``memfd`` of ``nbytes`` that nobody (not us, not a peer we pass it to) can shrink or
    grow: a peer maps it knowing no access can fault past its end (SIGBUS).

    Raises:
        OSError: the kernel refused (out of memory, no memfd sealing).
    """
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
        fd = os.memfd_create(name, os.MFD_CLOEXEC)  # no sealing here: peers won't map it
    try:
        os.ftruncate(fd, nbytes)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        except OSError as exc:
            # A kernel or sandbox without sealing: the memfd still works here, and a peer
            # refuses to map an unsealed one (its ranges go over process_vm_* or TCP).
            if exc.errno not in (errno.EINVAL, errno.EPERM, errno.ENOSYS):
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd


class MemoryPool(PagedPool):
    """Host pool memory: one shareable ``memfd`` mapping carved by a :class:`PageAllocator`."""

    def __init__(self, config: PoolConfig, name: str) -> None:
        super().__init__(config, name)
        try:
            self.fd = sealed_memfd(f"llmdd-{name}", self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes)
        except OSError as exc:
            raise LLMException(
                f"cannot create the {name} memory pool of {self.nbytes} bytes: {exc}",
                status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
            ) from None
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = int(self.array.ctypes.data)
        self.pid = os.getpid()

    def view(self, alloc: PoolAllocation, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 view inside ``alloc``; it keeps the mapping alive while it exists."""
        lo = alloc.offset + offset
        return self.array[lo : lo + nbytes]

    def close(self) -> None:
        """Drop this pool. Views still held by users keep the pages mapped until they go."""
        self.array = np.zeros(0, dtype=np.uint8)
        # With user views still alive the mapping stays until the last of them goes.
        with contextlib.suppress(BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class CancelToken:
    """A thread-safe flag that worker threads check between chunks of work.

    It also trips by itself once ``deadline`` (``time.monotonic()`` seconds) has passed, so
    workers stop at a task's deadline without the event loop having to reach them.
    """

    __slots__ = ("_set", "deadline", "parent", "reason")

    def __init__(self, deadline: float | None = None, parent: CancelToken | None = None) -> None:
        # A plain flag: one attribute store is atomic under the GIL, and workers only poll it
        # (a threading.Event costs a lock and a condition per request on the hot path).
        self._set = False
        self.reason: BaseException | None = None
        self.deadline = deadline
        self.parent = parent

    def child(self, deadline: float | None = None) -> CancelToken:
        """A token that trips with this one, or by itself (its own cancel or deadline)."""
        return CancelToken(deadline, self)

    def cancel(self, reason: BaseException | None = None) -> None:
        if self.reason is None:
            self.reason = reason
        self._set = True

    @property
    def cancelled(self) -> bool:
        if self._set:
            return True
        if self.parent is not None and self.parent.cancelled:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline


# Splitting big copies hurts: glibc switches to non-temporal stores only for very large
# memmoves (machine_limits.md), so only copies above this size are cut for cancellation checks.
_MAX_PIECE = 256 << 20
_CHECK_EVERY = 64
#: copies of at most this many ranges (and a MiB) run on the event loop: a range costs about
#: a microsecond and a half of ctypes, so even the most take a couple of milliseconds, and a
#: thread hop costs more than a small copy. A KV block of a many-layer model is a range per
#: tensor (160 for 80 layers of K and V): 64 sent such one-block pulls to a worker thread.
INLINE_RANGES = 1024


def copy_ranges(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, token: CancelToken | None = None
) -> int:
    """memmove every descriptor in order, in the calling (worker) thread; returns bytes copied.

    ctypes releases the GIL during each memmove, so other threads and the event loop run.

    Raises:
        CopyCancelled: ``token`` was cancelled; descriptors after the current one are untouched.
    """
    return copy_lists(src.tolist(), dst.tolist(), nbytes.tolist(), token)


def copy_lists(
    src: list[int], dst: list[int], nbytes: list[int], token: CancelToken | None = None
) -> int:
    """:func:`copy_ranges` over Python ints (a few ranges, where the caller has them).

    Raises:
        CopyCancelled: ``token`` was cancelled; descriptors after the current one are untouched.
    """
    memmove = ctypes.memmove
    done = 0
    for i, (s, d, n) in enumerate(zip(src, dst, nbytes, strict=True)):
        if token is not None and (n > _MAX_PIECE or i % _CHECK_EVERY == 0) and token.cancelled:
            raise CopyCancelled
        while n > _MAX_PIECE:
            memmove(d, s, _MAX_PIECE)
            s, d, n, done = s + _MAX_PIECE, d + _MAX_PIECE, n - _MAX_PIECE, done + _MAX_PIECE
            if token is not None and token.cancelled:
                raise CopyCancelled
        memmove(d, s, n)
        done += n
    return done


#: an inline copy of at least this many ranges slices two views over their spans: a slice
#: assignment costs half a ctypes memmove (which is worth its cost only where it lets the GIL
#: go, in a worker thread)
_SLICED_FROM = 8


def copy_inline(
    src: list[int], dst: list[int], nbytes: list[int], token: CancelToken | None = None
) -> int:
    """:func:`copy_lists` on the event loop, for a small copy (a MiB or so): it keeps the GIL
    throughout. Returns the bytes copied.

    Raises:
        CopyCancelled: ``token`` was cancelled (nothing was copied).
    """
    if len(nbytes) < _SLICED_FROM:
        return copy_lists(src, dst, nbytes, token)
    if token is not None and token.cancelled:
        raise CopyCancelled
    # Views over each side's span: the gaps between ranges are never touched (every range was
    # checked against memory that is ours or mapped).
    s_lo, d_lo = min(src), min(dst)
    if not len(src) == len(dst) == len(nbytes):
        raise ValueError("copy lists differ in length")
    s_hi = max(map(operator.add, src, nbytes))
    d_hi = max(map(operator.add, dst, nbytes))
    sv, dv = memory_view(s_lo, s_hi - s_lo), memory_view(d_lo, d_hi - d_lo)
    for s, d, n in zip(src, dst, nbytes, strict=True):
        s, d = s - s_lo, d - d_lo
        dv[d : d + n] = sv[s : s + n]
    return sum(nbytes)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc_madvise: Any = None


def populate(addrs: np.ndarray, nbytes: int) -> int:
    """Fault in (writable) the pages under ``nbytes`` at each address, without changing a
    byte: ``madvise(MADV_POPULATE_WRITE)``, what an RDMA engine's registration does by
    pinning. Runs in a worker thread; returns the bytes populated (0 where the kernel cannot:
    older kernels, device or special memory, which then fault on first use as before).
    """
    global _libc_madvise
    if _libc_madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        _libc_madvise = libc.madvise
        _libc_madvise.restype = ctypes.c_int
        _libc_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    done = 0
    for a in np.asarray(addrs, dtype=np.uint64).tolist():
        start = int(a) & ~(page - 1)
        end = (int(a) + nbytes + page - 1) & ~(page - 1)
        if end > start and _libc_madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
            done += end - start
    return done


class EpochPage:
    """One shareable page holding a counter that this endpoint bumps whenever a cache id is
    released.

    Same-host peers map it (like a pool) and read it with a plain load before and after a
    one-sided pull: an unchanged epoch means every cache in their table snapshot was still
    registered for the whole copy. A peer cannot stall that read (it is our own mapping of
    shared memory, not a syscall into its address space).
    """

    nbytes = mmap.PAGESIZE

    def __init__(self) -> None:
        self.fd = sealed_memfd("llmdd-epoch", self.nbytes)
        try:
            self._map = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._word = np.frombuffer(self._map, dtype=np.uint64, count=1)
        self.base = int(self._word.ctypes.data)

    @property
    def value(self) -> int:
        return int(self._word[0])

    def bump(self) -> None:
        # Before the memory is released: a copy that overlaps the release sees the change.
        self._word[0] += np.uint64(1)

    def close(self) -> None:
        del self._word
        with contextlib.suppress(BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


async def run_parts(parts: list[Callable[[], int]], limiter: anyio.CapacityLimiter | None) -> int:
    """Run blocking ``parts`` (pieces of one copy) on worker threads at once; returns the sum
    of their results. Every part has finished when this returns or raises.

    Raises:
        CopyCancelled: if any part was cancelled; else the first exception a part raised
            (one exception, never an ExceptionGroup, so callers can tell what happened).
    """
    if len(parts) == 1:
        result: int = await anyio.to_thread.run_sync(parts[0], limiter=limiter)
        return result
    results = [0] * len(parts)
    errors: list[Exception] = []

    async def one(i: int, fn: Callable[[], int]) -> None:
        try:
            results[i] = await anyio.to_thread.run_sync(fn, limiter=limiter)
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for i, fn in enumerate(parts):
            tg.start_soon(one, i, fn)
    if errors:
        raise next((e for e in errors if isinstance(e, CopyCancelled)), errors[0])
    return sum(results)
