"""Where one small request's wall time goes, process by process, from stamps at socket calls.

Each process of a benchmark notes when each of its socket calls starts and ends
(:class:`SocketStamps`), and the caller notes when each request starts and ends. Both use
``time.perf_counter_ns``, on Linux the monotonic clock all processes share, so
:func:`phases` can line the two up into the phases of one request/response, which add up to
its wall time:

========== ============================================================================
phase      from ... to ...
========== ============================================================================
call       the caller's call ... the start of its first send (checks, plan, encoding)
send       that send call (the kernel's loopback path and the peer's wake-up)
to_peer    its end ... the peer's first read (the peer's process being woken)
peer       that read ... the start of the peer's first send after it (its Python work)
peer_send  that send call
to_us      its end ... our first read after it (our process being woken)
receive    that read ... the call's return (landing the bytes, completing the request)
========== ============================================================================

A read that starts before the send it answers has returned (the reader's CPU was awake; a
reply of many frames) ends that send's phase, and its wake-up phase is then zero. A request is
left out (:attr:`Phases.skipped`) where a stamp is missing: no send, no read of the peer's
after ours started (a one-sided same-host pull), or no read of ours after the peer's send
started. Each stamp costs a fraction of a microsecond, which the phases include; unlike a
profiler's, it does not multiply what each Python call costs.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PHASES", "Phases", "SocketStamps", "phases"]

#: the phases of :func:`phases`, in order
PHASES = ("call", "send", "to_peer", "peer", "peer_send", "to_us", "receive")

#: the socket calls a link makes, and what each is
_CALLS = {"sendmsg": "send", "send": "send", "recv_into": "recv", "recvmsg_into": "recv"}
#: what a stamp says, by its code (its low bits)
_WHATS = ("send>", "send<", "recv>", "recv<", "call>", "call<")
_CODE = {w: i for i, w in enumerate(_WHATS)}
_BITS = 3

Stamp = tuple[int, str]


class SocketStamps:
    """Stamps of every socket call made in this process while started: ``(ns, what)`` with
    ``what`` one of ``send>``, ``send<``, ``recv>``, ``recv<``, or a caller's :meth:`mark`.

    It wraps the methods of :class:`socket.socket` itself, for every socket of the process
    (the event loop's own wake-up socket too, which a wake-up from another thread writes to):
    meant for a benchmark's own processes only.
    """

    def __init__(self) -> None:
        # One int a stamp (its time and what it says): a tuple would be the garbage
        # collector's to track, and its passes would land in the requests timed; one append
        # keeps stamps of other threads (a worker's receive) whole.
        self._stamps: list[int] = []
        self._saved: dict[str, Any] = {}

    @property
    def events(self) -> list[Stamp]:
        """The stamps so far, in time order."""
        mask = (1 << _BITS) - 1
        return [(x >> _BITS, _WHATS[x & mask]) for x in sorted(self._stamps)]

    @property
    def started(self) -> bool:
        return bool(self._saved)

    def start(self) -> None:
        """Begin stamping (the events so far are dropped).

        Raises:
            RuntimeError: already started (here or by another instance).
        """
        if self._saved or any(
            getattr(getattr(socket.socket, name), "_stamped", False) for name in _CALLS
        ):
            raise RuntimeError("socket calls are already being stamped in this process")
        self._stamps = []
        for name, what in _CALLS.items():
            self._saved[name] = socket.socket.__dict__.get(name, _INHERITED)
            setattr(socket.socket, name, _stamped(getattr(socket.socket, name), what, self._stamps))

    def stop(self) -> list[Stamp]:
        """Stop stamping (socket calls cost what they did before); returns the events."""
        for name, saved in self._saved.items():
            if saved is _INHERITED:
                delattr(socket.socket, name)
            else:
                setattr(socket.socket, name, saved)
        self._saved = {}
        return self.events

    def mark(self, what: str) -> None:
        """Stamp an event of the caller's: ``call>`` / ``call<`` around each request.

        Raises:
            ValueError: any other ``what``.
        """
        code = _CODE.get(what)
        if code is None or code < _CODE["call>"]:
            raise ValueError(f"a caller marks call> or call<, not {what!r}")
        self._stamps.append(time.perf_counter_ns() << _BITS | code)


_INHERITED = object()


def _stamped(call: Callable[..., Any], what: str, stamps: list[int]) -> Callable[..., Any]:
    now, start, end = time.perf_counter_ns, _CODE[what + ">"], _CODE[what + "<"]

    def stamped(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
        stamps.append(now() << _BITS | start)
        try:
            return call(self, *args, **kwargs)
        finally:
            stamps.append(now() << _BITS | end)

    stamped._stamped = True  # type: ignore[attr-defined]
    return stamped


@dataclasses.dataclass
class Phases:
    """Each phase's durations (µs), a value per request counted, in order."""

    us: dict[str, list[float]]
    #: every request's wall time (µs), those left out included
    calls_us: list[float] = dataclasses.field(default_factory=list)
    #: requests left out for a missing stamp
    skipped: int = 0

    @property
    def requests(self) -> int:
        return len(self.us[PHASES[0]])

    def medians(self) -> dict[str, float | None]:
        """Each phase's median (µs; None: no request counted); the medians need not add up
        to the median request."""
        return {k: statistics.median(v) if v else None for k, v in self.us.items()}

    def means(self) -> dict[str, float | None]:
        """Each phase's mean (µs; None: no request counted): they add up to the mean of the
        requests counted."""
        return {k: statistics.fmean(v) if v else None for k, v in self.us.items()}


def phases(ours: Sequence[Stamp], theirs: Sequence[Stamp]) -> Phases:
    """Line up the stamps of the caller's process (with ``call>``/``call<`` marks) and of the
    peer's into :data:`PHASES` per request (see the module's docstring)."""
    out = Phases({k: [] for k in PHASES})
    peer_t = [t for t, _ in theirs]
    start: int | None = None
    inside: list[Stamp] = []
    for t, what in ours:
        if what == "call>":
            start, inside = t, []
        elif what == "call<" and start is not None:
            out.calls_us.append((t - start) / 1000)
            got = _one(start, inside, t, theirs, peer_t)
            if got is None:
                out.skipped += 1
            else:
                for k, v in zip(PHASES, got, strict=True):
                    out.us[k].append(v / 1000)
            start = None
        elif start is not None:
            inside.append((t, what))
    return out


def _one(
    t0: int, ours: list[Stamp], t1: int, theirs: Sequence[Stamp], peer_t: list[int]
) -> tuple[int, ...] | None:
    s0 = _first(ours, "send>", t0)
    s1 = None if s0 is None else _first(ours, "send<", s0)
    if s0 is None or s1 is None:
        return None
    # A read may start before the send it answers has returned (a CPU that was awake, a
    # reply of many frames): it is then searched from the send's start, and the send's phase
    # ends where the read starts.
    p0 = _first(theirs, "recv>", s0, peer_t)
    q0 = None if p0 is None else _first(theirs, "send>", p0, peer_t)
    q1 = None if q0 is None else _first(theirs, "send<", q0, peer_t)
    if p0 is None or q0 is None or q1 is None:
        return None
    r0 = _first(ours, "recv>", q0)
    if r0 is None or r0 > t1:
        return None
    s1, q1 = min(s1, p0), min(q1, r0)
    return (s0 - t0, s1 - s0, p0 - s1, q0 - p0, q1 - q0, r0 - q1, t1 - r0)


def _first(
    events: Sequence[Stamp], what: str, after: int, times: list[int] | None = None
) -> int | None:
    """The time of the first ``what`` at or after ``after`` (``times``: the events' times,
    to start from there)."""
    for i in range(bisect_left(times, after) if times is not None else 0, len(events)):
        t, w = events[i]
        if w == what and t >= after:
            return t
    return None
