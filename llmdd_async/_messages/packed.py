"""The packed forms of the hot messages (``_protocol.PACKED``): fixed little-endian structs.

JSON costs several microseconds per frame on each end. Enums go as their index in declaration
order (new words go last), caps as bits in CAPS_ORDER. A value that does not fit (an integer
outside int64) makes the message go as JSON; a decoder reads both forms. Every packed form
with a status (GRANT, DONE, RESULT) starts with it, an int32.
"""

from __future__ import annotations

import struct
from typing import Any

from .._errors import ProtocolError
from .._protocol import Message
from .fields import CAPS_ORDER, By, Cap, Mode, Op, Shape, bad_field

OPS: tuple[Op, ...] = tuple(Op)
SHAPES: tuple[Shape, ...] = tuple(Shape)
BYS: tuple[By, ...] = tuple(By)
MODES: tuple[Mode, ...] = tuple(Mode)
CAP_BIT: dict[Cap, int] = {c: 1 << i for i, c in enumerate(CAPS_ORDER)}
#: XFER_REQ: op, shape, by, which optional fields are present, caps; then 22 integers (see
#: ``Request._packed``)
REQ = struct.Struct("<BBBBH22q")
HAS_SRC_RANGE, HAS_DST_RANGE, HAS_DST_BB, HAS_RAW, HAS_DTYPE, BLOCKS, RAW_BLOCKS, HAS_EAGER = (
    1 << i for i in range(8)
)
#: GRANT: status, which optional fields are present, mode, total
GRANT = struct.Struct("<iBBq")
HAS_MODE, HAS_TOTAL, NO_DONE = 1, 2, 4
#: DONE / RESULT: status
STATUS = struct.Struct("<i")
#: DATA: offset
OFF = struct.Struct("<Q")


def index(words: tuple[Any, ...], i: int, what: str) -> Any:
    if i >= len(words):
        raise bad_field(what, i)
    return words[i]


def unpack(layout: struct.Struct, msg: Message) -> tuple[Any, ...]:
    try:
        return layout.unpack(msg.packed or b"")
    except struct.error:
        raise ProtocolError(f"packed {msg.type.name} of {len(msg.packed or b'')} bytes") from None


def caps_of_bits(bits: int) -> frozenset[Cap]:
    """The caps whose bits are set (unknown bits: not claimed)."""
    return frozenset(c for c, bit in CAP_BIT.items() if bits & bit) if bits else frozenset()
