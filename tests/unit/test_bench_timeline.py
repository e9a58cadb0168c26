"""The request timeline of ``benchmarks/small_requests.py --timeline``: stamps lined up into
phases from events alone, and the stamping of real socket calls."""

from __future__ import annotations

import socket

import pytest

from llmdd_async.bench.timeline import PHASES, SocketStamps, phases

US = 1000  # the stamps are nanoseconds


def _request(t0: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """One request at ``t0`` (µs): ours and the peer's stamps, with the peer's stamps of
    other traffic around them."""
    ours = [
        (t0, "call>"),
        (t0 + 10, "send>"),
        (t0 + 30, "send<"),
        (t0 + 200, "recv>"),
        (t0 + 210, "recv<"),
        (t0 + 215, "recv>"),  # (a second read: part of receive)
        (t0 + 225, "recv<"),
        (t0 + 260, "call<"),
    ]
    theirs = [
        (t0 - 40, "send>"),  # (before our send: not this request's)
        (t0 - 35, "send<"),
        (t0 + 50, "recv>"),
        (t0 + 55, "recv<"),
        (t0 + 100, "recv>"),  # (a second read before its reply: part of the peer's work)
        (t0 + 104, "recv<"),
        (t0 + 150, "send>"),
        (t0 + 180, "send<"),
        (t0 + 190, "send>"),  # (a second send: after ours is counted, nothing of this one)
        (t0 + 195, "send<"),
    ]
    return [(t * US, w) for t, w in ours], [(t * US, w) for t, w in theirs]


def test_each_phase_runs_from_one_stamp_to_the_next_across_both_processes() -> None:
    ours, theirs = [], []
    for t0 in (1000, 5000):
        o, t = _request(t0)
        ours += o
        theirs += t
    got = phases(ours, theirs)
    expect = {"call": 10, "send": 20, "to_peer": 20, "peer": 100, "peer_send": 30,
              "to_us": 20, "receive": 60}  # fmt: skip
    assert tuple(expect) == PHASES
    assert got.us == {k: [v, v] for k, v in expect.items()}
    assert got.skipped == 0 and got.requests == 2 and got.calls_us == [260, 260]
    assert got.medians() == expect
    assert sum(v for v in got.means().values() if v is not None) == 260


def test_a_request_without_the_peers_stamps_between_is_left_out_but_timed() -> None:
    ours, theirs = _request(1000)
    # A one-sided pull: no send, no peer; and one whose peer never read in between.
    one_sided = [(9000 * US, "call>"), (9040 * US, "call<")]
    o, _ = _request(20000)
    got = phases(ours + one_sided + o, theirs)
    assert got.requests == 1 and got.skipped == 2
    assert got.calls_us == [260, 40, 260]
    empty = phases(one_sided, [])
    assert empty.medians() == dict.fromkeys(PHASES) and empty.means() == dict.fromkeys(PHASES)


def test_a_read_that_starts_before_the_send_returns_ends_the_sends_phase() -> None:
    # A busy machine (CPUs awake) or a reply of many frames: the peer reads while our send
    # call is still returning, and we read while its send is.
    ours = [(0, "call>"), (10, "send>"), (40, "send<"), (120, "recv>"), (300, "recv<"),
            (320, "call<")]  # fmt: skip
    theirs = [(25, "recv>"), (30, "recv<"), (70, "send>"), (250, "send<")]
    got = phases([(t * US, w) for t, w in ours], [(t * US, w) for t, w in theirs])
    assert got.skipped == 0 and got.requests == 1
    expect = {"call": 10, "send": 15, "to_peer": 0, "peer": 45, "peer_send": 50,
              "to_us": 0, "receive": 200}  # fmt: skip
    assert got.medians() == expect and sum(expect.values()) == got.calls_us[0] == 320


def test_socket_calls_are_stamped_while_started_and_cost_what_they_did_after() -> None:
    a, b = socket.socketpair()
    stamps = SocketStamps()
    try:
        stamps.start()
        assert stamps.started
        with pytest.raises(RuntimeError, match="already being stamped"):
            SocketStamps().start()
        stamps.mark("call>")
        with pytest.raises(ValueError, match="call> or call<"):
            stamps.mark("send>")  # (only the calls' own stamps say that)
        a.sendmsg([b"ab", b"c"])
        buf = bytearray(8)
        assert b.recv_into(buf) == 3
        stamps.mark("call<")
        events = stamps.stop()
        assert [w for _, w in events] == ["call>", "send>", "send<", "recv>", "recv<", "call<"]
        assert [t for t, _ in events] == sorted(t for t, _ in events)
        assert not stamps.started
        assert not {"sendmsg", "send", "recv_into", "recvmsg_into"} & set(socket.socket.__dict__)
        a.send(b"x")
        assert b.recv_into(buf) == 1
        assert len(events) == 6
        stamps.start()  # (again, once stopped)
        assert stamps.events == []
    finally:
        stamps.stop()
        a.close()
        b.close()
