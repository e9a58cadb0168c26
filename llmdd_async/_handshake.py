"""Link setup: connect / accept, then the handshake (version, identity, optional HMAC auth).

::

    client                                   server
    HELLO {version, nonce_c}          ->
                                      <-     CHALLENGE {nonce_s, auth}
    LINK_REQ {mac_c, identity}        ->     (checks mac_c; on failure: LINK_ACK{LINK_FAILED})
                                      <-     LINK_ACK {status, mac_s, identity}

A peer that fails authentication only ever sees ``LLM_LINK_FAILED``: the server says nothing
about itself before the client proved it knows the key. With a key configured, a side also
refuses a peer that does not ask for authentication (so nobody is downgraded silently).
"""

from __future__ import annotations

import hmac
import socket
from collections.abc import Callable
from typing import Any

import anyio

from ._enums import LLMStatusCode
from ._link import auth_mac, new_nonce, wire_status
from ._protocol import MT, NEED_DATA, PROTOCOL_VERSION, Decoder, Message, ProtocolError, encode

__all__ = ["HandshakeFailed", "client_handshake", "connect_socket", "server_handshake"]

_HANDSHAKE_META = 1 << 20


class HandshakeFailed(Exception):
    """The link could not be set up; ``code`` is what link_clusters reports."""

    def __init__(self, message: str, code: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED):
        super().__init__(message)
        self.code = code


async def _send(sock: socket.socket, msg: Message) -> None:
    data = memoryview(encode(msg))
    while data:
        try:
            n = sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        data = data[n:]


async def _recv(sock: socket.socket, decoder: Decoder, expect: MT) -> Message:
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


async def connect_socket(ip: str, port: int) -> socket.socket:
    """Non-blocking TCP connect (the caller bounds it with a timeout).

    Raises:
        OSError: the connection was refused or failed.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        err = sock.connect_ex((ip, port))
        if err not in (0, 115, 36):  # EINPROGRESS on Linux / macOS
            raise OSError(err, f"connect to {ip}:{port} failed")
        if err:
            await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, f"connect to {ip}:{port} failed")
        return sock
    except BaseException:
        sock.close()
        raise


def _check_mac(key: bytes | None, role: bytes, got: Any, *parts: str) -> bool:
    if key is None:
        return True
    return isinstance(got, str) and hmac.compare_digest(got, auth_mac(key, role, *parts))


async def client_handshake(
    engine: Any, sock: socket.socket, expected_cluster_id: int
) -> tuple[Decoder, dict[str, Any]]:
    """Run the client side; returns the decoder (it may hold read-ahead) and the peer identity.

    Raises:
        HandshakeFailed: with the code link_clusters reports.
        OSError / EOFError / ProtocolError: the connection failed.
    """
    key = engine.options.auth_key
    decoder = Decoder(_HANDSHAKE_META)
    nonce_c = new_nonce()
    await _send(sock, Message(MT.HELLO, 0, {"version": PROTOCOL_VERSION, "nonce": nonce_c}))
    ch = await _recv(sock, decoder, MT.CHALLENGE)
    nonce_s = str(ch.fields.get("nonce", ""))
    if bool(ch.fields.get("auth")) != (key is not None):
        raise HandshakeFailed("authentication settings differ (llm.AuthKey set on one side only)")
    me = engine.identity_for_link()
    mac_c = auth_mac(key, b"client", nonce_c, nonce_s, str(engine.cluster_id)) if key else None
    await _send(sock, Message(MT.LINK_REQ, 0, {"mac": mac_c, **me}))
    ack = await _recv(sock, decoder, MT.LINK_ACK)
    status = wire_status(ack)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise HandshakeFailed(str(ack.fields.get("message", "refused by peer")), status)
    peer = ack.fields
    if not _check_mac(
        key, b"server", peer.get("mac"), nonce_c, nonce_s, str(peer.get("cluster_id"))
    ):
        raise HandshakeFailed("the peer failed authentication")
    if peer.get("cluster_id") != expected_cluster_id:
        raise HandshakeFailed(
            f"the endpoint there is cluster {peer.get('cluster_id')}, not {expected_cluster_id}"
        )
    return decoder, peer


async def server_handshake(
    engine: Any, sock: socket.socket, prepare: Callable[[dict[str, Any]], Any]
) -> tuple[Decoder, dict[str, Any], Any]:
    """Run the server side; returns the decoder, the peer identity and what ``prepare`` made
    of it (called before the client is told yes, so a refusal reaches the client).

    Raises:
        HandshakeFailed: the client was refused (it has been told so).
        OSError / EOFError / ProtocolError: the connection failed.
    """
    key = engine.options.auth_key
    decoder = Decoder(_HANDSHAKE_META)
    hello = await _recv(sock, decoder, MT.HELLO)
    if hello.fields.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(f"client speaks protocol {hello.fields.get('version')}")
    nonce_c = str(hello.fields.get("nonce", ""))
    nonce_s = new_nonce()
    await _send(sock, Message(MT.CHALLENGE, 0, {"nonce": nonce_s, "auth": key is not None}))
    req = await _recv(sock, decoder, MT.LINK_REQ)
    peer = req.fields

    async def refuse(code: LLMStatusCode, message: str, tell: bool) -> HandshakeFailed:
        fields: dict[str, Any] = {"status": int(code)}
        if tell:
            fields["message"] = message
        await _send(sock, Message(MT.LINK_ACK, 0, fields))
        return HandshakeFailed(message, code)

    if key is not None and not _check_mac(
        key, b"client", peer.get("mac"), nonce_c, nonce_s, str(peer.get("cluster_id"))
    ):
        raise await refuse(LLMStatusCode.LLM_LINK_FAILED, "client failed authentication", False)
    cid = peer.get("cluster_id")
    if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid < 2**64:
        raise ProtocolError(f"bad cluster id {cid!r}")
    if cid == engine.cluster_id and engine.options.cache_manager:
        raise await refuse(
            LLMStatusCode.LLM_PARAM_INVALID, f"cluster id {cid} is this endpoint's own id", True
        )
    if bool(peer.get("remote_accessible")) != engine.options.remote_accessible:
        raise await refuse(
            LLMStatusCode.LLM_PARAM_INVALID,
            "llm.EnableRemoteCacheAccessible differs between the two endpoints",
            True,
        )
    try:
        prepared = prepare(peer)
    except HandshakeFailed as exc:
        raise await refuse(exc.code, str(exc), False) from None
    me = engine.identity_for_link()
    mac_s = auth_mac(key, b"server", nonce_c, nonce_s, str(engine.cluster_id)) if key else None
    await _send(sock, Message(MT.LINK_ACK, 0, {"status": 0, "mac": mac_s, **me}))
    return decoder, peer, prepared
