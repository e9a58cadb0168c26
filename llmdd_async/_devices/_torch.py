"""The torch adapter: ``Placement.DEVICE`` memory is torch tensors on an accelerator.

Selected with ``llm.DeviceAdapter=torch``; ``llm.TorchDevice`` names the device (``cuda``,
``cuda:1``, ``npu``, ... default: ``cuda`` when available, else ``npu``). ``cpu`` runs the very
same code paths on CPU tensors treated as device memory (nothing host-addressable is assumed),
which is how machines without an accelerator test this adapter.

* Registration takes torch tensors on that device (kept alive), or raw device pointers (wrapped
  through ``__cuda_array_interface__`` on CUDA).
* Copies run as ``Tensor.copy_`` on a side stream; the worker waits for the stream in a thread.
* Socket transfers stage through (pinned, on CUDA) host buffers, one chunk at a time.
* :class:`TorchLayerEvents` is a layer synchronizer fed by device events recorded after each
  layer's compute.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import anyio.to_thread
import numpy as np

from .._enums import LLMStatusCode
from .._errors import CopyCancelled, LLMException, raise_if_false
from .._memory import CancelToken, PagedPool, PoolAllocation, PoolConfig, host_view
from .._planner import Plan
from .._synchronizer import LayerEvents

try:
    import torch
except ImportError as exc:  # re-raised by load_adapter with the extra to install
    raise ImportError("the torch adapter needs PyTorch (pip install torch)") from exc

__all__ = ["TorchAdapter", "TorchLayerEvents", "TorchPool", "create"]


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "npu") and torch.npu.is_available():  # torch_npu (Ascend)
        return "npu"
    raise LLMException(
        "llm.DeviceAdapter=torch found no accelerator (no CUDA, no torch_npu); set "
        "llm.TorchDevice=cpu to run the adapter on CPU tensors",
        status_code=LLMStatusCode.LLM_PARAM_INVALID,
    )


class _Regions:
    """Device memory the adapter knows, by address: base -> flat uint8 tensor."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._items: dict[int, tuple[int, Any]] = {}
        self._lock = threading.Lock()

    def add(self, base: int, tensor: Any) -> None:
        with self._lock:
            if base not in self._items:
                bisect.insort(self._starts, base)
            self._items[base] = (int(tensor.numel()), tensor)

    def remove(self, base: int) -> None:
        with self._lock:
            if self._items.pop(base, None) is not None:
                self._starts.remove(base)

    def find(self, addr: int, nbytes: int) -> Any | None:
        """A view of ``[addr, addr + nbytes)`` if it lies inside a known region, else None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            base = self._starts[i]
            size, tensor = self._items[base]
        if addr + nbytes > base + size:
            return None
        return tensor.narrow(0, addr - base, nbytes)

    def owns(self, addrs: np.ndarray) -> bool:
        return any(self.find(int(a), 1) is not None for a in addrs[:1])


class TorchPool(PagedPool):
    """``allocate_cache`` memory on the device: one tensor carved into page runs."""

    def __init__(self, adapter: TorchAdapter, config: PoolConfig) -> None:
        super().__init__(config, "device")
        try:
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=adapter.device)
        except (RuntimeError, MemoryError) as exc:
            raise LLMException(
                f"cannot allocate the device pool of {self.nbytes} bytes: {exc}",
                status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
            ) from None
        self.base = int(self.tensor.data_ptr())
        self._adapter = adapter
        adapter.regions.add(self.base, self.tensor)

    def view(self, alloc: PoolAllocation, offset: int, nbytes: int) -> Any:
        return self.tensor.narrow(0, alloc.offset + offset, nbytes)

    def close(self) -> None:
        self._adapter.regions.remove(self.base)


class TorchAdapter:
    """Device memory through PyTorch (CUDA, Ascend NPU, or CPU for testing)."""

    name = "torch"
    host_addressable = False

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.regions = _Regions()
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._staging: list[Any] = []
        self._staging_lock = threading.Lock()

    # ---------------------------------------------------------------- memory
    def resolve(self, obj: Any, nbytes: int, name: str) -> tuple[int, Any]:
        """A tensor on this device (or a raw device pointer) -> (address, keepalive).

        Raises:
            LLMException: LLM_PARAM_INVALID for a tensor elsewhere, not contiguous or too small,
                or a raw pointer that cannot be wrapped.
        """
        if isinstance(obj, int | np.integer) and not isinstance(obj, bool):
            raise_if_false(int(obj) != 0, f"{name} is address 0")
            tensor = self._wrap_pointer(int(obj), nbytes, name)
        else:
            raise_if_false(
                isinstance(obj, torch.Tensor),
                f"{name}: the torch adapter registers torch tensors on {self.device} "
                f"(or raw device pointers), got {type(obj).__name__}",
            )
            raise_if_false(
                obj.device.type == self.device.type,
                f"{name} is on {obj.device}, not on {self.device}",
            )
            raise_if_false(obj.is_contiguous(), f"{name} is not contiguous")
            tensor = obj.view(-1).view(torch.uint8) if obj.numel() else obj
            raise_if_false(
                tensor.numel() >= nbytes,
                f"{name} holds {tensor.numel()} bytes but the tensor needs {nbytes}",
            )
        flat = tensor.view(-1)[:nbytes]
        addr = int(flat.data_ptr())
        self.regions.add(addr, flat)
        return addr, _Registered(self, addr, obj, flat)

    def _wrap_pointer(self, addr: int, nbytes: int, name: str) -> Any:
        if self.device.type == "cpu":
            return torch.from_numpy(host_view(addr, nbytes))
        if self.is_cuda:

            class _Cai:
                __cuda_array_interface__ = {  # noqa: RUF012 - a one-off wrapper
                    "shape": (nbytes,),
                    "typestr": "|u1",
                    "data": (addr, False),
                    "version": 3,
                }

            return torch.as_tensor(_Cai(), device=self.device)
        raise LLMException(
            f"{name}: raw {self.device.type} pointers cannot be wrapped; register the tensors",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )

    def create_pool(self, config: PoolConfig, name: str) -> TorchPool:
        return TorchPool(self, config)

    def owns(self, addrs: np.ndarray) -> bool:
        """True if these addresses are this adapter's device memory."""
        return len(addrs) > 0 and self.regions.owns(addrs)

    def _view(self, addr: int, nbytes: int) -> Any:
        t = self.regions.find(addr, nbytes)
        if t is None:  # host memory on the other side of the copy
            t = torch.from_numpy(host_view(addr, nbytes))
        return t

    # ---------------------------------------------------------------- copies
    def _run_copies(self, pairs: Iterable[tuple[Any, Any]], token: CancelToken) -> None:
        """Queue ``dst.copy_(src)`` for every pair, then wait for the stream (worker thread).

        ``pairs`` is consumed here, so building one view per range stays off the event loop.
        """
        on_stream = self.stream is not None
        with torch.cuda.stream(self.stream) if on_stream else contextlib.nullcontext():
            for dst, src in pairs:
                if token.cancelled:
                    break
                dst.copy_(src, non_blocking=on_stream)
        if self.stream is not None:
            # Fence: nothing of this plan is in flight on the device once this returns.
            self.stream.synchronize()
        if token.cancelled:
            raise CopyCancelled

    async def copy(self, plan: Plan, token: CancelToken) -> int:
        if len(plan) == 0:
            return 0
        pairs = (
            (self._view(d, n), self._view(s, n))
            for s, d, n in zip(
                plan.src.tolist(), plan.dst.tolist(), plan.nbytes.tolist(), strict=True
            )
        )
        await anyio.to_thread.run_sync(self._run_copies, pairs, token)
        return plan.total_bytes

    def staging(self, nbytes: int, allocate: bool = True) -> Any:
        """A host buffer (pinned on CUDA) for socket transfers; give it back with unstage.
        None if none is kept for reuse and ``allocate`` is False (a pinned allocation takes
        milliseconds)."""
        with self._staging_lock:
            for i, buf in enumerate(self._staging):
                if buf.numel() >= nbytes:
                    return self._staging.pop(i)
        if not allocate:
            return None
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)

    def unstage(self, buf: Any) -> None:
        with self._staging_lock:
            if len(self._staging) < 4:
                self._staging.append(buf)

    def _buffer_pairs(
        self, buf: Any, addrs: list[int], lens: list[int], to_buffer: bool
    ) -> Iterator[tuple[Any, Any]]:
        """(dst, src) pairs between device ranges and consecutive spans of host ``buf``."""
        pos = 0
        for a, n in zip(addrs, lens, strict=True):
            dev, host = self._view(a, n), buf.narrow(0, pos, n)
            yield (host, dev) if to_buffer else (dev, host)
            pos += n

    async def gather(self, addrs: list[int], lens: list[int], buf: Any, token: CancelToken) -> None:
        """Copy device ranges, in order, into the start of host buffer ``buf``."""
        pairs = self._buffer_pairs(buf, addrs, lens, to_buffer=True)
        await anyio.to_thread.run_sync(self._run_copies, pairs, token)

    async def scatter(
        self, buf: Any, addrs: list[int], lens: list[int], token: CancelToken
    ) -> None:
        """Copy the start of host buffer ``buf`` into device ranges, in order."""
        pairs = self._buffer_pairs(buf, addrs, lens, to_buffer=False)
        await anyio.to_thread.run_sync(self._run_copies, pairs, token)

    def close(self) -> None:
        self._staging.clear()


class _Registered:
    """Keeps a registered tensor alive and forgets its region when the cache goes."""

    def __init__(self, adapter: TorchAdapter, addr: int, obj: Any, flat: Any) -> None:
        self._adapter, self._addr, self.obj, self.flat = adapter, addr, obj, flat

    def __getitem__(self, i: int) -> Any:  # (obj, array) shape of host keepalives
        return (self.obj, self.flat)[i]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._adapter.regions.remove(self._addr)


class DeviceEventWaiter:
    """Runs callbacks once the device has reached the point where each was recorded.

    One helper thread waits on the events in order; it starts when an event is queued and
    exits when none is left, so an idle waiter holds no thread.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Any, Callable[[], None]]] = collections.deque()
        self._lock = threading.Lock()
        self._running = False

    def record(self, callback: Callable[[], None], stream: Any = None) -> None:
        """Record a device event on ``stream`` (default: the current one) and call
        ``callback`` from the helper thread once the device has passed it; at once without
        CUDA (CPU tensors: the work already happened)."""
        if not torch.cuda.is_available():
            callback()
            return
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._queue.append((event, callback))
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, daemon=True, name="llmdd-device-events").start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                event, callback = self._queue.popleft()
            event.synchronize()
            callback()


class TorchLayerEvents(LayerEvents):
    """A layer synchronizer fed by device events.

    Call :meth:`record` right after launching a layer's compute (on the compute stream); the
    layer counts as ready once the device reached that point. The wait happens in a helper
    thread, never on the event loop or the compute thread.
    """

    def __init__(self, num_layers: int | None = None) -> None:
        super().__init__(num_layers)
        self._waiter = DeviceEventWaiter()

    def record(self, layer_index: int, stream: Any = None) -> None:
        """Record a device event for ``layer_index`` on ``stream`` (default: current).

        Raises:
            TypeError / LLMException: as :meth:`LayerEvents.layer_ready`, here rather than
                later in the waiter thread.
        """
        self.check_index(layer_index)
        self._waiter.record(lambda: self.layer_ready(layer_index), stream)


def create(options: dict[str, str]) -> TorchAdapter:
    """Raises LLMException(LLM_PARAM_INVALID) without a usable device."""
    device = options.get("llm.TorchDevice") or _default_device()
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise LLMException(
            f"llm.TorchDevice {device!r} is not a torch device: {exc}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None
    return TorchAdapter(device)
