"""The garbage collector is paused while a peer's big fields become objects (``_collector``):
a full collection in the middle of such a parse held the loop 15-41 ms on top of it."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest

from llmdd_async._collector import collector_paused
from llmdd_async._messages import CacheInfo, Table
from llmdd_async._net import link as link_module
from llmdd_async._protocol import MT, Decoder, Message, encode
from llmdd_async._protocol import frames as frames_module


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _big_table() -> Message:
    caches = tuple(
        CacheInfo(i, (0x10000 + i * 4096, 0x20000 + i * 4096), 4096, 1, True, 0, True)
        for i in range(3000)
    )
    return Table(caches).encode()


def _parse_watching_the_collector(
    monkeypatch: pytest.MonkeyPatch, frame: bytes
) -> tuple[Message, list[bool]]:
    seen: list[bool] = []
    real = json.loads

    def loads(text: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(text, *args, **kwargs)

    monkeypatch.setattr(frames_module.json, "loads", loads)
    dec = Decoder()
    dec.receive_data(frame)
    msg = dec.next_event()
    assert isinstance(msg, Message)
    return msg, seen


@pytest.mark.usefixtures("collector_on")
def test_a_big_frame_is_parsed_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = encode(_big_table())
    assert len(frame) > frames_module.MAX_SMALL_FIELDS  # (a big one)
    msg, seen = _parse_watching_the_collector(monkeypatch, frame)
    assert msg.type is MT.TABLE and len(Table.decode(msg).caches) == 3000
    assert seen == [False], "the collector ran during a big parse"
    assert gc.isenabled(), "the collector was left off"


@pytest.mark.usefixtures("collector_on")
def test_a_small_frame_leaves_the_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _, seen = _parse_watching_the_collector(monkeypatch, encode(Table().encode()))
    assert seen == [True]


def test_a_collector_the_application_turned_off_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        _, seen = _parse_watching_the_collector(monkeypatch, encode(_big_table()))
        assert seen == [False]
        assert not gc.isenabled(), "a big parse turned on a collector the application had off"
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


@pytest.mark.usefixtures("collector_on")
def test_the_collector_is_back_on_after_a_parse_that_failed() -> None:
    with pytest.raises(ValueError), collector_paused():
        assert not gc.isenabled()
        raise ValueError("malformed")
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_on")
def test_a_peer_table_is_built_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = link_module.TableSnapshot

    def snapshot(fields: Any) -> Any:
        seen.append(gc.isenabled())
        return real(fields)

    monkeypatch.setattr(link_module, "TableSnapshot", snapshot)
    snap = link_module._snapshot(_big_table().fields)
    assert seen == [False] and len(snap.by_id) == 3000
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_on")
def test_overlapping_pauses_keep_the_collector_off_until_the_last_ends() -> None:
    import threading

    worker_in, loop_done, states = threading.Event(), threading.Event(), []

    def build_in_a_worker() -> None:
        with collector_paused():
            worker_in.set()
            loop_done.wait(5)
            states.append(gc.isenabled())  # (the pause that began first has ended)

    with collector_paused():  # (the loop's parse, begun first)
        worker = threading.Thread(target=build_in_a_worker)
        worker.start()
        assert worker_in.wait(5)
    loop_done.set()
    worker.join(5)
    assert states == [False], "the collector came back on under a pause still running"
    assert gc.isenabled()
