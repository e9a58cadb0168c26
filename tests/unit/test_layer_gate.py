"""The wait for a ``LayerEvents`` layer (``llmdd_async._layer_gate.wait_for_layer``), on each
event loop: its signal hops to the loop, so a signal or an abort made as the wait's bound
passes (the bound's expiry seen first) still counts as what it is, not as a timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import llmdd_async as dd
from llmdd_async._errors import SynchronizerAborted
from llmdd_async._layer_gate import wait_for_layer

pytestmark = pytest.mark.anyio


class _Expired:
    """A wake-up whose bound passed before the signal's hop arrived; ``meanwhile`` is what
    the model did just before."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.meanwhile = meanwhile

    def wake(self) -> None:
        pass  # (the hop to the loop is still on its way)

    def expire(self) -> None:
        pass

    async def wait(self) -> bool:
        self.meanwhile()
        return False


class _Timers:
    def now(self) -> float:
        return 0.0

    def call_at(self, when: float, fn: Callable[[], None]) -> object:
        return object()

    def call_later(self, delay: float, fn: Callable[[], None]) -> object:
        return object()

    def cancel(self, timer: Any) -> None:
        pass


class _Engine:
    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.timers = _Timers()
        self.meanwhile = meanwhile

    def wakeup(self) -> _Expired:
        return _Expired(self.meanwhile)


async def test_a_signal_as_the_bound_passes_is_a_ready_layer() -> None:
    ev = dd.LayerEvents()
    await wait_for_layer(_Engine(lambda: ev.layer_ready(0)), ev, 0, 1000)  # type: ignore[arg-type]


async def test_an_abort_as_the_bound_passes_is_an_abort() -> None:
    ev = dd.LayerEvents()
    with pytest.raises(SynchronizerAborted) as info:
        await wait_for_layer(_Engine(ev.abort), ev, 0, 1000)  # type: ignore[arg-type]
    assert info.value.status_code != dd.LLMStatusCode.LLM_TIMEOUT


async def test_no_signal_by_the_bound_is_a_timeout() -> None:
    ev = dd.LayerEvents()
    with pytest.raises(SynchronizerAborted) as info:
        await wait_for_layer(_Engine(lambda: None), ev, 0, 1000)  # type: ignore[arg-type]
    assert info.value.status_code == dd.LLMStatusCode.LLM_TIMEOUT
