"""Layer synchronizers: how a forward pass tells the scheduler "layer i is ready to send"."""

from __future__ import annotations

import abc
import operator
import threading
from collections.abc import Callable
from typing import Any

from ._errors import raise_if_false, raise_param

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
    ``num_layers``, when given, is the model's layer count: :meth:`layer_ready` refuses
    indices outside it. (A transfer bounds each wait by ``llm.LayerSyncTimeout``; the
    ``timeout_in_millis`` of :meth:`synchronize_layer` is upstream's, which passes None.)

    Raises:
        LLMException: LLM_PARAM_INVALID for a ``num_layers`` below 1.
        TypeError: a ``num_layers`` that is not an int.
    """

    def __init__(self, num_layers: int | None = None) -> None:
        if num_layers is not None:
            num_layers = _index(num_layers, "num_layers")
            raise_if_false(num_layers >= 1, f"num_layers must be at least 1, got {num_layers}")
        self.num_layers = num_layers
        # A plain lock for the state; the condition only for threads blocked in
        # synchronize_layer, notified only when there are some (a model signals every layer
        # of every request: the lock and a Condition's notify cost microseconds each).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._sleepers = 0
        self._ready: set[int] = set()
        self._failed: BaseException | None = None
        self._aborted = False
        self._wakers: dict[int, list[Callable[[], None]]] = {}

    def layer_ready(self, layer_index: int) -> None:
        """Mark ``layer_index`` computed; a waiting transfer of that layer starts at once.

        Raises:
            TypeError: an index that is not an int (``bool`` included).
            LLMException: LLM_PARAM_INVALID for a negative index, or one at or past
                ``num_layers`` when that was given.
        """
        layer_index = self.check_index(layer_index)
        with self._lock:
            self._ready.add(layer_index)
            if self._sleepers:
                self._cond.notify_all()
            wakers = self._wakers.pop(layer_index, None) if self._wakers else None
        if wakers:
            for wake in wakers:
                wake()

    def check_index(self, layer_index: int) -> int:
        """``layer_index`` as an int, if :meth:`layer_ready` would take it.

        Raises:
            TypeError / LLMException: as :meth:`layer_ready`.
        """
        if type(layer_index) is not int:
            layer_index = _index(layer_index, "layer_index")
        # (no message is formatted unless it is raised: this runs once a layer)
        if layer_index < 0:
            raise_param(f"layer_index must be >= 0, got {layer_index}")
        n = self.num_layers
        if n is not None and layer_index >= n:
            raise_param(f"layer_index {layer_index} is outside the {n} layers of this synchronizer")
        return layer_index

    def abort(self, error: BaseException | None = None) -> None:
        """Make every pending and future wait fail: the transfer task aborts."""
        with self._lock:
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
        with self._lock:
            if self._aborted or layer_index in self._ready:
                return True
            self._wakers.setdefault(layer_index, []).append(wake)
            return False

    def remove_waker(self, layer_index: int, wake: Callable[[], None]) -> None:
        """Forget ``wake`` for ``layer_index`` (its wait ended otherwise: a bound, a cancel),
        so that it holds nothing of its waiter until the layer comes."""
        with self._lock:
            wakers = self._wakers.get(layer_index)
            if wakers is not None and wake in wakers:
                wakers.remove(wake)
                if not wakers:
                    del self._wakers[layer_index]

    def result(self, layer_index: int) -> bool:
        """After a wake: True if the layer is ready, False if aborted.

        Raises:
            BaseException: the error given to :meth:`abort`, if any.
        """
        with self._lock:
            if self._aborted:
                if self._failed is not None:
                    raise self._failed
                return False
            return layer_index in self._ready

    def reset(self) -> None:
        """Forget all layers, for reuse by the next request."""
        with self._lock:
            self._ready.clear()
            self._aborted = False
            self._failed = None

    def is_layer_ready(self, layer_index: int) -> bool:
        """Non-blocking check (lets the scheduler skip a worker thread)."""
        # Without the lock (the scheduler asks once or twice a layer): a ready layer stays
        # ready until reset, and an abort made meanwhile is seen by the next wait.
        return not self._aborted and layer_index in self._ready

    def _settled(self, layer_index: int) -> bool:
        """The layer is ready or the synchronizer aborted (what a waker was called for)."""
        with self._lock:
            return self._aborted or layer_index in self._ready

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Block until the layer is ready (True) or aborted (False).

        Raises:
            TimeoutError: ``timeout_in_millis`` passed first.
            BaseException: the error given to :meth:`abort`, if any.
        """
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        with self._cond:
            self._sleepers += 1
            try:
                ok = self._cond.wait_for(
                    lambda: self._aborted or layer_index in self._ready, timeout=timeout
                )
            finally:
                self._sleepers -= 1
        if not ok:
            raise TimeoutError(f"layer {layer_index} was not ready within {timeout_in_millis} ms")
        return self.result(layer_index)


def _index(value: Any, name: str) -> int:
    """An int (numpy's integers too) that is not a bool.

    Raises:
        TypeError: anything else."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
