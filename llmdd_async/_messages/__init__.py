"""What the frames of a link mean: typed messages above the sans-IO framer of
:mod:`llmdd_async._protocol`.

h11-style: each frame a link exchanges is a frozen dataclass with ONE ``encode`` (to the
framer's :class:`~llmdd_async._protocol.Message`, giving the very bytes the wire always
carried) and ONE ``decode`` that checks every field the frame may carry and raises
:class:`ProtocolError` there and nowhere else. Unknown fields are ignored (a peer may add
some); vocabularies are enums (:class:`Op`, :class:`Shape`, :class:`Mode`, :class:`By`,
:class:`Cap`), whose values are the wire's strings. ``fields`` holds the vocabularies and the
field readers, ``transfer`` the request's messages, ``control`` the rest.

A peer's ``status`` is read leniently everywhere (missing, malformed or unknown is
LLM_FAILED: the safest answer), and so is a reason it gives (bounded, made a string), as they
always were; a peer's published table too (malformed entries count as nothing).

* transfer: :class:`Request` (XFER_REQ, naming the target's cache by an :class:`Address`:
  ``address``), :class:`Grant`, :class:`Data`, :class:`Done`,
  :class:`Result`, :class:`Abort`;
* control: :class:`TableRequest`, :class:`Table` (with its :class:`NixlInfo` or
  :class:`MooncakeInfo`), :class:`Ping`, :class:`Pong`, :class:`Unlink`, :class:`UnlinkAck`,
  :class:`Bye`;
* side channel: :class:`Prove`, :class:`ProveAck`, :class:`ProveFin` (with a :class:`Proof`);
* handshake: :class:`Hello`, :class:`Challenge`, :class:`Identity` (a LINK_REQ's fields, and a
  successful LINK_ACK's, with its :class:`Host`), :class:`LinkRefused` (a LINK_ACK that says
  no);
* regions: what a peer's table publishes as reachable memory (:func:`regions_of`, sorted
  and disjoint), and :class:`TableSnapshot`, a table with all a link derives from it.
"""

from __future__ import annotations

from .control import (
    Bye,
    CacheInfo,
    Challenge,
    Hello,
    Host,
    Identity,
    LinkRefused,
    MooncakeInfo,
    NixlInfo,
    Ping,
    Pong,
    Table,
    TableRequest,
    Unlink,
    UnlinkAck,
)
from .fields import (
    FLAG_EAGER,
    FLAG_TO_INITIATOR,
    MAX_REASON,
    By,
    Cap,
    Mode,
    Op,
    Shape,
    caps_of,
    wire_status,
)
from .regions import TableSnapshot, no_regions, regions_of
from .side_channel import Proof, Prove, ProveAck, ProveFin, tcp_binding_of
from .transfer import Abort, Address, Data, Done, Grant, Request, Result

__all__ = [
    "Abort",
    "Address",
    "By",
    "Bye",
    "CacheInfo",
    "Cap",
    "Challenge",
    "Data",
    "Done",
    "FLAG_EAGER",
    "FLAG_TO_INITIATOR",
    "Grant",
    "Hello",
    "Host",
    "Identity",
    "LinkRefused",
    "MAX_REASON",
    "Mode",
    "MooncakeInfo",
    "NixlInfo",
    "Op",
    "Ping",
    "Pong",
    "Proof",
    "Prove",
    "ProveAck",
    "ProveFin",
    "Request",
    "Result",
    "Shape",
    "Table",
    "TableRequest",
    "TableSnapshot",
    "Unlink",
    "UnlinkAck",
    "caps_of",
    "no_regions",
    "regions_of",
    "tcp_binding_of",
    "wire_status",
]
