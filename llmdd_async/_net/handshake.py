"""Link setup: connect / accept, then the handshake (version, identity, optional HMAC auth).

::

    client                                   server
    HELLO {version, nonce_c}          ->
                                      <-     CHALLENGE {nonce_s, auth}
    LINK_REQ {identity, mac_c}        ->     (checks mac_c; on failure: LINK_ACK{LINK_FAILED})
                                             (same host: proves both pids on the side channel)
                                      <-     LINK_ACK {status, identity, mac_s}

With ``llm.AuthKey`` the MACs cover the whole transcript (every field of every frame so far,
identities, roles, cluster ids and the side-channel name included), and both sides derive a
per-link key from it: every later frame of the link carries a tag under that key (see
``_protocol.FrameAuth``). A peer that fails authentication only ever sees ``LLM_LINK_FAILED``:
the server says nothing about itself before the client proved it knows the key. With a key
configured, a side also refuses a peer that does not ask for authentication (so nobody is
downgraded silently).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._enums import LLMStatusCode
from .._errors import HandshakeFailed, ProtocolError
from .._messages import Challenge, Hello, Identity, LinkRefused
from .._protocol import (
    MT,
    NEED_DATA,
    PROTOCOL_VERSION,
    Decoder,
    FrameAuth,
    Message,
    encode,
)
from .host import LinkHost

__all__ = [
    "Binding",
    "LinkAuth",
    "client_handshake",
    "connect_socket",
    "new_nonce",
    "recv_message",
    "send_message",
    "server_handshake",
]

#: the largest handshake frame either side reads from a peer that has not authenticated yet
#: (legit ones are under 2 KB: identities, nonces, MACs); more closes the connection
_HANDSHAKE_META = 64 << 10
#: (send, receive) frame authenticators of a keyed link
LinkAuth = tuple[FrameAuth, FrameAuth]


def new_nonce() -> str:
    """A fresh handshake nonce (also what settles two simultaneous links: the lower wins)."""
    return os.urandom(16).hex()


class Binding:
    """What ties a side channel to one TCP handshake: its nonces, its socket and, on a keyed
    link, the side-channel key both sides derived from the transcript (their side-channel
    messages carry MACs under it: a relay without ``llm.AuthKey`` cannot take part)."""

    def __init__(
        self, nonce_c: str, nonce_s: str, sock: socket.socket, side_key: bytes | None = None
    ) -> None:
        self.nonces = (nonce_c, nonce_s)
        self.sock = sock
        self.side_key = side_key


async def send_message(sock: socket.socket, msg: Message) -> None:
    """Send one frame on a non-blocking socket. Raises OSError."""
    data = memoryview(encode(msg))
    while data:
        try:
            n = sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        data = data[n:]


async def recv_message(sock: socket.socket, decoder: Decoder, expect: MT) -> Message:
    """The next frame, which must be an ``expect`` without payload.

    Raises:
        ProtocolError: anything else. EOFError / OSError: the connection failed.
    """
    buf = bytearray(4096)
    while True:
        ev = decoder.next_event()
        if isinstance(ev, Message):
            if ev.type != expect or ev.payload_len:
                raise ProtocolError(f"expected {expect.name}, got {ev.type.name}")
            return ev
        if ev is not NEED_DATA:
            raise ProtocolError("payload during the handshake")
        try:
            n = sock.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if n == 0:
            raise EOFError("peer closed the connection during the handshake")
        decoder.receive_data(memoryview(buf)[:n])


async def connect_socket(host: str, port: int) -> socket.socket:
    """Non-blocking TCP connect to ``host`` (an IPv4 or IPv6 address, or a name resolved here,
    once, trying its addresses in the resolver's order); the caller bounds it with a timeout.

    Raises:
        OSError: the name did not resolve, or every connection was refused or failed.
    """
    try:
        literal = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        try:
            infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise OSError(f"cannot resolve {host!r}: {exc.strerror or exc}") from None
        found: list[tuple[int, tuple[Any, ...]]] = [
            (family, address) for family, _, _, _, address in infos
        ]
    else:  # no resolver, no thread: a literal is its own address
        if literal.version == 4:
            found = [(socket.AF_INET, (host, port))]
        else:
            found = [(socket.AF_INET6, (host, port, 0, 0))]
    last: OSError | None = None
    for family, address in found:
        try:
            return await _connect(family, address, host, port)
        except OSError as exc:
            last = exc
    raise last or OSError(f"{host!r} resolved to no address")


async def _connect(family: int, address: tuple[Any, ...], host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock.setblocking(False)
        err = sock.connect_ex(address)
        if err not in (0, 115, 36):  # EINPROGRESS on Linux / macOS
            raise OSError(err, f"connect to {where} failed")
        if err:
            await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, f"connect to {where} failed")
        return sock
    except BaseException:
        sock.close()
        raise


class _Transcript:
    """Running hash of every handshake frame's fields (the MAC fields left out)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, msg: Message) -> None:
        fields = {k: v for k, v in msg.fields.items() if k != "mac"}
        self._h.update(int(msg.type).to_bytes(2, "little"))
        self._h.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())

    def mac(self, key: bytes, who: bytes) -> str:
        return hmac.new(key, who + b"|" + self._h.digest(), hashlib.sha256).hexdigest()

    def side_key(self, key: bytes | None) -> bytes | None:
        """The side-channel key of a keyed link (None without ``llm.AuthKey``): known to both
        sides once LINK_REQ is in the transcript, before the server proves itself."""
        if key is None:
            return None
        return hmac.new(key, b"side|" + self._h.digest(), hashlib.sha256).digest()

    def link_auth(self, key: bytes, client: bool) -> LinkAuth:
        link_key = hmac.new(key, b"link|" + self._h.digest(), hashlib.sha256).digest()
        c2s = FrameAuth(hmac.new(link_key, b"c2s", hashlib.sha256).digest())
        s2c = FrameAuth(hmac.new(link_key, b"s2c", hashlib.sha256).digest())
        return (c2s, s2c) if client else (s2c, c2s)


def _mac_ok(expected: str, got: Any) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got, expected)


async def client_handshake(
    engine: LinkHost,
    sock: socket.socket,
    expected_cluster_id: int,
    nonce_c: str,
    on_binding: Callable[[Binding], None] | None = None,
) -> tuple[Decoder, Identity, LinkAuth | None]:
    """Run the client side; returns the decoder (it may hold read-ahead), the peer's identity
    and, on a keyed link, the frame authenticators. ``nonce_c`` (from :func:`new_nonce`) is
    known before connecting, to settle simultaneous links. ``on_binding`` is told the handshake's
    binding before the server may prove itself on the side channel.

    Raises:
        HandshakeFailed: with the code link_clusters reports.
        ProtocolError: a malformed frame (a LINK_ACK's identity included).
        OSError / EOFError: the connection failed.
    """
    key = engine.options.auth_key
    decoder = Decoder(_HANDSHAKE_META)
    transcript = _Transcript()
    hello = Hello(nonce_c, PROTOCOL_VERSION).encode()
    transcript.add(hello)
    await send_message(sock, hello)
    ch = await recv_message(sock, decoder, MT.CHALLENGE)
    transcript.add(ch)
    challenge = Challenge.decode(ch)
    nonce_s = challenge.nonce
    if challenge.auth != (key is not None):
        raise HandshakeFailed("authentication settings differ (llm.AuthKey set on one side only)")
    req = Message(MT.LINK_REQ, 0, dict(engine.identity_for_link()))
    transcript.add(req)
    if key is not None:
        req.fields["mac"] = transcript.mac(key, b"client")
    if on_binding is not None:
        on_binding(Binding(nonce_c, nonce_s, sock, transcript.side_key(key)))
    await send_message(sock, req)
    ack = await recv_message(sock, decoder, MT.LINK_ACK)
    answer = LinkRefused.decode(ack)  # its status, and who refused and why if it says no
    if answer.cluster_id is not None and answer.cluster_id != expected_cluster_id:
        raise HandshakeFailed(
            f"the endpoint there is cluster {answer.cluster_id}, not {expected_cluster_id}"
        )
    if answer.status != LLMStatusCode.LLM_SUCCESS:
        raise HandshakeFailed(
            "refused by peer" if answer.message is None else answer.message,
            status_code=answer.status,
            yielded=answer.yielded,
        )
    transcript.add(ack)
    peer = Identity.decode(ack)  # a malformed field: ProtocolError
    if key is not None and not _mac_ok(transcript.mac(key, b"server"), peer.mac):
        raise HandshakeFailed("the peer failed authentication")
    if peer.cluster_id != expected_cluster_id:
        raise HandshakeFailed(
            f"the endpoint there is cluster {peer.cluster_id}, not {expected_cluster_id}"
        )
    return decoder, peer, transcript.link_auth(key, client=True) if key is not None else None


async def server_handshake(
    engine: LinkHost,
    sock: socket.socket,
    prepare: Callable[[Identity, Binding], Awaitable[Any]],
    on_hello: Callable[[], None] | None = None,
) -> tuple[Decoder, Identity, Any, LinkAuth | None]:
    """Run the server side; returns the decoder, the peer's identity, what ``prepare`` made of
    it (awaited before the client is told yes, so a refusal reaches the client; called only
    for a client that proved the key, if there is one) and, on a keyed link, the frame
    authenticators. ``on_hello`` is told once a valid HELLO came in.

    Raises:
        HandshakeFailed: the client was refused (it has been told so; a malformed LINK_REQ
            too, with why only where no key is configured: it cannot prove one).
        ProtocolError: another protocol version, a malformed HELLO, or a malformed frame.
        OSError / EOFError: the connection failed.
    """
    key = engine.options.auth_key
    decoder = Decoder(_HANDSHAKE_META)
    transcript = _Transcript()
    hello = await recv_message(sock, decoder, MT.HELLO)
    version = Hello.version_of(hello)  # checked first: another version may differ in all else
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"client speaks protocol {version}, this endpoint {PROTOCOL_VERSION} (both sides "
            "must run releases of the same wire version)"
        )
    transcript.add(hello)
    if on_hello is not None:
        on_hello()
    nonce_c = Hello.decode(hello).nonce
    nonce_s = new_nonce()
    ch = Challenge(nonce_s, key is not None).encode()
    transcript.add(ch)
    await send_message(sock, ch)
    req = await recv_message(sock, decoder, MT.LINK_REQ)
    transcript.add(req)

    async def refuse(
        code: LLMStatusCode, message: str, tell: bool, yielded: bool = False
    ) -> HandshakeFailed:
        if tell:  # the client proved the key, if there is one
            answer = LinkRefused(code, message, engine.cluster_id, yielded)
        else:
            answer = LinkRefused(code)
        await send_message(sock, answer.encode())
        return HandshakeFailed(message, status_code=code)

    try:
        peer = Identity.decode(req)  # what the last release sends reads as it always did
    except ProtocolError as exc:
        # Told why only without a key: a malformed request proves none.
        code = LLMStatusCode.LLM_PARAM_INVALID if key is None else LLMStatusCode.LLM_LINK_FAILED
        raise await refuse(code, f"malformed LINK_REQ: {exc}", key is None) from None
    if key is not None and not _mac_ok(transcript.mac(key, b"client"), peer.mac):
        raise await refuse(LLMStatusCode.LLM_LINK_FAILED, "client failed authentication", False)
    cid = peer.cluster_id
    if cid == engine.cluster_id and engine.options.cache_manager:
        raise await refuse(
            LLMStatusCode.LLM_PARAM_INVALID, f"cluster id {cid} is this endpoint's own id", True
        )
    if peer.remote_accessible != engine.options.remote_accessible:
        raise await refuse(
            LLMStatusCode.LLM_PARAM_INVALID,
            "llm.EnableRemoteCacheAccessible differs between the two endpoints",
            True,
        )
    if peer.payload_auth != engine.options.payload_auth:
        raise await refuse(
            LLMStatusCode.LLM_PARAM_INVALID,
            "llm.PayloadAuth differs between the two endpoints",
            True,
        )
    try:
        prepared = await prepare(peer, Binding(nonce_c, nonce_s, sock, transcript.side_key(key)))
    except HandshakeFailed as exc:
        raise await refuse(exc.status_code, str(exc), True, exc.yielded) from None
    ack = Message(MT.LINK_ACK, 0, {"status": 0, **engine.identity_for_link()})
    transcript.add(ack)
    if key is not None:
        ack.fields["mac"] = transcript.mac(key, b"server")
    await send_message(sock, ack)
    return decoder, peer, prepared, transcript.link_auth(key, False) if key is not None else None
