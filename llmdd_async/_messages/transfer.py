"""The transfer messages: XFER_REQ (:class:`Request`, naming the target's cache by an
:class:`Address`), GRANT, DATA, DONE, RESULT and ABORT."""

from __future__ import annotations

import contextlib
import dataclasses
import struct
from typing import Any, ClassVar

import numpy as np

from .._enums import LLMStatusCode
from .._errors import ProtocolError
from .._planner import MAX_DESCRIPTORS
from .._protocol import MT, PACKED_ARRAYS, FrameAuth, Message, encode, encode_data, encode_packed
from . import packed
from .address import Address
from .fields import (
    CAPS_ORDER,
    FLAG_EAGER,
    FLAG_TO_INITIATOR,
    MAX_REASON,
    ArraysEqual,
    By,
    Cap,
    Mode,
    Op,
    Shape,
    bad_field,
    bool_field,
    caps_of,
    eager_field,
    enum_field,
    expect_type,
    int_field,
    layout_field,
    opt_int_field,
    opt_str_field,
    range_field,
    reason_field,
    status_field,
    u64_array,
    u64_bytes,
)

# ====================================================================== transfer
#: request fields left out of the frame when they hold these values (JSON costs microseconds
#: per field, on both ends of every request)
_REQ_DEFAULTS: dict[str, Any] = {
    "local_slot": 0,
    "size": -1,
    "src_offset": 0,
    "dst_offset": 0,
    "src_range": None,
    "dst_range": None,
    "tnpl": 2,
    "dst_block_bytes": None,
}


_ABSENT = object()


def _wire(*arrays: np.ndarray | None) -> list[bytes | memoryview | None]:
    return [None if a is None else u64_bytes(a) for a in arrays]


def _named(mtype: MT, arrays: list[bytes | memoryview | None]) -> dict[str, bytes | memoryview]:
    """A message's arrays by name (``PACKED_ARRAYS``' order), the absent ones left out."""
    return {n: a for n, a in zip(PACKED_ARRAYS[mtype], arrays, strict=True) if a is not None}


def _wire_range(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


@dataclasses.dataclass(slots=True, eq=False)
class Request(ArraysEqual):
    """XFER_REQ, initiator -> target: what to move, in source/destination terms.

    ``layout`` is the initiator's cache (``tensor_bytes, count, is_blocks``; its tensors at
    ``local_addrs``); ``raw``/``raw_addrs`` the target's memory when it is named by address.
    Immutable by convention: a frozen one costs 6 us to build instead of 1.6 (each request).
    """

    req_id: int
    op: Op
    target: Address
    shape: Shape
    layout: tuple[int, int, bool]
    local_addrs: np.ndarray
    caps: frozenset[Cap] = frozenset()
    timeout_ms: int = 0
    local_slot: int = 0
    size: int = -1
    src_offset: int = 0
    dst_offset: int = 0
    src_range: range | None = None
    dst_range: range | None = None
    tensor_num_per_layer: int = 2
    dst_block_bytes: int | None = None
    src_blocks: np.ndarray | None = None
    dst_blocks: np.ndarray | None = None
    raw: tuple[int, int, bool] | None = None
    raw_addrs: np.ndarray | None = None
    #: the initiator's cache's element type (a ``DataType`` value); None: not said (earlier
    #: releases leave it out), then the target does not check it
    dtype: int | None = None
    #: a push whose bytes follow at once, before any GRANT (DATA frames flagged
    #: ``FLAG_EAGER``): ``(total bytes, digest)``, the digest that of the initiator's ranges in
    #: stream order as it planned them from the target's table (``grants.stream_digest``)
    eager: tuple[int, int] | None = None

    def encode(self) -> Message:
        body = self._packed()
        arrays = _named(MT.XFER_REQ, self._wire_arrays())
        if body is not None:
            return Message(MT.XFER_REQ, self.req_id, {}, arrays, packed=body)
        return Message(MT.XFER_REQ, self.req_id, self._fields(), arrays)

    def frame(self, auth: FrameAuth | None) -> bytes:
        """``encode(self.encode(), auth)`` with no message object (every request's frame).

        Raises:
            ProtocolError: as ``encode`` (an array or the meta over its limits)."""
        body = self._packed()
        if body is None:  # (an integer outside int64: JSON carries it)
            return encode(self.encode(), auth)
        return encode_packed(MT.XFER_REQ, self.req_id, body, self._wire_arrays(), auth)

    def _wire_arrays(self) -> list[bytes | memoryview | None]:
        """The arrays in ``PACKED_ARRAYS[XFER_REQ]``'s order, as wire bytes (None: absent)."""
        return _wire(self.local_addrs, self.src_blocks, self.dst_blocks, self.raw_addrs)

    def _packed(self) -> bytes | None:
        t = self.target
        tb, count, is_blocks = self.layout
        present = packed.BLOCKS if is_blocks else 0
        src_r, dst_r, dbb, raw, dtype, eager = (
            self.src_range,
            self.dst_range,
            self.dst_block_bytes,
            self.raw,
            self.dtype,
            self.eager,
        )
        if src_r is not None:
            present |= packed.HAS_SRC_RANGE
        if dst_r is not None:
            present |= packed.HAS_DST_RANGE
        if dbb is not None:
            present |= packed.HAS_DST_BB
        if raw is not None:
            present |= packed.HAS_RAW | (packed.RAW_BLOCKS if raw[2] else 0)
        if dtype is not None:
            present |= packed.HAS_DTYPE
        if eager is not None:
            present |= packed.HAS_EAGER
        caps = 0
        for c in self.caps:
            caps |= packed.CAP_BIT[c]
        try:
            return packed.REQ.pack(
                packed.OPS.index(self.op),
                packed.SHAPES.index(self.shape),
                packed.BYS.index(t.by),
                present,
                caps,
                t.id,
                t.model_id,
                t.cache_id,
                t.index,
                tb,
                count,
                self.timeout_ms,
                self.local_slot,
                self.size,
                self.src_offset,
                self.dst_offset,
                0 if src_r is None else src_r.start,
                0 if src_r is None else src_r.stop,
                0 if dst_r is None else dst_r.start,
                0 if dst_r is None else dst_r.stop,
                self.tensor_num_per_layer,
                0 if dbb is None else dbb,
                0 if raw is None else raw[0],
                0 if raw is None else raw[1],
                0 if dtype is None else dtype,
                0 if eager is None else eager[0],
                0 if eager is None else eager[1],
            )
        except struct.error:  # an integer outside int64: JSON carries it
            return None

    def _fields(self) -> dict[str, Any]:
        tb, count, is_blocks = self.layout
        fields: dict[str, Any] = {
            "op": self.op,
            "target": self.target.encode(),
            "shape": self.shape,
            "layout": [tb, count, is_blocks],
            "caps": self.caps_claimed(),
            "timeout_ms": self.timeout_ms,
        }
        for name, value in (
            ("local_slot", self.local_slot),
            ("size", self.size),
            ("src_offset", self.src_offset),
            ("dst_offset", self.dst_offset),
            ("src_range", _wire_range(self.src_range)),
            ("dst_range", _wire_range(self.dst_range)),
            ("tnpl", self.tensor_num_per_layer),
            ("dst_block_bytes", self.dst_block_bytes),
        ):
            if value != _REQ_DEFAULTS[name]:
                fields[name] = value
        if self.raw is not None:
            fields["raw"] = list(self.raw)
        if self.dtype is not None:
            fields["dtype"] = self.dtype
        if self.eager is not None:
            fields["eager"] = list(self.eager)
        return fields

    @classmethod
    def decode(cls, msg: Message) -> Request:
        """Raises:
        ProtocolError: any field missing (where it has no default) or malformed, a request
            without the initiator's tensors, or one by address without the target's."""
        expect_type(msg, MT.XFER_REQ)
        local_addrs = u64_array(msg, "local_addrs")
        if local_addrs is None or not len(local_addrs):
            raise ProtocolError("request without the initiator's layout")
        raw_addrs = u64_array(msg, "raw_addrs")
        if msg.packed is not None:
            return cls._decode_packed(msg, local_addrs, raw_addrs)
        f = msg.fields
        target = Address.decode(f.get("target"))
        if target.by is By.ADDRS and (raw_addrs is None or not len(raw_addrs)):
            raise ProtocolError("addressing by addresses without addresses")
        caps = f.get("caps")
        if caps is not None and not isinstance(caps, dict):
            raise bad_field("caps", caps)
        raw = f.get("raw")
        g = f.get
        eager = g("eager")

        def opt(name: str, what: str) -> int:
            # most fields are left out at their defaults (see _REQ_DEFAULTS)
            value = g(name, _ABSENT)
            return _REQ_DEFAULTS[name] if value is _ABSENT else int_field(value, what)

        return cls(
            msg.req_id,
            enum_field(Op, g("op"), "op"),
            target,
            enum_field(Shape, g("shape"), "shape"),
            layout_field(g("layout"), "layout"),
            local_addrs,
            caps=caps_of(caps),
            timeout_ms=int_field(g("timeout_ms", 0), "timeout", 0),
            local_slot=opt("local_slot", "local slot"),
            size=opt("size", "size"),
            src_offset=opt("src_offset", "source offset"),
            dst_offset=opt("dst_offset", "destination offset"),
            src_range=range_field(g("src_range"), "source range"),
            dst_range=range_field(g("dst_range"), "destination range"),
            tensor_num_per_layer=opt("tnpl", "tensors per layer"),
            dst_block_bytes=opt_int_field(g("dst_block_bytes"), "destination block bytes"),
            src_blocks=u64_array(msg, "src_blocks"),
            dst_blocks=u64_array(msg, "dst_blocks"),
            raw=None if raw is None else layout_field(raw, "raw layout"),
            raw_addrs=raw_addrs,
            dtype=opt_int_field(g("dtype"), "data type", 0),
            eager=None if eager is None else eager_field(eager),
        )

    @classmethod
    def _decode_packed(
        cls, msg: Message, local_addrs: np.ndarray, raw_addrs: np.ndarray | None
    ) -> Request:
        """The packed form; checks as the JSON one (its integers fit int64 by construction)."""
        (op, shape, by, present, caps, key_id, model_id, cache_id, index, tb, count, timeout,
         local_slot, size, src_offset, dst_offset, src_a, src_b, dst_a, dst_b, tnpl, dbb,
         raw_tb, raw_count, dtype, eager_n, digest) = packed.unpack(packed.REQ, msg)  # fmt: skip
        by = packed.index(packed.BYS, by, "addressing")
        if by is By.REQ_KEY or by is By.PREFIX_KEY:
            target = Address(by, id=key_id, model_id=model_id)
        elif by is By.BLOCKS_KEY:
            target = Address(by, model_id=model_id)
        elif by is By.CACHE_ID:
            target = Address(by, cache_id=cache_id, index=index)
        else:
            if raw_addrs is None or not len(raw_addrs):
                raise ProtocolError("addressing by addresses without addresses")
            target = Address(by)
        if tb < 0 or count < 0:
            raise bad_field("layout", [tb, count])
        raw = None
        if present & packed.HAS_RAW:
            if raw_tb < 0 or raw_count < 0:
                raise bad_field("raw layout", [raw_tb, raw_count])
            raw = (raw_tb, raw_count, bool(present & packed.RAW_BLOCKS))
        return cls(
            msg.req_id,
            packed.index(packed.OPS, op, "op"),
            target,
            packed.index(packed.SHAPES, shape, "shape"),
            (tb, count, bool(present & packed.BLOCKS)),
            local_addrs,
            caps=packed.caps_of_bits(caps),
            timeout_ms=int_field(timeout, "timeout", 0),
            local_slot=local_slot,
            size=size,
            src_offset=src_offset,
            dst_offset=dst_offset,
            src_range=range(src_a, src_b) if present & packed.HAS_SRC_RANGE else None,
            dst_range=range(dst_a, dst_b) if present & packed.HAS_DST_RANGE else None,
            tensor_num_per_layer=tnpl,
            dst_block_bytes=dbb if present & packed.HAS_DST_BB else None,
            src_blocks=u64_array(msg, "src_blocks"),
            dst_blocks=u64_array(msg, "dst_blocks"),
            raw=raw,
            raw_addrs=raw_addrs,
            dtype=int_field(dtype, "data type", 0) if present & packed.HAS_DTYPE else None,
            eager=eager_field([eager_n, digest]) if present & packed.HAS_EAGER else None,
        )

    def caps_claimed(self) -> dict[str, bool]:
        """The caps as the link's policy reads them (name -> True)."""
        caps = self.caps
        return {c: True for c in CAPS_ORDER if c in caps} if caps else {}


@dataclasses.dataclass(slots=True, eq=False)
class Grant(ArraysEqual):
    """GRANT, target -> initiator: the status and, on success, the resolved plan: ``local``
    (the initiator's ranges), ``nbytes``, and in local mode ``remote`` (the target's).
    ``done=False``: the target expects no DONE (a streamed pull that consumes nothing)."""

    req_id: int
    status: LLMStatusCode = LLMStatusCode.LLM_SUCCESS
    message: str | None = None
    mode: Mode | None = None
    total: int | None = None
    done: bool = True
    local: np.ndarray | None = None
    nbytes: np.ndarray | None = None
    remote: np.ndarray | None = None

    @classmethod
    def refusal(cls, req_id: int, status: LLMStatusCode, message: str) -> Grant:
        return cls(req_id, status, message)

    @property
    def ok(self) -> bool:
        return self.status == LLMStatusCode.LLM_SUCCESS

    def encode(self) -> Message:
        arrays = _named(MT.GRANT, self._wire_arrays())
        mode, total = self.mode, self.total
        body = self._packed()
        if body is not None:
            return Message(MT.GRANT, self.req_id, {}, arrays, packed=body)
        fields: dict[str, Any] = {"status": int(self.status)}
        if self.message is not None:
            fields["message"] = self.message[:MAX_REASON]
        if mode is not None:
            fields["mode"] = mode
        if total is not None:
            fields["total"] = total
        if not self.done:
            fields["done"] = False
        return Message(MT.GRANT, self.req_id, fields, arrays)

    def _packed(self) -> bytes | None:
        """The packed fields; None where JSON carries them (a reason, or a status or total
        that does not fit)."""
        if self.message is not None:
            return None
        mode, total = self.mode, self.total
        present = (0 if mode is None else packed.HAS_MODE) | (
            0 if total is None else packed.HAS_TOTAL
        )
        present |= 0 if self.done else packed.NO_DONE
        with_mode = 0 if mode is None else packed.MODES.index(mode)
        try:
            return packed.GRANT.pack(int(self.status), present, with_mode, total or 0)
        except struct.error:
            return None

    def frame(self, auth: FrameAuth | None) -> bytes:
        """``encode(self.encode(), auth)`` with no message object (every request's GRANT).

        Raises:
            ProtocolError: as ``encode`` (an array or the meta over its limits)."""
        body = self._packed()
        if body is None:
            return encode(self.encode(), auth)
        return encode_packed(MT.GRANT, self.req_id, body, self._wire_arrays(), auth)

    def _wire_arrays(self) -> list[bytes | memoryview | None]:
        """The arrays in ``PACKED_ARRAYS[GRANT]``'s order, as wire bytes (None: absent)."""
        return _wire(self.local, self.nbytes, self.remote)

    @classmethod
    def decode(cls, msg: Message) -> Grant:
        """Raises:
        ProtocolError: a malformed field; a successful grant without a mode or a plan, with
            more than MAX_DESCRIPTORS descriptors, or in local mode without remote ranges."""
        expect_type(msg, MT.GRANT)
        if msg.packed is not None:
            code, present, mode_i, total = packed.unpack(packed.GRANT, msg)
            status = status_field(code)
            if present & packed.HAS_TOTAL and total < 0:
                raise bad_field("total", total)
            grant = cls(
                msg.req_id,
                status,
                None,
                packed.index(packed.MODES, mode_i, "mode") if present & packed.HAS_MODE else None,
                total if present & packed.HAS_TOTAL else None,
                not present & packed.NO_DONE,
                u64_array(msg, "local"),
                u64_array(msg, "nbytes"),
                u64_array(msg, "remote"),
            )
        else:
            f = msg.fields
            status = status_field(f.get("status"))
            mode = f.get("mode")
            done = f.get("done", True)
            grant = cls(
                msg.req_id,
                status,
                opt_str_field(f.get("message"), "message"),
                None if mode is None else enum_field(Mode, mode, "mode"),
                opt_int_field(f.get("total"), "total", 0),
                bool_field(done, "done"),
                u64_array(msg, "local"),
                u64_array(msg, "nbytes"),
                u64_array(msg, "remote"),
            )
        if status == LLMStatusCode.LLM_SUCCESS:
            local, nbytes, remote = grant.local, grant.nbytes, grant.remote
            if grant.mode is None or local is None or nbytes is None or len(local) != len(nbytes):
                raise ProtocolError("GRANT without a plan")
            if len(local) > MAX_DESCRIPTORS:  # no honest target plans more
                raise ProtocolError(f"GRANT of {len(local)} descriptors")
            if grant.mode is Mode.LOCAL and (remote is None or len(remote) != len(nbytes)):
                raise ProtocolError("local-mode GRANT without remote ranges")
        return grant


@dataclasses.dataclass(frozen=True, slots=True)
class Data:
    """DATA, either way: ``payload_len`` bytes of a granted plan's stream from ``off`` (the
    payload follows the frame; with ``llm.PayloadAuth`` it ends with its MAC)."""

    req_id: int
    off: int
    payload_len: int
    to_initiator: bool = False
    #: the bytes of a push sent behind its request, before any GRANT (``Request.eager``)
    eager: bool = False

    def encode(self) -> Message:
        flags = (FLAG_TO_INITIATOR if self.to_initiator else 0) | (FLAG_EAGER if self.eager else 0)
        return Message(
            MT.DATA, self.req_id, {}, {}, self.payload_len, flags, packed.OFF.pack(self.off)
        )

    @staticmethod
    def frame(
        req_id: int, off: int, payload_len: int, to_initiator: bool, auth: FrameAuth | None
    ) -> bytes:
        """``encode(Data(req_id, off, payload_len, to_initiator).encode(), auth)``, the same
        bytes for a tenth of the cost (no message objects): for DATA frames sent one at a time
        from the loop (a layer as the model makes it ready)."""
        return encode_data(req_id, off, payload_len, FLAG_TO_INITIATOR if to_initiator else 0, auth)

    @classmethod
    def decode(cls, msg: Message) -> Data:
        """Raises:
        ProtocolError: a missing or negative offset."""
        expect_type(msg, MT.DATA)
        return cls(
            msg.req_id,
            cls.offset_of(msg),
            msg.payload_len,
            bool(msg.flags & FLAG_TO_INITIATOR),
            bool(msg.flags & FLAG_EAGER),
        )

    @staticmethod
    def offset_of(msg: Message) -> int:
        """The offset of a DATA frame (what the reader needs of it, before its payload).

        Raises:
            ProtocolError: a missing or negative offset, or one past 2**64 - 1."""
        if msg.packed is not None:
            return int(packed.unpack(packed.OFF, msg)[0])
        return int_field(msg.fields.get("off"), "DATA offset", 0)


@dataclasses.dataclass(frozen=True, slots=True)
class _Status:
    """A frame that carries a status and maybe a reason."""

    TYPE: ClassVar[MT]
    req_id: int
    status: LLMStatusCode = LLMStatusCode.LLM_SUCCESS
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == LLMStatusCode.LLM_SUCCESS

    def encode(self) -> Message:
        code = int(self.status)
        if self.message is None:
            with contextlib.suppress(struct.error):  # a code that does not fit: JSON
                return Message(self.TYPE, self.req_id, packed=packed.STATUS.pack(code))
        fields: dict[str, Any] = {"status": code}
        if self.message is not None:
            fields["message"] = self.message[:MAX_REASON]  # (what the peer keeps)
        return Message(self.TYPE, self.req_id, fields)

    @classmethod
    def decode(cls, msg: Message) -> Any:
        """Never raises for a frame of its type (status and reason are read leniently; a
        packed one of the wrong size fails).

        Raises:
            ProtocolError: a frame of another type."""
        expect_type(msg, cls.TYPE)
        if msg.packed is not None:
            body = msg.packed
            code = packed.STATUS.unpack(body)[0] if len(body) == packed.STATUS.size else None
            return cls(msg.req_id, status_field(code))
        return cls(
            msg.req_id,
            status_field(msg.fields.get("status")),
            reason_field(msg.fields.get("message")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Done(_Status):
    """DONE, initiator -> target: the initiator finished (its status)."""

    TYPE: ClassVar[MT] = MT.DONE


@dataclasses.dataclass(frozen=True, slots=True)
class Result(_Status):
    """RESULT, target -> initiator: the target received every byte of a streamed push."""

    TYPE: ClassVar[MT] = MT.RESULT


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """ABORT, either way: stop this request (why, and its status). ``broken``: the sender
    breaks the link too. ``to_initiator``: the receiver started the request."""

    req_id: int
    status: LLMStatusCode
    message: str | None = None
    broken: bool = False
    to_initiator: bool = False

    def encode(self) -> Message:
        fields: dict[str, Any] = {"status": int(self.status)}
        if self.message is not None:
            fields["message"] = self.message[:MAX_REASON]  # (what the peer keeps)
        if self.broken:
            fields["broken"] = True
        flags = FLAG_TO_INITIATOR if self.to_initiator else 0
        return Message(MT.ABORT, self.req_id, fields, flags=flags)

    @classmethod
    def decode(cls, msg: Message) -> Abort:
        """Never raises for an ABORT (a peer's reason is kept, bounded to MAX_REASON).

        Raises:
            ProtocolError: a frame of another type."""
        expect_type(msg, MT.ABORT)
        f = msg.fields
        return cls(
            msg.req_id,
            status_field(f.get("status")),
            reason_field(f.get("message")),
            f.get("broken") is True,
            bool(msg.flags & FLAG_TO_INITIATOR),
        )
