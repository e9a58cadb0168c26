"""Layer synchronizers: how a forward pass tells the scheduler "layer i is ready to send"."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable

__all__ = ["AsyncLayerSynchronizer", "LayerEvents", "LayerSynchronizer"]


class LayerSynchronizer(abc.ABC):
    """Upstream's blocking synchronizer. The scheduler calls it in a worker thread, once per
    source layer in increasing order, before that layer is sent; never on the event loop.

    Returning False (or raising) aborts the whole task.
    """

    @abc.abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until ``layer_index`` may be sent; return False to abort."""


class AsyncLayerSynchronizer(abc.ABC):
    """The async variant: awaited on the event loop, so it must not block."""

    @abc.abstractmethod
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Return once ``layer_index`` may be sent; return False to abort."""


class LayerEvents(LayerSynchronizer):
    """A ready-made synchronizer that a forward pass signals with :meth:`layer_ready`.

    Thread-safe: the compute loop may run in any thread (or on the event loop itself).
    ``timeout_in_millis`` bounds each wait when given (upstream always passes None).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: set[int] = set()
        self._failed: BaseException | None = None
        self._aborted = False
        self._wakers: dict[int, list[Callable[[], None]]] = {}

    def layer_ready(self, layer_index: int) -> None:
        """Mark ``layer_index`` computed; a waiting transfer of that layer starts at once."""
        with self._cond:
            self._ready.add(layer_index)
            self._cond.notify_all()
            wakers = self._wakers.pop(layer_index, [])
        for wake in wakers:
            wake()

    def abort(self, error: BaseException | None = None) -> None:
        """Make every pending and future wait fail: the transfer task aborts."""
        with self._cond:
            self._aborted = True
            self._failed = error
            self._cond.notify_all()
            wakers = [w for ws in self._wakers.values() for w in ws]
            self._wakers.clear()
        for wake in wakers:
            wake()

    def add_waker(self, layer_index: int, wake: Callable[[], None]) -> bool:
        """Call ``wake`` (from whatever thread signals) once the layer is ready or aborted.

        Returns True, without registering, if that is already the case. This is how the
        scheduler waits on the event loop without a thread.
        """
        with self._cond:
            if self._aborted or layer_index in self._ready:
                return True
            self._wakers.setdefault(layer_index, []).append(wake)
            return False

    def result(self, layer_index: int) -> bool:
        """After a wake: True if the layer is ready, False if aborted.

        Raises:
            BaseException: the error given to :meth:`abort`, if any.
        """
        with self._cond:
            if self._aborted:
                if self._failed is not None:
                    raise self._failed
                return False
            return layer_index in self._ready

    def reset(self) -> None:
        """Forget all layers, for reuse by the next request."""
        with self._cond:
            self._ready.clear()
            self._aborted = False
            self._failed = None

    def is_layer_ready(self, layer_index: int) -> bool:
        """Non-blocking check (lets the scheduler skip a worker thread)."""
        with self._cond:
            return layer_index in self._ready and not self._aborted

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until the layer is ready (True) or aborted (False).

        Raises:
            TimeoutError: ``timeout_in_millis`` passed first.
            BaseException: the error given to :meth:`abort`, if any.
        """
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._aborted or layer_index in self._ready, timeout=timeout
            )
        if not ok:
            raise TimeoutError(f"layer {layer_index} was not ready within {timeout_in_millis} ms")
        return self.result(layer_index)
