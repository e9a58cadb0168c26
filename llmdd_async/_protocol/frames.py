"""Frames: the header, the message types, :class:`Message`, frame tags and :func:`encode`
(the format is described in the package's docstring)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import struct
from typing import Any, Protocol

from .._collector import collector_paused
from .._errors import ProtocolError

MAGIC = 0x3144444C  # b"LDD1" little-endian
#: 2: the hot messages are packed structs (1: JSON only)
PROTOCOL_VERSION = 3
HEADER = struct.Struct("<IHHQIIQ")
MAX_META = 256 << 20  # descriptor arrays of very large requests; anything larger is hostile
#: the JSON part of a frame's meta (scalar fields); arrays carry everything big
MAX_FIELDS = 1 << 20
#: ... of any frame but a table's or the handshake's (a status, a reason, a few scalars): a
#: peer's megabyte of JSON in a PING would hold the loop for tens of ms to be parsed
MAX_SMALL_FIELDS = 64 << 10
#: what big JSON fields may cost to parse, in units of ~100 ns of ``json.loads`` (one call
#: the loop cannot leave: a megabyte of ``[[]],`` held it ~100 ms): a ``[``, ``{`` or ``:``
#: counts two, a ``,`` one. At most ~40 ms here; a table of a megabyte of addresses holds
#: ~75k, of 37k keyed slots or 65k blocks keys the whole cap. Big fields carry no floats (up
#: to 40 us each to parse) and no number of over 20 digits (a u64 has at most 20; a longer
#: one costs up to 100 us).
MAX_FIELD_UNITS = 1 << 18
#: digits to ``0``, all else to ``x``: a number of over 20 digits is then ``0`` x 21 (~1 ms
#: a megabyte, where a regular expression took 26)
_DIGITS = bytes(0x30 if 0x30 <= i <= 0x39 else 0x78 for i in range(256))
#: arrays a JSON frame may name (a packed one carries at most four)
MAX_ARRAYS = 8
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


#: the frames whose JSON fields may reach MAX_FIELDS
_BIG_FIELDS = frozenset({MT.LINK_REQ, MT.LINK_ACK, MT.PROVE, MT.PROVE_ACK, MT.PROVE_FIN, MT.TABLE})


def fields_limit(mtype: MT) -> int:
    """The most bytes of JSON fields a frame of ``mtype`` may carry."""
    return MAX_FIELDS if mtype in _BIG_FIELDS else MAX_SMALL_FIELDS


#: the top bit of the meta's length prefix: the fields are packed, not JSON
PACKED = 1 << 31
#: the arrays each packed message type may carry, in their order on the wire
PACKED_ARRAYS: dict[MT, tuple[str, ...]] = {
    MT.XFER_REQ: ("local_addrs", "src_blocks", "dst_blocks", "raw_addrs"),
    MT.GRANT: ("local", "nbytes", "remote"),
    MT.DATA: (),
    MT.DONE: (),
    MT.RESULT: (),
}
_NO_ARRAY = 0xFFFFFFFF
_U32 = struct.Struct("<I")
_SEQ = struct.Struct("<Q")
_PACKED_NAMES = {t: frozenset(names) for t, names in PACKED_ARRAYS.items()}
#: the array sizes of a packed message with n arrays
_SIZES = {n: struct.Struct(f"<{n}I") for n in {len(names) for names in PACKED_ARRAYS.values()}}


@dataclasses.dataclass
class Message:
    """One frame: its type, request id, JSON fields, raw arrays and announced payload size.

    ``packed``: the fields as the message type packs them (then ``fields`` is empty)."""

    type: MT
    req_id: int = 0
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: dict[str, bytes | memoryview] = dataclasses.field(default_factory=dict)
    payload_len: int = 0
    flags: int = 0
    packed: bytes | None = None


class Framed(Protocol):
    """A typed message that encodes its own frame (the same bytes as ``encode`` of its
    message, without making one): what a writer sends besides :class:`Message`."""

    def frame(self, auth: FrameAuth | None) -> bytes:
        """The frame's header and meta; with ``auth`` tagged (frames in sending order)."""
        ...


@dataclasses.dataclass
class PayloadBytes:
    """Payload bytes that were already buffered by the decoder (a view into its buffer)."""

    data: memoryview


class FrameAuth:
    """Per-direction frame authentication: HMAC-SHA256 under a link key, with a sequence number
    so frames cannot be replayed or reordered."""

    def __init__(self, key: bytes) -> None:
        # Keyed once: each frame's tag copies it (half the cost of keying an HMAC per frame).
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)
        # Its own key: a payload MAC can never pass for a frame tag or the other way round.
        payload_key = hmac.new(key, b"payload", hashlib.sha256).digest()
        self._payload_keyed = hmac.new(payload_key, digestmod=hashlib.sha256)
        self.seq = 0

    def tag(self, header: bytes | memoryview, meta: bytes | memoryview) -> bytes:
        mac = self.start(header)
        mac.update(meta)
        self.seq += 1
        return mac.digest()

    def start(self, header: bytes | memoryview) -> hmac.HMAC:
        """The tag of the next frame (numbered ``seq``), fed its header: feed it the meta as
        it arrives, then count the frame (``seq += 1``) and compare the digest."""
        mac = self._keyed.copy()
        mac.update(_SEQ.pack(self.seq))
        mac.update(header)
        return mac

    def payload_mac(self, seq: int) -> hmac.HMAC:
        """The MAC (HMAC-SHA256, OpenSSL's: it releases the GIL on large updates) of the
        payload of the frame numbered ``seq`` in this direction (``seq - 1`` right after that
        frame was tagged); feed it the payload, then compare its digest with the trailer."""
        mac = self._payload_keyed.copy()
        mac.update(_SEQ.pack(seq))
        return mac


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


def encode(msg: Message, auth: FrameAuth | None = None) -> bytes:
    """Header and meta of ``msg``; its payload (``payload_len`` bytes) is sent after it.

    With ``auth`` the meta ends with the frame's tag (frames must then be sent in the order
    they were encoded).

    Raises:
        ProtocolError: an array whose size is not a multiple of 8, or meta over the limit; a
            packed message of a type that has no packed form, or with an array it has not;
            a table's (or handshake's) JSON fields a peer would refuse as too big.
    """
    packed = msg.packed
    if packed is not None:
        if msg.type is MT.DATA and len(packed) == _DATA_FIELDS and not msg.arrays:
            (off,) = _SEQ.unpack(packed)  # (its one packed field, a u64)
            return encode_data(msg.req_id, off, msg.payload_len, msg.flags, auth)
        return _encode_packed(msg, auth)
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
    else:
        js = json.dumps(msg.fields, separators=(",", ":")).encode()
    if msg.type in _BIG_FIELDS and (
        len(js) > MAX_FIELDS or (len(js) > MAX_SMALL_FIELDS and json_units(js) > MAX_FIELD_UNITS)
    ):
        # (a table too big for a peer: said here, not only as a peer's broken link)
        raise ProtocolError(
            f"{msg.type.name} fields of {len(js)} bytes and {json_units(js)} units of parsing "
            f"exceed what a peer takes ({MAX_FIELDS} bytes, {MAX_FIELD_UNITS} units)"
        )
    meta: list[bytes | memoryview] = [_U32.pack(len(js)), js]
    meta.extend(a for _, a in arrays)
    return _frame(msg, meta, auth)


def _frame(msg: Message, meta: list[bytes | memoryview], auth: FrameAuth | None) -> bytes:
    """Header, ``meta`` and (with ``auth``) the tag of ``msg``'s frame.

    Raises:
        ProtocolError: meta over MAX_META."""
    meta_len = sum(len(m) if isinstance(m, bytes) else m.nbytes for m in meta)
    return _framed(msg.type, msg.req_id, msg.flags, msg.payload_len, meta, meta_len, auth)


def _framed(
    mtype: MT,
    req_id: int,
    flags: int,
    payload_len: int,
    meta: list[bytes | memoryview],
    meta_len: int,
    auth: FrameAuth | None,
) -> bytes:
    """:func:`_frame` once the meta's length (tag excluded) is known.

    Raises:
        ProtocolError: meta over MAX_META."""
    if auth:
        meta_len += _TAG
    if meta_len > MAX_META:
        raise ProtocolError(f"meta of {meta_len} bytes exceeds {MAX_META}")
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, mtype, req_id, meta_len, flags, payload_len)
    return _with_tag(b"".join((head, *meta)), auth)


#: a DATA frame (the most frequent: one per layer, chunk or pulled plan) is encoded in one
#: struct: its header, then its packed fields (the stream offset), no arrays
_DATA = int(MT.DATA)
_DATA_FIELDS = 8
_DATA_META = 4 + _DATA_FIELDS
_DATA_FRAME = struct.Struct(HEADER.format + "IQ")


def encode_data(
    req_id: int, off: int, payload_len: int, flags: int, auth: FrameAuth | None = None
) -> bytes:
    """``encode`` of a DATA message (``_messages.Data``: ``off`` its packed field), from its
    fields: a tenth of the cost (one struct, no message object), for frames sent one by one
    from the loop (a layer that is ready).

    Raises:
        struct.error: a field out of its range (a bug: the caller's are checked).
    """
    frame = _DATA_FRAME.pack(
        MAGIC, PROTOCOL_VERSION, _DATA, req_id, _DATA_META + (_TAG if auth else 0), flags,
        payload_len, _DATA_FIELDS | PACKED, off,
    )  # fmt: skip
    return _with_tag(frame, auth)


def _with_tag(frame: bytes, auth: FrameAuth | None) -> bytes:
    if auth is None:
        return frame
    return frame + auth.tag(memoryview(frame)[: HEADER.size], memoryview(frame)[HEADER.size :])


def _encode_packed(msg: Message, auth: FrameAuth | None) -> bytes:
    packed = msg.packed
    assert packed is not None
    names = PACKED_ARRAYS.get(msg.type)
    if names is None:
        raise ProtocolError(f"{msg.type.name} has no packed form of {len(packed)} bytes")
    arrays = msg.arrays
    if arrays and not arrays.keys() <= _PACKED_NAMES[msg.type]:
        if not names:
            raise ProtocolError(f"{msg.type.name} carries no arrays")
        raise ProtocolError(f"{msg.type.name} carries no arrays {sorted(arrays)}")
    return encode_packed(
        msg.type, msg.req_id, packed, [arrays.get(name) for name in names], auth,
        msg.flags, msg.payload_len,
    )  # fmt: skip


def encode_packed(
    mtype: MT,
    req_id: int,
    packed: bytes,
    arrays: list[bytes | memoryview | None],
    auth: FrameAuth | None = None,
    flags: int = 0,
    payload_len: int = 0,
) -> bytes:
    """``encode`` of a packed message from its parts: the packed fields, and one entry per
    array its type may carry (:data:`PACKED_ARRAYS`, in that order; None: absent). Every
    request's frames come through here, on both ends (the typed messages' ``frame`` calls it
    with no message object): one pass over the arrays, a struct per array count.

    Raises:
        ProtocolError: packed fields over MAX_FIELDS, arrays not as the type has them, an
            array whose size is not a multiple of 8, or meta over the limit.
    """
    names = PACKED_ARRAYS.get(mtype)
    if names is None or len(packed) > MAX_FIELDS:
        raise ProtocolError(f"{mtype.name} has no packed form of {len(packed)} bytes")
    if len(arrays) != len(names):
        raise ProtocolError(f"{mtype.name} carries {len(names)} arrays, not {len(arrays)}")
    meta: list[bytes | memoryview] = [_U32.pack(len(packed) | PACKED), packed]
    meta_len = 4 + len(packed)
    if names:
        sizes: list[int] = []
        views: list[bytes | memoryview] = []
        for a in arrays:
            if a is None:
                sizes.append(_NO_ARRAY)
                continue
            if type(a) is not bytes:
                a = memoryview(a).cast("B")
            n = len(a)
            if n % 8:
                raise ProtocolError(f"a {mtype.name} array is not a multiple of 8 bytes")
            sizes.append(n)
            views.append(a)
            meta_len += n
        meta.append(_SIZES[len(names)].pack(*sizes))
        meta.extend(views)
        meta_len += 4 * len(names)
    return _framed(mtype, req_id, flags, payload_len, meta, meta_len, auth)


def _decode_packed(
    mtype: MT, req_id: int, flags: int, payload_len: int, meta: bytes | memoryview, n: int
) -> Message:
    names = PACKED_ARRAYS.get(mtype)
    if names is None:
        raise ProtocolError(f"{mtype.name} has no packed form")
    if n > MAX_FIELDS:
        raise ProtocolError(f"packed fields of {n} bytes exceed {MAX_FIELDS}")
    pos = 4 + n + 4 * len(names)
    if pos > len(meta):
        raise ProtocolError("packed fields run past the meta")
    packed = bytes(meta[4 : 4 + n])  # (no copy of a bytes meta's slice)
    arrays: dict[str, bytes | memoryview] = {}
    if names:
        view = memoryview(meta)
        sizes = _SIZES[len(names)].unpack_from(meta, 4 + n)
        for i, size in enumerate(sizes):
            if size == _NO_ARRAY:
                continue
            if size % 8 or pos + size > len(meta):
                raise ProtocolError(f"bad size {size} of array {names[i]!r}")
            arrays[names[i]] = view[pos : pos + size]
            pos += size
    if pos != len(meta):
        raise ProtocolError(f"{len(meta) - pos} unexplained bytes after the arrays")
    return Message(mtype, req_id, {}, arrays, payload_len, flags, packed)


def json_units(text: bytes) -> int:
    """What parsing JSON ``text`` costs, as :data:`MAX_FIELD_UNITS` counts it (~0.3 ms a
    megabyte: each count is one pass in C)."""
    return 2 * (text.count(b"[") + text.count(b"{") + text.count(b":")) + text.count(b",")


def _no_float(text: str) -> float:
    raise ValueError(f"a float ({text[:24]})")


def _decode_meta(
    mtype: MT, req_id: int, flags: int, payload_len: int, meta: bytes | memoryview
) -> Message:
    if len(meta) < 4:
        raise ProtocolError("meta shorter than its length prefix")
    (js_len,) = _U32.unpack_from(meta)
    if js_len & PACKED:
        return _decode_packed(mtype, req_id, flags, payload_len, meta, js_len & ~PACKED)
    if 4 + js_len > len(meta):
        raise ProtocolError("JSON length runs past the meta")
    if js_len > fields_limit(mtype):
        raise ProtocolError(
            f"JSON fields of {js_len} bytes exceed {fields_limit(mtype)} for {mtype.name}"
        )
    if js_len == 2 and len(meta) == 6 and meta[4:6] == b"{}":  # a bare control frame
        return Message(mtype, req_id, {}, {}, payload_len, flags)
    text = bytes(meta[4 : 4 + js_len])
    big = js_len > MAX_SMALL_FIELDS
    if big and (units := json_units(text)) > MAX_FIELD_UNITS:
        raise ProtocolError(
            f"JSON fields of {units} units of parsing exceed {MAX_FIELD_UNITS} for {mtype.name}"
        )
    if big and b"0" * 21 in text.translate(_DIGITS):
        raise ProtocolError(f"JSON fields of {mtype.name} with a number of over 20 digits")
    try:
        if big:
            with collector_paused():  # (see _collector: ~40 ms at most)
                fields = json.loads(text, parse_float=_no_float, parse_constant=_no_float)
        else:
            fields = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSON errors, huge integers, bad UTF-8
        raise ProtocolError(f"malformed JSON fields: {exc}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("fields must be a JSON object")
    arrays: dict[str, bytes | memoryview] = {}
    spec = fields.pop("arrays", [])
    if not isinstance(spec, list) or len(spec) > MAX_ARRAYS:
        raise ProtocolError(f"arrays must be a list of at most {MAX_ARRAYS}")
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
