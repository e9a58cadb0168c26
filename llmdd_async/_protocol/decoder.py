"""The incremental frame parser (:class:`Decoder`) and the budget its partial frames are
charged to (:class:`MetaBudget`)."""

from __future__ import annotations

import hmac
import mmap
import time
from collections.abc import Callable

from .._errors import ProtocolError
from .frames import (
    _TAG,
    HEADER,
    MAGIC,
    MAX_META,
    MAX_PAYLOAD,
    MT,
    NEED_DATA,
    PROTOCOL_VERSION,
    FrameAuth,
    Message,
    PayloadBytes,
    _decode_meta,
    _NeedData,
)

__all__ = ["UNCHARGED_META", "Decoder", "MetaBudget"]

#: a frame's meta up to this size is not charged to a :class:`MetaBudget`: one read-ahead
#: (a connection buffers at most its frame plus one read)
UNCHARGED_META = 64 << 10
#: a partial frame with more meta than this is collected in a mapping of its own (a mapping
#: costs ~0.1 ms, so smaller ones grow the buffer instead)
_MAPPED_META = 1 << 20
#: a meta up to this size is copied out of the buffer by slicing it (a second, small copy
#: costs less than a view); a larger one through a view (one copy)
_SLICED_META = 4 << 10
_MT_OF: dict[int, MT] = {int(m): m for m in MT}


class MetaBudget:
    """Bytes of partial frames that the decoders sharing it may buffer at once (one endpoint's
    links). ``name`` says which setting sets ``total`` (in error messages).

    Bytes are charged as they arrive, not as a header claims them, so holding the budget costs
    a peer the bytes themselves. When it is full, the partial frames that have been in progress
    for longer than ``stale_s`` (a legit peer sends a frame's meta without pausing) are evicted,
    oldest first, to make room: a peer that stops half-way cannot keep the others out.
    """

    def __init__(self, total: int, name: str = "the meta budget", stale_s: float = 1.0) -> None:
        self.total = total
        self.name = name
        self.used = 0
        self.stale_s = stale_s
        #: decoders holding part of the budget -> when their partial frame started
        self.holders: dict[Decoder, float] = {}

    def reserve(self, n: int, asking: Decoder | None = None) -> bool:
        """Take ``n`` bytes for ``asking``, evicting stale partial frames of other decoders if
        that is what it takes; False (nothing taken) if it still would exceed ``total``."""
        if self.used + n > self.total:
            now = time.monotonic()
            for dec, since in sorted(self.holders.items(), key=lambda kv: kv[1]):
                if self.used + n <= self.total or now - since < self.stale_s:
                    break
                if dec is not asking:
                    dec.evict(
                        f"its partial frame held part of {self.name} for {now - since:.1f} s "
                        "while another link needed it"
                    )
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used -= n


class Decoder:
    """Incremental frame parser.

    Feed it bytes with :meth:`receive_data`; call :meth:`next_event` until it returns
    :data:`NEED_DATA`. A frame with a payload is returned as a :class:`Message` first; then the
    decoder is in payload mode: :meth:`next_event` yields the buffered part as
    :class:`PayloadBytes`, and the I/O layer may instead receive ``payload_remaining`` bytes
    itself and report them with :meth:`payload_consumed`. After a :class:`ProtocolError` the
    decoder is unusable.

    A frame whose meta is over :data:`UNCHARGED_META` and not all here yet is charged to the
    decoder's :class:`MetaBudget` (if it has one) until it is complete; one that does not fit
    is a :class:`ProtocolError`. :meth:`close` frees the buffer at once.
    """

    def __init__(self, max_meta: int = MAX_META, budget: MetaBudget | None = None) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max_meta = max_meta
        self._payload_left = 0
        #: the meta bytes of the last frame returned
        self.last_meta = 0
        #: a frame of a type this says nobody waits for is returned without its fields: a
        #: peer's unasked-for table is not parsed (a megabyte of JSON: tens of ms)
        self.unwanted: Callable[[MT], bool] | None = None
        self._broken: ProtocolError | None = None
        self._auth: FrameAuth | None = None
        self._budget = budget
        #: bytes of ``_budget`` the partial frame in the buffer holds (charged as they arrive),
        #: and how many of its bytes are still to come while it is charged
        self._reserved = 0
        self._charging = False
        self._frame_left = 0
        #: called when the budget evicts this decoder's partial frame (the owner breaks its
        #: connection, so that its reader stops waiting for the rest)
        self.on_evict: Callable[[str], None] | None = None
        #: a frame over _MAPPED_META being collected (header and meta), and how much of it
        #: is here: an anonymous mapping of its exact size, touched only as bytes arrive and
        #: returned to the kernel when it is done (heap memory would linger in malloc's arenas)
        self._big: mmap.mmap | None = None
        self._big_fill = 0
        #: on a keyed link, that frame's tag, fed its meta as it arrives (a frame of tens of
        #: MiB hashed at once would hold the loop for over 100 ms), and how far it got
        self._big_mac: hmac.HMAC | None = None
        self._big_hashed = 0

    def set_max_meta(self, max_meta: int) -> None:
        """Change the meta size limit (small during a handshake, larger afterwards)."""
        self._max_meta = max_meta

    @property
    def budget(self) -> MetaBudget | None:
        """The budget this decoder's partial frames are charged to (its owner may charge
        what it keeps of decoded frames there too)."""
        return self._budget

    def set_budget(self, budget: MetaBudget | None) -> None:
        """Charge later partial frames to ``budget`` (a link's decoder, once it is set up)."""
        self._unreserve()
        self._budget = budget

    def close(self, reason: str = "the connection is closed") -> None:
        """Free the buffer and what it holds of the budget; later calls raise ProtocolError."""
        self._unreserve()
        self._buf = bytearray()  # (a take_payload view still held keeps the old one alive)
        self._pos = 0
        if self._big is not None:
            self._big.close()
            self._big = None
            self._big_mac = None
        self._payload_left = 0
        if self._broken is None:
            self._broken = ProtocolError(reason)

    def _unreserve(self) -> None:
        if self._budget is not None:
            if self._reserved:
                self._budget.release(self._reserved)
            self._budget.holders.pop(self, None)
        self._reserved = 0
        self._charging = False
        self._frame_left = 0

    def _charge(self, n: int) -> None:
        """Charge ``n`` more bytes of the partial frame to the budget.

        Raises:
            ProtocolError: the budget is full (even after evicting stale partial frames).
        """
        budget = self._budget
        if budget is None or n <= 0:
            return
        if not budget.reserve(n, self):
            raise self._fail(
                f"a frame's meta would take the partial frames buffered across all links past "
                f"{budget.name} ({budget.total} bytes; {budget.used} in use)"
            )
        self._reserved += n

    def evict(self, reason: str) -> None:
        """Drop the partial frame (the budget needs its bytes): the decoder is broken."""
        self._fail(f"evicted: {reason}")
        self._buf = bytearray()
        self._pos = 0
        if self._big is not None:
            self._big.close()
            self._big = None
            self._big_mac = None
        if self.on_evict is not None:
            self.on_evict(str(self._broken))

    def set_auth(self, auth: FrameAuth | None) -> None:
        """Require every later frame to carry a valid tag (a keyed link, after the handshake)."""
        self._auth = auth

    @property
    def payload_remaining(self) -> int:
        """Payload bytes of the current frame not yet handed out or consumed."""
        return self._payload_left

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out (a partial frame's included)."""
        return len(self._buf) - self._pos + (self._big_fill if self._big is not None else 0)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken is not None:
            raise self._broken
        if self._charging:
            k = min(len(data), self._frame_left)
            self._charge(k)
            self._frame_left -= k
        if self._big is not None:
            n = min(len(data), len(self._big) - self._big_fill)
            self._big[self._big_fill : self._big_fill + n] = data[:n]
            self._big_fill += n
            if self._big_mac is not None:
                self._hash_big()
            if n == len(data):
                return
            data = data[n:]  # the next frames
        if self._pos:
            # Drop consumed bytes first: a link that only ever carries control frames may never
            # land exactly on a frame boundary, and the buffer would grow without bound.
            # (CPython deletes a bytearray prefix in O(1) by moving its start.)
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def payload_consumed(self, n: int) -> None:
        """The I/O layer read ``n`` payload bytes directly (none were buffered).

        Raises:
            ProtocolError: more than the frame's remaining payload, or bytes are still buffered.
        """
        if self._broken is not None:
            raise self._broken
        if n > self._payload_left or (n and self.buffered):
            raise ProtocolError("payload accounting error")
        self._payload_left -= n

    def take_payload(self) -> memoryview:
        """The current frame's payload bytes that are already buffered (at most what it has
        left), as a view into the decoder's own buffer: no copy, unlike the
        :class:`PayloadBytes` of :meth:`next_event`. The caller copies them out and releases
        the view before the next :meth:`receive_data` (which raises BufferError while a view
        is held)."""
        n = min(len(self._buf) - self._pos, self._payload_left)
        view = memoryview(self._buf)[self._pos : self._pos + n]
        self._pos += n
        self._payload_left -= n
        return view

    def _fail(self, message: str) -> ProtocolError:
        self._broken = ProtocolError(message)
        self._unreserve()
        return self._broken

    def next_event(self) -> Message | PayloadBytes | _NeedData:
        """The next complete event, or NEED_DATA.

        Raises:
            ProtocolError: the bytes are not a valid frame (bad magic, version, type, sizes, or
                malformed meta).
        """
        if self._broken is not None:
            raise self._broken
        if self._big is not None:
            if self._big_fill < len(self._big):
                return NEED_DATA
            return self._take_big()
        avail = len(self._buf) - self._pos
        if self._payload_left:
            if not avail:
                return NEED_DATA
            n = min(avail, self._payload_left)
            chunk = memoryview(self._buf)[self._pos : self._pos + n]
            # The view must not outlive the next receive_data (which may grow the buffer).
            data = memoryview(bytes(chunk))
            chunk.release()
            self._pos += n
            self._payload_left -= n
            return PayloadBytes(data)
        if avail < HEADER.size:
            return NEED_DATA
        magic, version, mtype, req_id, meta_len, flags, payload_len = HEADER.unpack_from(
            self._buf, self._pos
        )
        if magic != MAGIC:
            raise self._fail(f"bad magic {magic:#x}{_guess_protocol(self._buf, self._pos)}")
        if version != PROTOCOL_VERSION:
            raise self._fail(
                f"unsupported protocol version {version} (this endpoint speaks "
                f"{PROTOCOL_VERSION}: both sides must run releases of the same wire version)"
            )
        mt = _MT_OF.get(mtype)  # (a dict lookup: calling the enum costs a microsecond)
        if mt is None:
            raise self._fail(f"unknown message type {mtype}")
        if meta_len > self._max_meta:
            raise self._fail(f"meta of {meta_len} bytes exceeds {self._max_meta}")
        if payload_len > MAX_PAYLOAD:
            raise self._fail(f"payload of {payload_len} bytes is absurd")
        if avail < HEADER.size + meta_len:
            if meta_len > UNCHARGED_META and not self._charging and self._budget is not None:
                self._charging = True
                self._frame_left = HEADER.size + meta_len - avail
                self._budget.holders[self] = time.monotonic()
                self._charge(avail)
            if meta_len > _MAPPED_META:
                # (private: never shared with a forked child)
                big = mmap.mmap(-1, HEADER.size + meta_len, flags=mmap.MAP_PRIVATE)
                big[:avail] = memoryview(self._buf)[self._pos :]
                self._big, self._big_fill = big, avail
                self._buf = bytearray()
                self._pos = 0
                if self._auth is not None:
                    with memoryview(big) as view:
                        self._big_mac = self._auth.start(view[: HEADER.size])
                    self._big_hashed = HEADER.size
                    self._hash_big()
            return NEED_DATA
        pos = self._pos
        self._pos += HEADER.size + meta_len
        return self._take_frame(self._buf, pos, mt, req_id, meta_len, flags, payload_len)

    def _hash_big(self) -> None:
        """Feed the big frame's tag the meta that arrived (all but the trailing tag)."""
        assert self._big is not None
        assert self._big_mac is not None
        upto = min(self._big_fill, len(self._big) - _TAG)
        if upto > self._big_hashed:
            with memoryview(self._big) as view:
                self._big_mac.update(view[self._big_hashed : upto])
            self._big_hashed = upto

    def _take_big(self) -> Message:
        """The frame collected in its own mapping: its meta is a view of the mapping (no copy
        of tens of MiB on the loop), which goes back to the kernel with the message's last
        view of it; a keyed frame's tag was computed as the bytes came."""
        big, self._big = self._big, None
        mac, self._big_mac = self._big_mac, None
        assert big is not None
        _, _, mtype, req_id, meta_len, flags, payload_len = HEADER.unpack_from(big)
        # Read-only, as the bytes of a smaller frame are: the arrays decoded from it are too.
        meta = memoryview(big).toreadonly()[HEADER.size :]
        if self._auth is not None:
            assert mac is not None
            self._auth.seq += 1
            if not hmac.compare_digest(mac.digest(), bytes(meta[-_TAG:])):
                del big, meta  # (not kept alive by the error's traceback)
                raise self._fail("frame authentication failed")
            meta = meta[:-_TAG]
        return self._decoded(MT(mtype), req_id, meta, meta_len, flags, payload_len)

    def _take_frame(
        self,
        src: bytearray,
        pos: int,
        mt: MT,
        req_id: int,
        meta_len: int,
        flags: int,
        payload_len: int,
    ) -> Message:
        """The frame whose checked header is at ``src[pos:]`` and whose meta follows it."""
        start = pos + HEADER.size
        if meta_len <= _SLICED_META and self._auth is None:
            meta = bytes(src[start : start + meta_len])  # (a slice costs less than a view)
        else:  # (a view: one copy of a large meta, and the tag's input)
            with memoryview(src) as view:
                meta = bytes(view[start : start + meta_len])
                if self._auth is not None:
                    if meta_len < _TAG or not hmac.compare_digest(
                        self._auth.tag(view[pos:start], meta[:-_TAG]), meta[-_TAG:]
                    ):
                        raise self._fail("frame authentication failed")
                    meta = meta[:-_TAG]
        return self._decoded(mt, req_id, meta, meta_len, flags, payload_len)

    def _decoded(
        self,
        mt: MT,
        req_id: int,
        meta: bytes | memoryview,
        meta_len: int,
        flags: int,
        payload_len: int,
    ) -> Message:
        if self._charging or self._reserved:
            self._unreserve()
        self.last_meta = meta_len
        if self.unwanted is not None and not payload_len and self.unwanted(mt):
            return Message(mt, req_id, flags=flags)
        try:
            msg = _decode_meta(mt, req_id, flags, payload_len, meta)
        except ProtocolError as exc:
            self._broken = exc
            raise
        self._payload_left = payload_len
        return msg


def _guess_protocol(buf: bytes | bytearray | memoryview, pos: int) -> str:
    """What a peer that does not speak ours seems to speak (for the error message): an
    HTTP server or proxy, or TLS, answering where an endpoint was expected."""
    head = bytes(buf[pos : pos + 8])
    if head.startswith((b"HTTP/", b"GET ", b"POST ", b"PUT ", b"HEAD ")):
        return " (the peer speaks HTTP: is this address a web server or proxy, not an endpoint?)"
    if head[:1] == b"\x16" and head[1:2] == b"\x03":
        return " (the peer speaks TLS: is this address a TLS server, not an endpoint?)"
    return ""
