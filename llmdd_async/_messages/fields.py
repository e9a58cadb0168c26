"""The words and field readers of the wire messages: the vocabularies (enums whose values
are the wire's strings) and one strict reader per kind of field, each raising
:class:`ProtocolError` for a malformed value; a peer's status and reasons are read leniently.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from .._enums import LLMStatusCode
from .._errors import ProtocolError
from .._protocol import MT, Message

#: DATA/ABORT flag: the frame concerns a request that the *receiver* of the frame started.
FLAG_TO_INITIATOR = 1
#: DATA flag: the bytes of a push sent right behind its XFER_REQ, before any GRANT (the
#: request's ``eager``); they land only where the target took the push as sent
FLAG_EAGER = 2
#: characters of a peer's reason (an ABORT's message) kept
MAX_REASON = 512

_U64 = np.uint64
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


# ====================================================================== vocabularies
class _Words(str, enum.Enum):
    """A vocabulary of the wire: each member is its string there (and equal to it)."""

    def __str__(self) -> str:
        return str(self.value)


class Op(_Words):
    """Which way a request moves bytes, seen from the target."""

    PULL = "pull"  # the target is the source
    PUSH = "push"  # the target is the destination


class Shape(_Words):
    """How a request selects its bytes (see :mod:`._planner`)."""

    SLOT = "slot"
    BLOCKS = "blocks"
    SLOT_TO_BLOCKS = "slot_to_blocks"


class Mode(_Words):
    """How a granted request's bytes travel."""

    LOCAL = "local"  # the initiator copies straight from/to the target's memory
    STREAM = "stream"  # DATA frames on the link


class By(_Words):
    """How a request names the target's cache (the request's :class:`Address`)."""

    REQ_KEY = "req_key"
    PREFIX_KEY = "prefix_key"
    BLOCKS_KEY = "blocks_key"
    CACHE_ID = "cache_id"
    ADDRS = "addrs"


class Cap(_Words):
    """How an initiator can reach the target's memory directly (sent with each request), in
    the order a request lists them."""

    INPROC = "inproc"  # all of it (same process)
    POOLS = "pools"  # its shared pools
    PVR = "pvr"  # any of it (process_vm_readv)
    NIXL = "nixl"  # what is registered with its NIXL agent
    #: it takes a local grant of what a key grants in a cache the target does not publish,
    #: where it reaches the target's process itself (releases before this one refuse one)
    KEY_READS = "key_reads"
    #: what is registered with its Mooncake transfer engine (new words go last: a request's
    #: bytes stay what they were when it does not use them)
    MOONCAKE = "mooncake"


#: each vocabulary by its wire strings
_WORDS: dict[type[_Words], dict[str, _Words]] = {
    cls: {m.value: m for m in cls} for cls in (Op, Shape, Mode, By, Cap)
}
#: the caps in the order a request lists them
CAPS_ORDER: tuple[Cap, ...] = tuple(Cap)


def caps_of(claimed: Mapping[str, Any] | None) -> frozenset[Cap]:
    """The known caps ``claimed`` sets to True (unknown names and other values: not claimed)."""
    if not claimed:
        return frozenset()
    return frozenset(c for c in CAPS_ORDER if claimed.get(c) is True)


# ====================================================================== field readers
def bad_field(what: str, value: Any) -> ProtocolError:
    text = repr(value)
    return ProtocolError(f"bad {what}: {text[:80]}{'...' if len(text) > 80 else ''}")


def int_field(value: Any, what: str, lo: int = I64_MIN, hi: int = U64_MAX) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise bad_field(what, value)
    return value


def eager_field(value: Any) -> tuple[int, int]:
    """An eager push's ``[total bytes, digest]`` (``Request.eager``).

    Raises:
        ProtocolError: not a pair, a total that is not positive, a digest outside int64."""
    if not isinstance(value, list) or len(value) != 2:
        raise bad_field("eager", value)
    return int_field(value[0], "eager bytes", 1), int_field(value[1], "eager digest", hi=I64_MAX)


def opt_int_field(value: Any, what: str, lo: int = I64_MIN) -> int | None:
    return None if value is None else int_field(value, what, lo)


def bool_field(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise bad_field(what, value)
    return value


def str_field(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise bad_field(what, value)
    return value


def opt_str_field(value: Any, what: str) -> str | None:
    return None if value is None else str_field(value, what)


_E = TypeVar("_E", bound=_Words)


def enum_field(cls: type[_E], value: Any, what: str) -> _E:
    # A dict lookup: calling the enum class costs about a microsecond per field.
    member = _WORDS[cls].get(value) if isinstance(value, str) else None
    if member is None:
        raise bad_field(what, value)
    return member  # type: ignore[return-value]


def range_field(value: Any, what: str) -> range | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise bad_field(what, value)
    return range(int_field(value[0], what), int_field(value[1], what))


def layout_field(value: Any, what: str) -> tuple[int, int, bool]:
    """``[tensor_bytes, count, is_blocks]`` of a cache layout."""
    if not isinstance(value, list) or len(value) != 3:
        raise bad_field(what, value)
    return int_field(value[0], what, 0), int_field(value[1], what, 0), bool_field(value[2], what)


def status_field(value: Any) -> LLMStatusCode:
    return LLMStatusCode.from_wire(value) if type(value) is int else LLMStatusCode.LLM_FAILED


def reason_field(value: Any) -> str | None:
    return None if value is None else str(value)[:MAX_REASON]


#: the wire's u64 (little-endian) as numpy reads it; native on little-endian hosts, so the
#: arrays below are read with no conversion (one numpy call per array, on every request)
_WIRE_U64 = np.dtype("<u8")
_NATIVE = np.dtype(_U64) == _WIRE_U64


#: little-endian 64-bit integers: their bytes are the wire's u64 as they are (block lists are
#: int64; a negative one wraps, as a cast to u64 does)
_AS_WIRE = (_WIRE_U64, np.dtype("<i8"))


def u64_bytes(arr: np.ndarray) -> bytes | memoryview:
    """``arr`` as the wire's little-endian u64 bytes."""
    if arr.dtype in _AS_WIRE and arr.size <= 64:  # (a few: a copy costs a third of a view)
        return arr.tobytes()
    return np.ascontiguousarray(arr, dtype="<u8").data.cast("B")


def u64_array(msg: Message, name: str) -> np.ndarray | None:
    raw = msg.arrays.get(name)
    if raw is None:
        return None
    # A view, not a copy: the decoded frame's bytes are immutable and live as long as it.
    arr = np.frombuffer(raw, dtype=_WIRE_U64)
    return arr if _NATIVE else arr.astype(_U64)


def expect_type(msg: Message, mtype: MT) -> None:
    if msg.type != mtype:
        raise ProtocolError(f"expected {mtype.name}, got {msg.type.name}")


def wire_status(msg: Message) -> LLMStatusCode:
    """The ``status`` field of a peer's frame; missing, malformed or unknown is LLM_FAILED.
    (A packed GRANT, DONE or RESULT starts with its status, an int32.)"""
    packed = msg.packed
    if packed is not None:
        return status_field(
            int.from_bytes(packed[:4], "little", signed=True) if len(packed) >= 4 else None
        )
    return status_field(msg.fields.get("status"))


class ArraysEqual:
    """Equality by value for messages that carry arrays (numpy's ``==`` is elementwise)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]
