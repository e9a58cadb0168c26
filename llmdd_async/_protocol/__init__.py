"""The wire protocol, sans-IO: bytes in, events out. No sockets, no anyio, no numpy.

Every frame starts with a fixed 32-byte little-endian header::

    magic u32 | version u16 | type u16 | req_id u64 | meta_len u32 | flags u32 | payload_len u64

``meta`` follows: a u32 length-prefixed UTF-8 JSON object of scalar fields, then the raw bytes
of the arrays it names (``"arrays": [[name, nbytes], ...]``; arrays hold little-endian u64 or
i64 integers, so their sizes are multiples of 8). The hot messages (XFER_REQ, GRANT, DATA,
DONE, RESULT) are *packed* instead: the length prefix has its top bit (:data:`PACKED`) set
and counts a fixed little-endian struct that the message type defines (``_messages``), then
come one u32 byte count per array the type may carry (:data:`PACKED_ARRAYS`, in that order;
``0xFFFFFFFF``: absent) and the arrays. ``payload_len`` bytes of bulk data follow
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

from .decoder import UNCHARGED_META, Decoder, MetaBudget
from .frames import (
    HEADER,
    MAGIC,
    MAX_FIELDS,
    MAX_META,
    MT,
    NEED_DATA,
    PACKED,
    PACKED_ARRAYS,
    PAYLOAD_TAG,
    PROTOCOL_VERSION,
    FrameAuth,
    Framed,
    Message,
    PayloadBytes,
    encode,
    encode_data,
    encode_packed,
)

__all__ = [
    "Decoder",
    "FrameAuth",
    "Framed",
    "HEADER",
    "MAGIC",
    "MAX_FIELDS",
    "MAX_META",
    "MT",
    "Message",
    "MetaBudget",
    "NEED_DATA",
    "PACKED",
    "PACKED_ARRAYS",
    "PAYLOAD_TAG",
    "PROTOCOL_VERSION",
    "PayloadBytes",
    "UNCHARGED_META",
    "encode",
    "encode_data",
    "encode_packed",
]
