"""The wire protocol, sans-IO: bytes in, events out. No sockets, no anyio, no numpy.

Every frame starts with a fixed 32-byte little-endian header::

    magic u32 | version u16 | type u16 | req_id u64 | meta_len u32 | flags u32 | payload_len u64

``meta`` follows: a u32 length-prefixed UTF-8 JSON object of scalar fields, then the raw bytes
of the arrays it names (``"arrays": [[name, nbytes], ...]``; arrays hold little-endian u64 or
i64 integers, so their sizes are multiples of 8). ``payload_len`` bytes of bulk data follow
the meta; the decoder hands them out without copying them into messages, so the I/O layer can
receive them straight into their destination. There is no pickle anywhere.

On a keyed link (``llm.AuthKey``) every frame's meta ends with a 32-byte HMAC-SHA256 tag over
the frame's sequence number in its direction, its header and its meta (a :class:`FrameAuth`
on each side): a relay can neither inject, drop, replay nor reorder frames. Payload bytes are
covered only with ``llm.PayloadAuth``: then a DATA frame's payload ends with a 32-byte
trailer, :meth:`FrameAuth.payload_mac` over the frame's sequence number and the payload bytes
before it (``payload_len`` counts the trailer). The frame's own tag binds its header to the
same sequence number, so a relay can neither change payload bytes nor move a payload and its
trailer onto another frame (see the README's security model).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import mmap
import struct
import time
from collections.abc import Callable
from typing import Any

from ._errors import ProtocolError

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_META",
    "MT",
    "NEED_DATA",
    "PAYLOAD_TAG",
    "PROTOCOL_VERSION",
    "MAX_FIELDS",
    "Decoder",
    "FrameAuth",
    "MetaBudget",
    "Message",
    "PayloadBytes",
    "encode",
]

MAGIC = 0x3144444C  # b"LDD1" little-endian
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<IHHQIIQ")
MAX_META = 256 << 20  # descriptor arrays of very large requests; anything larger is hostile
#: the JSON part of a frame's meta (scalar fields); arrays carry everything big
MAX_FIELDS = 1 << 20
MAX_PAYLOAD = 1 << 40
_TAG = 32
#: bytes of the MAC trailer of a DATA frame's payload (``llm.PayloadAuth``)
PAYLOAD_TAG = 32


class MT(enum.IntEnum):
    """Message types."""

    HELLO = 1  # client -> server: version, nonce
    CHALLENGE = 2  # server -> client: nonce, whether auth is required
    LINK_REQ = 3  # client -> server: identity (+ MAC)
    LINK_ACK = 4  # server -> client: status, identity (+ MAC)
    PROVE = 5  # same-host side channel, server -> client: binding, pools, probe
    PROVE_ACK = 6  # same-host side channel, client -> server: status, pools, probe
    PROVE_FIN = 7  # same-host side channel, server -> client: pools, probe
    XFER_REQ = 10  # initiator -> target: what to move
    GRANT = 11  # target -> initiator: status and the resolved plan
    DATA = 12  # either way: a chunk of a granted plan's bytes (payload)
    DONE = 13  # initiator -> target: the initiator finished (status)
    RESULT = 14  # target -> initiator: the target received everything (push over the stream)
    ABORT = 15  # either way: stop this request (status)
    TABLE_REQ = 20
    TABLE = 21
    UNLINK = 30
    UNLINK_ACK = 31
    PING = 40
    PONG = 41
    BYE = 50  # orderly close (finalize)


@dataclasses.dataclass
class Message:
    """One frame: its type, request id, JSON fields, raw arrays and announced payload size."""

    type: MT
    req_id: int = 0
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: dict[str, bytes | memoryview] = dataclasses.field(default_factory=dict)
    payload_len: int = 0
    flags: int = 0


@dataclasses.dataclass
class PayloadBytes:
    """Payload bytes that were already buffered by the decoder (a view into its buffer)."""

    data: memoryview


class FrameAuth:
    """Per-direction frame authentication: HMAC-SHA256 under a link key, with a sequence number
    so frames cannot be replayed or reordered."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        # Its own key: a payload MAC can never pass for a frame tag or the other way round.
        self._payload_key = hmac.new(key, b"payload", hashlib.sha256).digest()
        self.seq = 0

    def tag(self, header: bytes | memoryview, meta: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, struct.pack("<Q", self.seq), hashlib.sha256)
        mac.update(header)
        mac.update(meta)
        self.seq += 1
        return mac.digest()

    def payload_mac(self, seq: int) -> hmac.HMAC:
        """The MAC (HMAC-SHA256, OpenSSL's: it releases the GIL on large updates) of the
        payload of the frame numbered ``seq`` in this direction (``seq - 1`` right after that
        frame was tagged); feed it the payload, then compare its digest with the trailer."""
        return hmac.new(self._payload_key, struct.pack("<Q", seq), "sha256")


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


def encode(msg: Message, auth: FrameAuth | None = None) -> bytes:
    """Header and meta of ``msg``; its payload (``payload_len`` bytes) is sent after it.

    With ``auth`` the meta ends with the frame's tag (frames must then be sent in the order
    they were encoded).

    Raises:
        ProtocolError: an array whose size is not a multiple of 8, or meta over the limit.
    """
    arrays = [(name, memoryview(a).cast("B")) for name, a in msg.arrays.items()]
    for name, a in arrays:
        if a.nbytes % 8:
            raise ProtocolError(f"array {name!r} is {a.nbytes} bytes, not a multiple of 8")
    if arrays:
        fields = dict(msg.fields)
        fields["arrays"] = [[name, a.nbytes] for name, a in arrays]
        js = json.dumps(fields, separators=(",", ":")).encode()
    elif not msg.fields:
        js = b"{}"
    elif len(msg.fields) == 1 and type(off := msg.fields.get("off")) is int and off >= 0:
        js = b'{"off":%d}' % off  # every DATA frame: the same bytes json.dumps would give
    else:
        js = json.dumps(msg.fields, separators=(",", ":")).encode()
    meta_len = 4 + len(js) + sum(a.nbytes for _, a in arrays) + (_TAG if auth else 0)
    if meta_len > MAX_META:
        raise ProtocolError(f"meta of {meta_len} bytes exceeds {MAX_META}")
    parts: list[bytes | memoryview] = [
        HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            int(msg.type),
            msg.req_id,
            meta_len,
            msg.flags,
            msg.payload_len,
        ),
        struct.pack("<I", len(js)),
        js,
    ]
    parts.extend(a for _, a in arrays)
    frame = b"".join(parts)
    if auth is None:
        return frame
    return frame + auth.tag(memoryview(frame)[: HEADER.size], memoryview(frame)[HEADER.size :])


def _decode_meta(mtype: MT, req_id: int, flags: int, payload_len: int, meta: bytes) -> Message:
    if len(meta) < 4:
        raise ProtocolError("meta shorter than its length prefix")
    (js_len,) = struct.unpack_from("<I", meta)
    if 4 + js_len > len(meta):
        raise ProtocolError("JSON length runs past the meta")
    if js_len > MAX_FIELDS:
        raise ProtocolError(f"JSON fields of {js_len} bytes exceed {MAX_FIELDS}")
    if js_len == 2 and len(meta) == 6 and meta[4:6] == b"{}":  # a bare control frame
        return Message(mtype, req_id, {}, {}, payload_len, flags)
    if len(meta) == 4 + js_len and meta[4:11] == b'{"off":' and meta[-1:] == b"}":
        digits = meta[11:-1]
        # A DATA frame's only field, exactly as encode writes it (anything else: json).
        if len(digits) <= 20 and digits.isdigit() and (digits[:1] != b"0" or len(digits) == 1):
            return Message(mtype, req_id, {"off": int(digits)}, {}, payload_len, flags)
    try:
        fields = json.loads(bytes(meta[4 : 4 + js_len]))
    except (ValueError, RecursionError) as exc:  # JSON errors, huge integers, bad UTF-8
        raise ProtocolError(f"malformed JSON fields: {exc}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("fields must be a JSON object")
    arrays: dict[str, bytes | memoryview] = {}
    spec = fields.pop("arrays", [])
    if not isinstance(spec, list):
        raise ProtocolError("arrays must be a list")
    pos = 4 + js_len
    view = memoryview(meta)
    for item in spec:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], int)
            or isinstance(item[1], bool)
            or item[1] < 0
            or item[1] % 8
        ):
            raise ProtocolError(f"bad array entry {item!r}")
        name, nbytes = item
        if pos + nbytes > len(meta):
            raise ProtocolError(f"array {name!r} runs past the meta")
        arrays[name] = view[pos : pos + nbytes]
        pos += nbytes
    if pos != len(meta):
        raise ProtocolError(f"{len(meta) - pos} unexplained bytes after the arrays")
    return Message(mtype, req_id, fields, arrays, payload_len, flags)


#: a frame's meta up to this size is not charged to a :class:`MetaBudget`: one read-ahead
#: (a connection buffers at most its frame plus one read)
UNCHARGED_META = 64 << 10
#: a partial frame with more meta than this is collected in a mapping of its own (a mapping
#: costs ~0.1 ms, so smaller ones grow the buffer instead)
_MAPPED_META = 1 << 20


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
            big, self._big = self._big, None
            try:
                _, _, mtype, req_id, meta_len, flags, payload_len = HEADER.unpack_from(big)
                return self._take_frame(big, 0, MT(mtype), req_id, meta_len, flags, payload_len)
            finally:
                big.close()
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
            raise self._fail(f"unsupported protocol version {version}")
        try:
            mt = MT(mtype)
        except ValueError:
            raise self._fail(f"unknown message type {mtype}") from None
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
                big = mmap.mmap(-1, HEADER.size + meta_len)
                big[:avail] = memoryview(self._buf)[self._pos :]
                self._big, self._big_fill = big, avail
                self._buf = bytearray()
                self._pos = 0
            return NEED_DATA
        pos = self._pos
        self._pos += HEADER.size + meta_len
        return self._take_frame(self._buf, pos, mt, req_id, meta_len, flags, payload_len)

    def _take_frame(
        self,
        src: bytearray | mmap.mmap,
        pos: int,
        mt: MT,
        req_id: int,
        meta_len: int,
        flags: int,
        payload_len: int,
    ) -> Message:
        """The frame whose checked header is at ``src[pos:]`` and whose meta follows it."""
        start = pos + HEADER.size
        with memoryview(src) as view:
            meta = bytes(view[start : start + meta_len])
            if self._auth is not None:
                if meta_len < _TAG or not hmac.compare_digest(
                    self._auth.tag(view[pos:start], meta[:-_TAG]), meta[-_TAG:]
                ):
                    raise self._fail("frame authentication failed")
                meta = meta[:-_TAG]
        self._unreserve()
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
