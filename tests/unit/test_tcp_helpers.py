"""The TCP worker helpers over a real socket pair: stream mapping, padding, diversion."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import socket
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdd_async._memory import CancelToken
from llmdd_async._net.reader import _slice_views
from llmdd_async._transports._bufs import _SYSCALL_BYTES, FEW_VIEWS, advance, batch, moved
from llmdd_async._transports.tcp import (
    _FEW,
    _LISTED,
    TRIPPED_GRACE_S,
    Fence,
    StreamPlan,
    configure_socket,
    host_views,
    recv_views,
    send_nowait,
    send_views,
    send_views_inline,
)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50)), min_size=1, max_size=80),
    cuts=st.lists(st.integers(0, 400), max_size=5),
)
def test_stream_plan_views_follow_the_ranges_in_order(pieces, cuts) -> None:
    # (up to 80 ranges: plans of a few kept in Python ints, and larger ones in numpy)
    memory = np.random.default_rng(0).integers(0, 256, 80 * 53, dtype=np.uint8)
    base = memory.ctypes.data
    addrs, lens, pos = [], [], 0
    for gap, n in pieces:
        pos += gap  # gap 0: adjacent ranges, which the plan merges
        addrs.append(base + pos)
        lens.append(n)
        pos += n
    order = np.random.default_rng(len(pieces)).permutation(len(pieces))
    a = np.array(addrs, np.uint64)[order]
    n = np.array(lens, np.uint64)[order]
    plan = StreamPlan(a, n)
    want = b"".join(
        memory[int(x) - base : int(x) - base + int(m)].tobytes() for x, m in zip(a, n, strict=True)
    )
    assert plan.total == len(want)
    bounds = sorted({0, plan.total, *(c % (plan.total + 1) for c in cuts)})
    got = b"".join(
        b"".join(v.tobytes() for v in plan.views(lo, hi - lo))
        for lo, hi in itertools.pairwise(bounds)
    )
    assert got == want


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=_FEW + 1, max_size=200
    ),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_a_plan_of_many_ranges_cuts_frames_alike_in_python_and_numpy(pieces, cuts) -> None:
    """Past ``_FEW`` ranges a plan keeps Python lists (up to ``_LISTED``) to cut a frame of a
    few ranges by bisect; frames of many ranges, and larger plans, use numpy: every way gives
    the same ranges."""
    pos, addrs, lens = 4096, [], []
    for gap, n in pieces:
        pos += gap
        addrs.append(pos)
        lens.append(n)
        pos += n
    order = np.random.default_rng(len(pieces)).permutation(len(pieces))
    a, n = np.array(addrs, np.uint64)[order], np.array(lens, np.uint64)[order]
    listed, plain = StreamPlan(a, n), StreamPlan(a, n)
    plain.__dict__["_listed"] = None  # as a plan of more than _LISTED ranges
    assert listed._listed is not None
    bounds = sorted({0, listed.total, *(c % (listed.total + 1) for c in cuts)})
    for lo, hi in [*itertools.pairwise(bounds), (0, listed.total), (3, 1), (listed.total, 5)]:
        assert listed.ranges(lo, hi - lo) == plain.ranges(lo, hi - lo)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9)), min_size=1, max_size=40),
    many=st.booleans(),
    picks=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), min_size=1, max_size=8),
)
def test_frames_of_whole_ranges_hold_their_bytes_in_order_and_no_empty_view(
    pieces, many, picks
) -> None:
    """Frames cut where ranges begin and end (a layer's, a request's: the plan's own list
    slices) hold the same bytes as any other cut, and no empty view, whatever ranges of 0
    bytes a grant names, in plans of a few ranges and of many."""
    if many:  # (past _FEW ranges: the plan's lists come from numpy, ranges of 0 bytes kept)
        pieces = pieces * -(-(_FEW + 1) // len(pieces))
    memory = np.random.default_rng(1).integers(0, 256, 11 * len(pieces) + 64, dtype=np.uint8)
    base = memory.ctypes.data
    addrs, lens, pos = [], [], 0
    for gap, n in pieces:
        pos += gap
        addrs.append(base + pos)
        lens.append(n)
        pos += n
    plan = StreamPlan(np.array(addrs, np.uint64), np.array(lens, np.uint64))
    want = b"".join(
        memory[a - base : a - base + n].tobytes() for a, n in zip(addrs, lens, strict=True)
    )
    bounds = [0, *itertools.accumulate(lens)]  # where each range begins and ends
    for i, j in picks:
        lo, hi = sorted((bounds[i % len(bounds)], bounds[j % len(bounds)]))
        views = plan.views(lo, hi - lo)
        assert all(v.nbytes for v in views)
        assert b"".join(v.tobytes() for v in views) == want[lo:hi]


def _bytes_of(views: list[memoryview]) -> bytes:
    return b"".join(v.tobytes() for v in views)


@settings(max_examples=300, deadline=None)
@given(
    count=st.sampled_from([1, 3, FEW_VIEWS, FEW_VIEWS + 1, 3 * FEW_VIEWS]),
    seed=st.integers(0, 2**32 - 1),
    largest=st.sampled_from([1, 8, 300, 5000]),
)
def test_syscall_batches_and_what_they_moved_walk_the_buffers_in_order(
    count, seed, largest
) -> None:
    # Few buffers are walked in a Python loop, many by bisecting their running sizes: both
    # must hand the kernel the same bytes and resume exactly where it stopped.
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, largest + 1, count).tolist()
    memory = bytes(rng.integers(0, 256, sum(sizes), dtype=np.uint8))
    bufs, pos = [], 0
    for n in sizes:
        bufs.append(memoryview(memory)[pos : pos + n])
        pos += n
    idx = int(rng.integers(0, 3)) if count > 3 else 0
    done = sum(sizes[:idx])
    while idx < len(bufs):
        chunk = batch(bufs, idx)
        assert _bytes_of(chunk[0]) == memory[done:]  # (all of it: under a syscall's cap)
        assert chunk[1] == len(memory) - done
        # (some calls move all the batch: then it is passed with no look at each view)
        n = min(int(rng.integers(1, 3 * largest + 1)), len(memory) - done)
        if rng.integers(0, 3) == 0:
            n = len(memory) - done
        idx = moved(bufs, idx, n, chunk) if rng.integers(0, 2) else advance(bufs, idx, n)
        done += n
        assert _bytes_of(bufs[idx:]) == memory[done:]
        assert idx == len(bufs) or bufs[idx].nbytes > 0
        lo = int(rng.integers(0, len(memory) - done + 2))
        n = int(rng.integers(0, len(memory) - done + 2))
        got = _bytes_of(_slice_views(bufs[idx:], lo, n))
        assert got == memory[done + lo : done + lo + n]


@pytest.mark.parametrize("views", [1, 3, 1023, 1024, 1025, 2048])
def test_a_payloads_last_read_takes_what_follows_within_the_kernels_buffer_limit(views) -> None:
    # The last read of a payload adds the read-ahead buffer as one more buffer: never past
    # the IOV_MAX a call takes (the kernel refuses more, and the link would break).
    import types

    from llmdd_async._net.reader import _Inflow

    a, b = socket.socketpair()
    try:
        memory = bytearray(views)
        landing = types.SimpleNamespace(
            views=[memoryview(memory)[i : i + 1] for i in range(views)],
            pmac=None,
            token=CancelToken(),
        )
        tail = memoryview(bytearray(64))
        inflow = _Inflow(landing, 0, views, memoryview(bytearray(64)), tail)  # type: ignore[arg-type]
        payload = bytes(i % 251 for i in range(views))
        a.sendall(payload + b"NEXT!")
        b.setblocking(False)
        assert inflow.pump(b)
        assert bytes(memory) == payload
        rest = b.recv(64) if inflow.after < 5 else b""
        assert bytes(tail[: inflow.after]) + rest == b"NEXT!"
    finally:
        a.close()
        b.close()


def test_a_syscall_batch_is_cut_at_its_byte_cap() -> None:
    big = memoryview(bytearray(_SYSCALL_BYTES))
    bufs = [big[:100], big, big[:7]]
    out, size = batch(bufs, 0)
    assert [v.nbytes for v in out] == [100, _SYSCALL_BYTES - 100]
    assert size == -1  # (a buffer was cut: what moved is walked view by view)
    assert batch(bufs, 1)[0][0].nbytes == _SYSCALL_BYTES and len(batch(bufs, 1)[0]) == 1
    assert [v.nbytes for v in batch([big, big], 0)[0]] == [_SYSCALL_BYTES]
    # Moving the whole cut batch leaves the rest of the cut buffer, not the next one.
    assert moved(bufs, 0, _SYSCALL_BYTES, (out, size)) == 1
    assert bufs[1].nbytes == 100


@pytest.mark.parametrize("ranges", [3, _FEW + 5, _LISTED + 5])
def test_a_plan_with_empty_ranges_has_no_empty_view(ranges: int) -> None:
    """A peer's grant may name ranges of 0 bytes: no view of the plan is empty (a send of an
    empty last view never advances, and the loop would spin on it)."""
    memory = np.arange(4 * ranges, dtype=np.uint8)
    base = memory.ctypes.data
    a = np.array([base + 4 * i for i in range(ranges)], np.uint64)
    n = np.array([0 if i % 2 else 2 for i in range(ranges)], np.uint64)
    n[-1] = 0  # the last view, where a send stops short
    plan = StreamPlan(a, n)
    views = plan.views(0, plan.total)
    assert views and all(v.nbytes for v in views)
    assert b"".join(v.tobytes() for v in views) == b"".join(
        memory[4 * i : 4 * i + 2].tobytes() for i in range(0, ranges, 2) if n[i]
    )
    assert StreamPlan(a[1::2], n[1::2]).views(0, 0) == []


def test_a_grant_with_an_empty_last_range_is_sent_and_ends() -> None:
    """What a push does with a hostile target's GRANT whose last range is 0 bytes long: its
    frame goes out whole over a real socket (header, then the plan's views) and the send
    ends. An empty last view once made the send from the loop spin for ever (a send of
    nothing never advances)."""
    memory = np.arange(8192, dtype=np.uint8)
    base = memory.ctypes.data
    plan = StreamPlan(np.array([base, base + 4096], np.uint64), np.array([100, 0], np.uint64))
    a, b = pair()
    bufs = [memoryview(b"H" * 16), *plan.views(0, plan.total)]
    idx = send_nowait(a, bufs)
    ended = threading.Event()

    def finish() -> None:
        anyio.run(send_views_inline, a, bufs, idx, CancelToken())
        ended.set()

    worker = threading.Thread(target=finish, daemon=True)
    worker.start()
    assert ended.wait(5), "the send of the frame never ended"
    got = b""
    while len(got) < 116:
        got += b.recv(4096)
    assert got == b"H" * 16 + memory[:100].tobytes()
    a.close()
    b.close()


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on 127.0.0.1, configured as the links configure theirs."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    configure_socket(a)
    configure_socket(b)
    return a, b


def test_the_heartbeat_sets_keepalive_and_the_user_timeout() -> None:
    """``llm.LinkHeartbeat`` of 4 s: probes of an idle link from 2 s, and the kernel breaks
    the connection once nothing was acknowledged for 4 s (probes included)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        s = socket.create_connection(listener.getsockname())
    with s:
        configure_socket(s, 4.0)
        opt = functools.partial(s.getsockopt, socket.IPPROTO_TCP)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert opt(socket.TCP_KEEPIDLE) == 2
        assert opt(socket.TCP_USER_TIMEOUT) == 4000
        # with the user timeout set, the first probe after it ends the link: within a second
        assert opt(socket.TCP_KEEPINTVL) <= 1


def test_send_views_pads_with_zeros_after_a_cancel_but_keeps_the_header() -> None:
    a, b = pair()
    header = b"H" * 32
    payload = np.full(96 << 20, 7, np.uint8)  # far larger than the socket buffers
    token = CancelToken()
    fence = Fence(token, 10)
    received = bytearray()

    def reader() -> None:
        # Read the header, then stall until the sender has been cancelled.
        while len(received) < 32:
            received.extend(b.recv(32 - len(received)))
        token.cancel()
        while len(received) < 32 + payload.nbytes:
            received.extend(b.recv(4 << 20))

    t = threading.Thread(target=reader)
    t.start()
    send_views(a, header, [memoryview(payload)], fence)
    t.join(10)
    assert fence.released.is_set()
    assert bytes(received[:32]) == header
    body = np.frombuffer(bytes(received[32:]), np.uint8)
    assert len(body) == payload.nbytes  # the frame stays whole: the stream is in step
    assert body[-1] == 0  # the tail after the cancel is padding, not source memory
    a.close()
    b.close()


def test_recv_views_diverts_to_scratch_when_cancelled() -> None:
    a, b = pair()
    n = 4 << 20
    data = np.arange(n, dtype=np.uint32).astype(np.uint8)
    dst = np.zeros(n, np.uint8)
    scratch = memoryview(bytearray(1 << 20))
    token = CancelToken()
    token.cancel()  # cancelled before anything arrived
    fence = Fence(token, 10)
    sender = threading.Thread(target=lambda: (a.sendall(data), a.sendall(b"next")))
    sender.start()
    landed = recv_views(b, [memoryview(dst)], fence, scratch)
    sender.join(10)
    assert landed is False
    assert not dst.any()  # nothing reached the user's buffer
    assert b.recv(4) == b"next"  # and exactly the frame's bytes were consumed
    a.close()
    b.close()


def test_recv_views_gives_up_on_a_silent_peer() -> None:
    a, b = pair()
    dst = np.zeros(1000, np.uint8)
    fence = Fence(CancelToken(), 0.2)
    a.sendall(b"x" * 10)
    try:
        recv_views(b, [memoryview(dst)], fence, memoryview(bytearray(64)))
    except TimeoutError:
        pass
    else:
        raise AssertionError("a silent peer must time out")
    a.close()
    b.close()


def test_recv_views_waits_on_a_slow_peer_that_keeps_moving_bytes() -> None:
    # The stall counts from the last byte that moved: a frame that takes longer than the
    # stall in all, a little at a time, is received whole (the link must not break under it).
    a, b = pair()
    dst = np.zeros(10, np.uint8)
    fence = Fence(CancelToken(deadline=time.monotonic() + 30), 0.5)  # a request's deadline

    def trickle() -> None:  # 1 s in all; each gap is longer than a socket slice (50 ms)
        for i in range(10):
            time.sleep(0.1)
            a.sendall(bytes([i + 1]))

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        assert recv_views(b, [memoryview(dst)], fence, memoryview(bytearray(64))) is True
    finally:
        sender.join()
    assert dst.tolist() == list(range(1, 11))
    a.close()
    b.close()


def _trickle_into(dst: np.ndarray, fence: Fence) -> tuple[float, BaseException | None]:
    """Receive into ``dst`` from a peer that sends one byte every 20 ms for ever (until the
    receive gives up); how long the receive took and what it raised."""
    a, b = pair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                a.send(b"x")
            except OSError:
                return
            time.sleep(0.02)

    sender = threading.Thread(target=trickle)
    sender.start()
    t0 = time.monotonic()
    error: BaseException | None = None
    try:
        recv_views(b, [memoryview(dst)], fence, memoryview(bytearray(64)))
    except TimeoutError as exc:
        error = exc
    finally:
        took = time.monotonic() - t0
        stop.set()
        sender.join()
        a.close()
        b.close()
    return took, error


def test_a_peer_that_trickles_holds_a_worker_no_longer_than_the_deadline_and_a_grace() -> None:
    # Bytes keep moving, so the stall never fires; the token's deadline trips the frame into
    # scratch, and the rest must then move within the grace.
    token = CancelToken(deadline=time.monotonic() + 0.3)
    fence = Fence(token, 30)
    took, error = _trickle_into(np.zeros(1 << 20, np.uint8), fence)
    assert isinstance(error, TimeoutError), "a trickling peer held the worker"
    assert fence.released.is_set()
    assert took < 0.3 + TRIPPED_GRACE_S + 1.0, took


def test_without_a_deadline_a_frame_must_be_done_within_the_stall() -> None:
    fence = Fence(CancelToken(), 0.5)
    took, error = _trickle_into(np.zeros(1 << 20, np.uint8), fence)
    assert isinstance(error, TimeoutError), "a trickling peer held the worker"
    assert took < 0.5 + 1.0, took


def test_past_its_deadline_a_send_keeps_sending_real_bytes_then_gives_up() -> None:
    # give_up_at (a serving side's budget) bounds a frame to a slow reader, but never pads it
    # with zeros the reader would take as data: what the reader gets is the real payload.
    a, b = pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = np.full(16 << 20, 0x5A, np.uint8)
    got = bytearray()
    stop = threading.Event()

    def slow_reader() -> None:
        while not stop.is_set():
            try:
                chunk = b.recv(4096)
            except (BlockingIOError, OSError):
                continue
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.02)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    fence = Fence(CancelToken(), 30, give_up_at=time.monotonic() + 0.3)
    t0 = time.monotonic()
    try:
        send_views(a, b"", [memoryview(payload)], fence)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a slow reader held the send past its deadline and grace")
    finally:
        took = time.monotonic() - t0
        stop.set()
        a.close()
        reader.join()
        b.close()
    assert took < 0.3 + 4 + 1.0, took  # the grace of a 16 MiB rest: 2 s at GRACE_RATE
    assert got and set(got) == {0x5A}, "zeros went out past the deadline"


class _CountingSocket(socket.socket):
    """A socket that counts the worker's calls on it."""

    calls = 0

    def sendmsg(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        return super().sendmsg(*args, **kwargs)

    def recvmsg_into(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().recvmsg_into(*args, **kwargs)


def _nonblocking_counting(s: socket.socket) -> _CountingSocket:
    """``s`` as uvloop leaves a descriptor it watches: non-blocking at the OS level (libuv
    sets ``O_NONBLOCK``) while Python's socket object still says blocking."""
    counted = _CountingSocket(fileno=s.detach())
    os.set_blocking(counted.fileno(), False)
    assert counted.getblocking()  # (Python's own idea of it is unchanged)
    return counted


@pytest.mark.parametrize("direction", ["send", "receive"])
def test_a_worker_on_a_non_blocking_socket_waits_for_the_peer_instead_of_spinning(
    direction: str,
) -> None:
    # A stalled peer for half a second: a worker that waits makes a call or so per socket
    # slice (50 ms); one that tries again at once makes hundreds of thousands, holding the
    # GIL the event loop needs.
    a, b = pair()
    fence = Fence(CancelToken(), 0.5)
    with contextlib.closing(b):
        if direction == "send":
            counted = _nonblocking_counting(a)
            payload = np.zeros(64 << 20, np.uint8)  # more than the kernel's buffers hold
            with contextlib.closing(counted), pytest.raises(TimeoutError):
                send_views(counted, b"H" * 32, [memoryview(payload)], fence)
        else:
            counted = _nonblocking_counting(b)
            a.sendall(b"x" * 10)
            dst = np.zeros(1000, np.uint8)
            with contextlib.closing(counted), pytest.raises(TimeoutError):
                recv_views(counted, [memoryview(dst)], fence, memoryview(bytearray(64)))
            a.close()
    assert counted.calls < 100, counted.calls


@pytest.mark.parametrize("ranges", [2, 20])  # (a view each; slices of one view over the span)
def test_a_plans_whole_views_are_made_once_and_handed_out_as_copies(ranges: int) -> None:
    memory = np.arange(64 * 2 * ranges, dtype=np.uint8)
    starts = [memory.ctypes.data + 128 * i for i in range(ranges)]
    plan = StreamPlan(np.array(starts, np.uint64), np.full(ranges, 32, np.uint64))
    plan.make_views()  # (a pull's, while its request is out)
    first = plan.views(0, plan.total)
    first.clear()  # (a caller may cut its list: the next one still gets every view)
    want = b"".join(memory[128 * i : 128 * i + 32].tobytes() for i in range(ranges))
    assert _bytes_of(plan.views(0, plan.total)) == want
    assert _bytes_of(plan.receive_views(0, plan.total)) == want


@pytest.mark.parametrize("ranges", [3, 20])  # (a view each; slices of one view over the span)
def test_host_views_are_the_ranges_in_order_with_no_empty_view(ranges: int) -> None:
    memory = np.random.default_rng(ranges).integers(0, 256, 128 * ranges, dtype=np.uint8)
    order = list(range(ranges))[::-1]  # (not in address order)
    addrs = np.array([memory.ctypes.data + 128 * i for i in order], np.uint64)
    nbytes = np.array([0 if i % 3 == 1 else 8 + i for i in order], np.uint64)
    views = host_views(addrs, nbytes)
    assert all(v.nbytes for v in views)
    want = b"".join(memory[128 * i : 128 * i + 8 + i].tobytes() for i in order if i % 3 != 1)
    assert _bytes_of(views) == want
