"""The same-host side channel's messages: PROVE (server -> client: which TCP handshake it
means), PROVE_ACK (the client's answer, with what it lets the server reach) and PROVE_FIN (what
the server lets the client reach), the latter two carrying a :class:`Proof`.

The side channel was lenient where it mattered and is still: a MAC that is not a string is no
MAC (a keyed link refuses it, an unkeyed one never looks), a refusal is any status but 0, and
a proof's malformed parts count as nothing (pools refused, no probe, an entry of its table
dropped), as the transport registry always read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._protocol import MT, Message
from .control import CacheInfo
from .fields import U64_MAX, bad_field, expect_type, int_field, str_field
from .regions import first_entries, regions_of

#: ``[[ip, port], [ip, port]]`` of a TCP connection (``local_peer.tcp_binding``), typed
TcpBinding = tuple[tuple[str, int], tuple[str, int]]


def tcp_binding_of(value: Any) -> TcpBinding:
    """The typed form of ``[[ip, port], [ip, port]]`` (what ``tcp_binding`` returns and a PROVE
    carries).

    Raises:
        ProtocolError: anything else."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise bad_field("TCP binding", value)
    ends = []
    for end in value:
        if not isinstance(end, list | tuple) or len(end) != 2:
            raise bad_field("TCP binding", value)
        ends.append((str_field(end[0], "TCP address"), int_field(end[1], "TCP port", 0, 65535)))
    return ends[0], ends[1]


def _lenient_mac(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True, slots=True)
class Prove:
    """PROVE, server -> client: the handshake's nonces and the TCP connection's two addresses
    as the server sees them, with a MAC under the link's side-channel key when keyed."""

    nonces: tuple[str, str]
    tcp: TcpBinding
    mac: str | None = None

    def encode(self) -> Message:
        fields: dict[str, Any] = {
            "nonces": list(self.nonces),
            "tcp": [list(end) for end in self.tcp],
        }
        if self.mac is not None:
            fields["mac"] = self.mac
        return Message(MT.PROVE, 0, fields)

    @classmethod
    def decode(cls, msg: Message) -> Prove:
        """Raises:
        ProtocolError: a frame of another type, nonces that are not two strings, or a
            malformed TCP binding (a MAC that is not a string is read as none)."""
        expect_type(msg, MT.PROVE)
        f = msg.fields
        nonces = f.get("nonces")
        if not isinstance(nonces, list) or len(nonces) != 2:
            raise bad_field("nonces", nonces)
        return cls(
            (str_field(nonces[0], "nonce"), str_field(nonces[1], "nonce")),
            tcp_binding_of(f.get("tcp")),
            _lenient_mac(f.get("mac")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Proof:
    """What a proven same-host peer lets the other reach: its pools (``base, size``; the
    descriptors travel beside the message, same order), its probe (``address, hex bytes``,
    read with process_vm_readv) and its reachable caches (its table's entries).

    Decoded leniently: ``pools`` None is a malformed claim (refused), ``probe`` None none
    usable, a malformed cache entry counts as nothing."""

    pools: tuple[tuple[int, int], ...] | None = ()
    probe: tuple[int, str] | None = None
    caches: tuple[CacheInfo, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {
            "pools": [list(p) for p in self.pools or ()],
            "probe": None if self.probe is None else list(self.probe),
            "caches": [c.encode() for c in self.caches],
        }

    @classmethod
    def of(cls, f: Any) -> Proof:
        """Never raises (see the class)."""
        if not isinstance(f, dict):
            return cls()
        claimed = f.get("pools")
        pools: tuple[tuple[int, int], ...] | None = ()
        if isinstance(claimed, list):
            if all(
                isinstance(p, list)
                and len(p) == 2
                and all(type(v) is int and 0 <= v <= U64_MAX for v in p)
                for p in claimed
            ):
                pools = tuple((p[0], p[1]) for p in claimed)
            else:
                pools = None
        elif claimed:  # something that is not a list of pools
            pools = None
        probe = f.get("probe")
        typed_probe = (
            (probe[0], probe[1])
            if isinstance(probe, list)
            and len(probe) == 2
            and type(probe[0]) is int
            and 0 <= probe[0] <= U64_MAX  # an address: numpy refuses others with OverflowError
            and isinstance(probe[1], str)
            else None
        )
        caches = f.get("caches")
        infos = tuple(
            i
            for i in (CacheInfo.decode(c) for c in (caches if isinstance(caches, list) else []))
            if i is not None
        )
        return cls(pools, typed_probe, infos)

    def regions(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted ``(starts, ends)`` of the tensors of its remote-accessible caches, an id's
        first entry only (as :class:`TableSnapshot` reads a table)."""
        return regions_of(first_entries(self.caches).values())


@dataclasses.dataclass(frozen=True, slots=True)
class ProveAck:
    """PROVE_ACK, client -> server: ``ok`` (status 0; any other is a refusal, sent as 1) and,
    when ok, the client's :class:`Proof` and, on a keyed link, its MAC."""

    ok: bool
    proof: Proof | None = None
    mac: str | None = None

    def encode(self) -> Message:
        if not self.ok:
            return Message(MT.PROVE_ACK, 0, {"status": 1})
        fields: dict[str, Any] = {"status": 0, **(self.proof or Proof()).fields()}
        if self.mac is not None:
            fields["mac"] = self.mac
        return Message(MT.PROVE_ACK, 0, fields)

    @classmethod
    def decode(cls, msg: Message) -> ProveAck:
        """Never raises for a PROVE_ACK (a refusal carries nothing; see :class:`Proof`).

        Raises:
            ProtocolError: a frame of another type."""
        expect_type(msg, MT.PROVE_ACK)
        f = msg.fields
        status = f.get("status")
        if type(status) is not int or status != 0:
            return cls(False)
        return cls(True, Proof.of(f), _lenient_mac(f.get("mac")))


@dataclasses.dataclass(frozen=True, slots=True)
class ProveFin:
    """PROVE_FIN, server -> client: the server's :class:`Proof`, or None (sent empty) when the
    client is not a process it may describe anything to."""

    proof: Proof | None = None

    def encode(self) -> Message:
        return Message(MT.PROVE_FIN, 0, {} if self.proof is None else self.proof.fields())

    @classmethod
    def decode(cls, msg: Message) -> ProveFin:
        """Never raises for a PROVE_FIN (see :class:`Proof`; an empty one is None).

        Raises:
            ProtocolError: a frame of another type."""
        expect_type(msg, MT.PROVE_FIN)
        return cls(Proof.of(msg.fields) if msg.fields else None)
