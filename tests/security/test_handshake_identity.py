"""A peer's handshake identity is read once (``Identity.decode``): a peer of the last release
links as before, and a malformed field costs the peer only its link, with a clean refusal."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from helpers import RawPeer, endpoint_options, link, peer_identity

import llmdd_async as dd
from llmdd_async._messages import LinkRefused
from llmdd_async._net.handshake import new_nonce
from llmdd_async._protocol import MT, PROTOCOL_VERSION, Message
from llmdd_async.testing import has_link, link_of, wait_until

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode

#: a field of each kind the handshake reads, malformed
_MALFORMED: list[tuple[str, Any]] = [
    ("cluster_id", "9"),
    ("remote_accessible", "0"),
    ("payload_auth", 0),
    ("host", ["not", "a", "dict"]),
    ("transport", 5),
    ("uds", 7),
]


async def _link_req(address: tuple[str, int], fields: dict[str, Any]) -> LinkRefused:
    """Send one hand-made LINK_REQ (unkeyed HELLO first); the server's answer."""
    s = socket.create_connection(address)
    s.setblocking(False)
    h = RawPeer(s)
    try:
        await h.send(Message(MT.HELLO, 0, {"version": PROTOCOL_VERSION, "nonce": new_nonce()}))
        await h.recv(MT.CHALLENGE)
        await h.send(Message(MT.LINK_REQ, 0, fields))
        return LinkRefused.decode(await h.recv(MT.LINK_ACK))
    finally:
        s.close()


async def test_a_malformed_identity_field_is_refused_with_why() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        assert p.listen_address is not None
        for name, bad in _MALFORMED:
            answer = await _link_req(p.listen_address, {**peer_identity(9), name: bad})
            # Unkeyed: the client is told why (and who refused), as for any other refusal.
            assert answer.status == S.LLM_PARAM_INVALID, name
            assert answer.message is not None and "malformed LINK_REQ" in answer.message
            assert answer.cluster_id == 1
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)  # the endpoint is fine


async def test_a_malformed_identity_on_a_keyed_endpoint_learns_nothing() -> None:
    opts = endpoint_options("tcp", listen=True, **{"llm.AuthKey": "k"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        assert p.listen_address is not None
        for name, bad in _MALFORMED:
            answer = await _link_req(p.listen_address, {**peer_identity(9), name: bad})
            # It proved no key: LINK_FAILED, and nothing about the server.
            assert answer == LinkRefused(S.LLM_LINK_FAILED), name


async def test_a_peer_of_the_last_release_links_and_one_from_before_payload_auth_too() -> None:
    """What the last release sent (those seven fields, the host's four parts), and what one
    from before ``llm.PayloadAuth`` sent (no ``payload_auth``): both link, read as before."""
    from llmdd_async._net.local_peer import host_identity

    last = {
        "cluster_id": 9,
        "role": int(dd.LLMRole.DECODER),
        "remote_accessible": False,
        "payload_auth": False,
        "host": host_identity().fields(),
        "transport": "tcp",
        "uds": None,
    }
    older = {k: v for k, v in last.items() if k != "payload_auth"}
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        assert p.listen_address is not None
        for cid, fields in ((9, last), (10, {**older, "cluster_id": 10})):
            s = socket.create_connection(p.listen_address)
            s.setblocking(False)
            h = RawPeer(s)
            try:
                hello = {"version": PROTOCOL_VERSION, "nonce": new_nonce()}
                await h.send(Message(MT.HELLO, 0, hello))
                await h.recv(MT.CHALLENGE)
                await h.send(Message(MT.LINK_REQ, 0, fields))
                ack = await h.recv(MT.LINK_ACK)
                assert ack.fields["status"] == 0, ack.fields
                await wait_until(lambda c=cid: has_link(p, c))  # registered after the ACK
                seen = link_of(p, cid).peer_identity
                assert seen["payload_auth"] is False and seen["host"] == last["host"]
            finally:
                s.close()


async def test_another_protocol_version_is_refused_before_anything_else_is_read() -> None:
    """The version is checked first: a HELLO of another version (whose other fields may be
    spelled otherwise) gets no CHALLENGE, and the endpoint is fine."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        assert p.listen_address is not None
        s = socket.create_connection(p.listen_address)
        s.setblocking(False)
        h = RawPeer(s)
        try:
            await h.send(Message(MT.HELLO, 0, {"version": PROTOCOL_VERSION + 1, "nonce": 5}))
            with pytest.raises((EOFError, OSError)):
                await h.recv(MT.CHALLENGE)
        finally:
            s.close()
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)
