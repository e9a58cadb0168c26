"""The control and handshake messages: TABLE_REQ / TABLE (a peer's published caches),
PING / PONG, UNLINK / UNLINK_ACK, BYE; HELLO, CHALLENGE, a LINK_REQ's or successful LINK_ACK's
:class:`Identity`, and a :class:`LinkRefused`."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
from collections.abc import Mapping
from typing import Any, ClassVar

from .._enums import LLMStatusCode
from .._errors import ProtocolError
from .._protocol import MT, Message
from .fields import (
    U64_MAX,
    bad_field,
    bool_field,
    expect_type,
    int_field,
    opt_int_field,
    opt_str_field,
    reason_field,
    status_field,
    str_field,
)


# ====================================================================== control
@dataclasses.dataclass(frozen=True, slots=True)
class _Bare:
    """A frame with nothing in it (whatever a peer adds is ignored)."""

    TYPE: ClassVar[MT]

    def encode(self) -> Message:
        return Message(self.TYPE)

    @classmethod
    def decode(cls, msg: Message) -> Any:
        """Raises:
        ProtocolError: a frame of another type."""
        expect_type(msg, cls.TYPE)
        return cls()


@dataclasses.dataclass(frozen=True, slots=True)
class TableRequest(_Bare):
    """TABLE_REQ: send me your table."""

    TYPE: ClassVar[MT] = MT.TABLE_REQ


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(_Bare):
    TYPE: ClassVar[MT] = MT.PING


@dataclasses.dataclass(frozen=True, slots=True)
class Pong(_Bare):
    TYPE: ClassVar[MT] = MT.PONG


@dataclasses.dataclass(frozen=True, slots=True)
class Unlink(_Bare):
    """UNLINK: this side unlinks (the peer answers UNLINK_ACK, then forgets the link)."""

    TYPE: ClassVar[MT] = MT.UNLINK


@dataclasses.dataclass(frozen=True, slots=True)
class UnlinkAck(_Bare):
    TYPE: ClassVar[MT] = MT.UNLINK_ACK


@dataclasses.dataclass(frozen=True, slots=True)
class Bye(_Bare):
    """BYE: orderly close (finalize)."""

    TYPE: ClassVar[MT] = MT.BYE


@dataclasses.dataclass(frozen=True, slots=True)
class CacheInfo:
    """One cache of a peer's table: its tensors' addresses and layout."""

    cache_id: int
    addrs: tuple[int, ...]
    tensor_bytes: int
    count: int
    is_blocks: bool
    placement: int
    remote_accessible: bool
    #: a ``DataType`` value; None: the peer did not say (earlier releases)
    dtype: int | None = None
    #: device memory (the peer's CPU cannot address it): a push into it waits for its GRANT
    device: bool = False

    def encode(self) -> dict[str, Any]:
        out = {
            "cache_id": self.cache_id,
            "addrs": list(self.addrs),
            "tensor_bytes": self.tensor_bytes,
            "count": self.count,
            "is_blocks": self.is_blocks,
            "placement": self.placement,
            "remote_accessible": self.remote_accessible,
        }
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return {**out, "device": True} if self.device else out

    @classmethod
    def decode(cls, raw: Any) -> CacheInfo | None:
        """The entry, or None for a malformed one (it counts as nothing)."""
        try:
            addrs = raw["addrs"]
            if not isinstance(addrs, list):
                return None
            return cls(
                int_field(raw["cache_id"], "cache id"),
                tuple(int_field(a, "address", 0) for a in addrs),
                int_field(raw["tensor_bytes"], "tensor bytes", 0),
                int_field(raw["count"], "count", 0),
                bool_field(raw["is_blocks"], "is_blocks"),
                int_field(raw.get("placement", 0), "placement"),
                raw.get("remote_accessible") is True,
                opt_int_field(raw.get("dtype"), "data type", 0),
                raw.get("device") is True,
            )
        except (ProtocolError, KeyError, TypeError, AttributeError):
            return None


@dataclasses.dataclass(frozen=True, slots=True)
class Table:
    """TABLE: a peer's published caches, its blocks keys (model id -> cache id), its slot
    keys (``kind, id, model id, cache id, slot``), its epoch word (``base, value``: where
    one-sided readers check their view) and its NIXL or Mooncake entry."""

    caches: tuple[CacheInfo, ...] = ()
    blocks_keys: Mapping[str, int] = dataclasses.field(default_factory=dict)
    slot_keys: tuple[tuple[str, int, int, int, int], ...] = ()
    epoch: tuple[int, int] | None = None
    nixl: Mapping[str, Any] | None = None
    mooncake: Mapping[str, Any] | None = None

    def encode(self) -> Message:
        fields: dict[str, Any] = {
            "caches": [c.encode() for c in self.caches],
            "blocks_keys": dict(self.blocks_keys),
            "slot_keys": [list(k) for k in self.slot_keys],
        }
        if self.epoch is not None:
            fields["epoch"] = list(self.epoch)
        if self.nixl is not None:
            fields["nixl"] = dict(self.nixl)
        if self.mooncake is not None:
            fields["mooncake"] = dict(self.mooncake)
        return Message(MT.TABLE, 0, fields)

    @classmethod
    def decode(cls, msg: Message) -> Table:
        """Never raises for a TABLE: malformed entries count as nothing, a malformed epoch as
        none.

        Raises:
            ProtocolError: a frame of another type."""
        expect_type(msg, MT.TABLE)
        return cls.of(msg.fields)

    @classmethod
    def of(cls, f: Mapping[str, Any]) -> Table:
        """A TABLE's fields (a snapshot a link kept of them, or a side-channel proof's);
        never raises, as :meth:`decode`."""
        if not isinstance(f, Mapping):
            return cls()
        caches = f.get("caches")
        infos = tuple(
            i
            for i in (CacheInfo.decode(c) for c in (caches if isinstance(caches, list) else []))
            if i is not None
        )
        keys = f.get("blocks_keys")
        blocks_keys = (
            {k: v for k, v in keys.items() if type(v) is int} if isinstance(keys, dict) else {}
        )
        slot = f.get("slot_keys")
        slot_keys = tuple(
            (k[0], k[1], k[2], k[3], k[4])
            for k in (slot if isinstance(slot, list) else [])
            if isinstance(k, list)
            and len(k) == 5
            and isinstance(k[0], str)
            and all(type(v) is int for v in k[1:])
        )
        epoch = f.get("epoch")
        words: list[Any] = epoch if isinstance(epoch, list) else []
        valid = (
            len(words) == 2
            and all(type(v) is int for v in words)
            and 0 < words[0] <= U64_MAX
            and 0 <= words[1] <= U64_MAX
        )
        nixl = f.get("nixl")
        mooncake = f.get("mooncake")
        return cls(
            infos,
            blocks_keys,
            slot_keys,
            (words[0], words[1]) if valid else None,
            nixl if isinstance(nixl, dict) else None,
            mooncake if isinstance(mooncake, dict) else None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class NixlInfo:
    """A TABLE's NIXL entry (a peer of ``llm.Transport=nixl``, to a peer linked over NIXL):
    its agent's name, the generation of its metadata (None: unknown, so loaded again each
    time, as it always was), the metadata (base64, as on the wire: :meth:`metadata` decodes
    it) and each cache's memory type and device, by cache id as a string."""

    agent: str
    gen: int | None
    md: str
    mem: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The wire's dict (what ``NixlEndpoint.table_entry`` publishes)."""
        return {
            "agent": self.agent,
            "gen": self.gen,
            "md": self.md,
            "mem": {k: list(v) for k, v in self.mem.items()},
        }

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> NixlInfo | None:
        """A peer's :attr:`Table.nixl` (None: it published none).

        Raises:
            ProtocolError: a missing or malformed agent name or metadata, a generation that
                is not an integer, or a memory entry that is not ``[type, device]``."""
        if raw is None:
            return None
        mem = raw.get("mem")
        if mem is not None and not isinstance(mem, dict):
            raise bad_field("NIXL memory types", mem)
        typed: dict[str, tuple[str, int]] = {}
        for key, m in (mem or {}).items():
            if not isinstance(key, str) or not isinstance(m, list) or len(m) != 2:
                raise bad_field("NIXL memory type", m)
            typed[key] = (str_field(m[0], "NIXL memory type"), int_field(m[1], "NIXL device"))
        return cls(
            str_field(raw.get("agent"), "NIXL agent name"),
            opt_int_field(raw.get("gen"), "NIXL metadata generation"),
            str_field(raw.get("md"), "NIXL metadata"),
            typed,
        )

    def metadata(self) -> bytes:
        """The agent's metadata.

        Raises:
            ProtocolError: not base64."""
        try:
            return base64.b64decode(self.md, validate=True)
        except ValueError as exc:
            raise ProtocolError(f"bad NIXL metadata: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class MooncakeInfo:
    """A TABLE's Mooncake entry (a peer of ``llm.Transport=mooncake``, to a peer linked over
    Mooncake): its transfer engine's session (an address literal and the port of its
    handshake listener), the engine's instance (a random id: a new engine that took the name
    of one that is gone has another), the generation of its registrations and the caches
    registered with it."""

    session_host: str
    session_port: int
    gen: int
    caches: tuple[int, ...] = ()
    instance: int = 0

    @property
    def session(self) -> str:
        """Mooncake's name of the peer's engine (``host:port``; IPv6 hosts in brackets)."""
        host = f"[{self.session_host}]" if ":" in self.session_host else self.session_host
        return f"{host}:{self.session_port}"

    def fields(self) -> dict[str, Any]:
        """The wire's dict (what ``MooncakeEndpoint.table_entry`` publishes)."""
        return {
            "host": self.session_host,
            "port": self.session_port,
            "gen": self.gen,
            "caches": list(self.caches),
            "instance": self.instance,
        }

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> MooncakeInfo | None:
        """A peer's :attr:`Table.mooncake` (None: it published none).

        Raises:
            ProtocolError: a missing or malformed host, port, generation, cache list or
                instance."""
        if raw is None:
            return None
        caches = raw.get("caches")
        if not isinstance(caches, list):
            raise bad_field("Mooncake caches", caches)
        host = str_field(raw.get("host"), "Mooncake host")
        try:
            # An address literal, as llm.listenIpInfo is: compared with the link's address.
            ipaddress.ip_address(host)
        except ValueError:
            raise bad_field("Mooncake host", host) from None
        return cls(
            host,
            int_field(raw.get("port"), "Mooncake port", 1, 65535),
            int_field(raw.get("gen"), "Mooncake generation", 0),
            tuple(int_field(c, "Mooncake cache id", 0) for c in caches),
            int_field(raw.get("instance"), "Mooncake engine instance", 0),
        )


# ====================================================================== handshake
@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    """HELLO, client -> server: its protocol version and nonce."""

    nonce: str
    version: int

    def encode(self) -> Message:
        return Message(MT.HELLO, 0, {"version": self.version, "nonce": self.nonce})

    @staticmethod
    def version_of(msg: Message) -> Any:
        """The version a HELLO claims, as sent (anything, or None): read before the rest,
        which a peer of another version may spell otherwise."""
        return msg.fields.get("version")

    @classmethod
    def decode(cls, msg: Message) -> Hello:
        """Raises:
        ProtocolError: a missing or malformed version or nonce (the version itself is the
            server's to judge)."""
        expect_type(msg, MT.HELLO)
        f = msg.fields
        return cls(
            str_field(f.get("nonce"), "nonce"), int_field(f.get("version"), "protocol version")
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Challenge:
    """CHALLENGE, server -> client: its nonce and whether the link is keyed."""

    nonce: str
    auth: bool

    def encode(self) -> Message:
        return Message(MT.CHALLENGE, 0, {"nonce": self.nonce, "auth": self.auth})

    @classmethod
    def decode(cls, msg: Message) -> Challenge:
        """Raises:
        ProtocolError: a missing or malformed field."""
        expect_type(msg, MT.CHALLENGE)
        f = msg.fields
        return cls(str_field(f.get("nonce"), "nonce"), bool_field(f.get("auth"), "auth flag"))


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """Where an endpoint says it runs (its identity's ``host``): what two processes compare to
    know they may share a kernel, pid and network namespace. A hint only (a peer may lie):
    proof comes from the side channel. A part a peer leaves out is None."""

    hostname: str | None = None
    boot_id: str | None = None
    pidns: int | None = None
    netns: int | None = None

    def fields(self) -> dict[str, Any]:
        """The wire's dict (a part that is None is left out, as a peer that never sent it)."""
        out: dict[str, Any] = {
            "hostname": self.hostname,
            "boot_id": self.boot_id,
            "pidns": self.pidns,
            "netns": self.netns,
        }
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def of(cls, raw: Any) -> Host | None:
        """A peer's ``host`` (None or absent: none; unknown keys are ignored).

        Raises:
            ProtocolError: not a dict, or a part of the wrong type."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise bad_field("host", raw)
        return cls(
            opt_str_field(raw.get("hostname"), "host name"),
            opt_str_field(raw.get("boot_id"), "boot id"),
            opt_int_field(raw.get("pidns"), "pid namespace"),
            opt_int_field(raw.get("netns"), "network namespace"),
        )

    def shares(self, other: Host | None) -> bool:
        """True if ``other`` claims this kernel (a boot id, the same one) and namespaces."""
        return (
            other is not None
            and bool(self.boot_id)
            and self.boot_id == other.boot_id
            and self.pidns == other.pidns
            and self.netns == other.netns
        )

    def difference(self, other: Host | None) -> str:
        """What keeps ``other`` from sharing this host, in words (for errors and logs)."""
        if other is None or not other.boot_id:
            return "it did not say where it runs"
        if not self.boot_id or self.boot_id != other.boot_id:
            return f"it runs on another host ({other.hostname or 'unnamed'})"
        if self.netns != other.netns:
            return "it runs in another network namespace of this host"
        if self.pidns != other.pidns:
            return "it runs in another pid namespace of this host"
        return "it shares this host"


def _bool_or_false(f: Mapping[str, Any], name: str) -> bool:
    # absent is False, as it always read (a peer from before llm.PayloadAuth sends no
    # ``payload_auth``); present, it must be a boolean
    return False if name not in f else bool_field(f[name], name)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """What an endpoint tells a peer about itself in the handshake (a LINK_REQ's fields, and
    a successful LINK_ACK's): nothing about its memory. ``mac``: the transcript's tag on a
    keyed link (added after the transcript took the frame).

    Read as the handshake always read it, so that a peer of the last release (and older ones
    of protocol 1) still links: ``remote_accessible`` and ``payload_auth`` left out are
    False, ``role``, ``host``, ``transport`` and ``uds`` left out are None (``host`` and
    ``uds`` may also be null, as the last release sends them); a field there of another type
    is a :class:`ProtocolError`. ``role`` and ``transport`` None are left out again."""

    cluster_id: int
    role: int | None
    remote_accessible: bool
    payload_auth: bool
    host: Host | None
    transport: str | None
    uds: str | None
    mac: str | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster_id": self.cluster_id,
            "role": self.role,
            "remote_accessible": self.remote_accessible,
            "payload_auth": self.payload_auth,
            "host": None if self.host is None else self.host.fields(),
            "transport": self.transport,
            "uds": self.uds,
        }
        for absent in ("role", "transport"):  # as a peer that never sent them
            if out[absent] is None:
                del out[absent]
        if self.mac is not None:
            out["mac"] = self.mac
        return out

    def encode(self, mtype: MT = MT.LINK_REQ) -> Message:
        """A LINK_REQ, or with ``mtype`` = LINK_ACK the successful answer (status 0 first)."""
        fields = self.fields()
        return Message(mtype, 0, {"status": 0, **fields} if mtype == MT.LINK_ACK else fields)

    @classmethod
    def decode(cls, msg: Message) -> Identity:
        """A LINK_REQ, or a LINK_ACK that says yes (unknown fields are ignored).

        Raises:
            ProtocolError: a missing or malformed cluster id (outside u64 included), a
                malformed field, or a LINK_ACK that says no (read it with
                :class:`LinkRefused`)."""
        if msg.type not in (MT.LINK_REQ, MT.LINK_ACK):
            raise ProtocolError(f"expected LINK_REQ or LINK_ACK, got {msg.type.name}")
        f = msg.fields
        if msg.type == MT.LINK_ACK and status_field(f.get("status")) != LLMStatusCode.LLM_SUCCESS:
            raise ProtocolError("a refusal is no identity")
        return cls(
            int_field(f.get("cluster_id"), "cluster id", 0),
            int_field(f["role"], "role") if "role" in f else None,
            _bool_or_false(f, "remote_accessible"),
            _bool_or_false(f, "payload_auth"),
            Host.of(f.get("host")),
            str_field(f["transport"], "transport") if "transport" in f else None,
            opt_str_field(f.get("uds"), "uds"),
            opt_str_field(f.get("mac"), "mac"),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LinkRefused:
    """A LINK_ACK that says no: the status and, told to a client that proved the key, why,
    who refused and whether it yielded to a simultaneous link."""

    status: LLMStatusCode
    message: str | None = None
    cluster_id: int | None = None
    yielded: bool = False

    def encode(self) -> Message:
        fields: dict[str, Any] = {"status": int(self.status)}
        if self.message is not None:
            fields["message"] = self.message
        if self.cluster_id is not None:
            fields["cluster_id"] = self.cluster_id
        if self.yielded:
            fields["yield"] = True
        return Message(MT.LINK_ACK, 0, fields)

    @classmethod
    def decode(cls, msg: Message) -> LinkRefused:
        """Never raises for a LINK_ACK (a reason is kept, bounded to MAX_REASON).

        Raises:
            ProtocolError: a frame of another type."""
        expect_type(msg, MT.LINK_ACK)
        f = msg.fields
        cid = f.get("cluster_id")
        return cls(
            status_field(f.get("status")),
            reason_field(f.get("message")),
            cid if type(cid) is int else None,
            f.get("yield") is True,
        )
