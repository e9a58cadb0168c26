"""The security model (README "Security model"): each test is one attack, made by a real
hostile peer over sockets (raw protocol frames from this test, or a child process), against a
real endpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import (
    RawPeer,
    cluster,
    endpoint_options,
    hostile_server,
    link,
    peer_identity,
    raw_link,
    run_spec,
    server_identity,
)

import llmdd_async as dd
from llmdd_async._messages import Address
from llmdd_async._net.handshake import new_nonce, recv_message, send_message
from llmdd_async._protocol import MT, PROTOCOL_VERSION, Decoder, Message, encode
from llmdd_async.testing import (
    PeerProcess,
    cache_entry,
    encode_key,
    engine_of,
    link_of,
    links_of,
    side_channel_name,
    wait_link_down,
    wait_link_listed,
    wait_until,
)

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode


# ---------------------------------------------------------------------------- memory isolation
async def test_a_peer_cannot_make_us_write_our_own_memory_with_a_lying_identity() -> None:
    """The old attack: claim our pid (wrapped past a C int), echo our probe, then grant a
    "same-host" push into memory we never registered. Identity now comes from the kernel:
    the lie buys nothing, the link moves bytes over TCP, and the grant is refused."""
    secret = np.full(4096, 0x5A, dtype=np.uint8)  # never registered anywhere
    victim_addr = secret.ctypes.data

    def serve(h: RawPeer, peer: dict[str, Any]) -> dict[str, Any]:
        # What the old handshake trusted: pid, pools and probe, all taken from the message.
        probe = peer.get("probe") or [0, ""]
        return server_identity(
            1,
            host={**peer["host"], "pid": os.getpid() + 2**32},
            probe=probe,
            pools=[],
            inproc="0" * 64,
        )

    async def after(h: RawPeer) -> None:
        while True:
            msg = await h.frame()
            if msg.type == MT.TABLE_REQ:  # a table that makes the push go ahead
                cache = {
                    "cache_id": 1,
                    "addrs": [victim_addr],
                    "tensor_bytes": 4096,
                    "count": 1,
                    "is_blocks": False,
                    "placement": 0,
                    "remote_accessible": True,
                }
                await h.send(Message(MT.TABLE, 0, {"caches": [cache], "blocks_keys": {}}))
            if msg.type == MT.XFER_REQ:
                local = np.frombuffer(msg.arrays["local_addrs"], dtype="<u8")
                arrays = {
                    "local": np.array([local[0]], "<u8").tobytes(),
                    "nbytes": np.array([4096], "<u8").tobytes(),
                    "remote": np.array([victim_addr], "<u8").tobytes(),
                }
                await h.send(Message(MT.GRANT, msg.req_id, {"status": 0, "mode": "local"}, arrays))

    serve.after = after  # type: ignore[attr-defined]
    opts = endpoint_options(ra=True)
    async with hostile_server(1, serve) as addr:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            code, _ = await d.link_clusters([cluster(1, addr)], 3000)
            assert code == S.LLM_SUCCESS
            assert d.link_statistics(1).transport == "tcp"  # nothing proven: no direct path
            cm = d.cache_manager
            src = cm.allocate_cache(dd.CacheDesc(1, [1, 4096], dd.DataType.DT_UINT8))
            src.tensors[0][...] = 0xEE
            with pytest.raises(dd.LLMException):
                await cm.push_cache(dd.CacheKeyByIdAndIndex(1, 1, 0), src)
    assert (secret == 0x5A).all()  # untouched


async def test_a_real_same_host_peer_is_proven_by_the_kernel() -> None:
    """Two honest processes on this host get the direct path; the decision came from the side
    channel (the handshake carries no pid, pools or probe any more)."""
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen)
            lnk = link_of(d, 1)
            assert d.link_statistics(1).transport == "same-host"
            assert lnk.peer_pid == p.process.pid
            peer = lnk.peer_identity
            for leak in ("pid", "pools", "probe", "inproc"):
                assert leak not in peer and leak not in peer.get("host", {})


async def test_a_relayed_side_channel_is_refused() -> None:
    """A server that names someone else's side channel (here: our own) gets no direct path:
    the other end cannot confirm the TCP connection it is asked about."""
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        own = side_channel_name(d)
        assert own

        def serve(h: RawPeer, peer: dict[str, Any]) -> dict[str, Any]:
            return server_identity(1)

        async def after(h: RawPeer) -> None:
            # Pretend to be the server proving itself, but for a connection that is not ours.
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.setblocking(False)
            u.connect("\0" + own)
            await send_message(
                u,
                Message(
                    MT.PROVE,
                    0,
                    {"nonces": ["x", "y"], "tcp": [["127.0.0.1", 1], ["127.0.0.1", 2]]},
                ),
            )
            ack = await recv_message(u, Decoder(), MT.PROVE_ACK)
            u.close()
            results.append(ack.fields["status"])
            await anyio.sleep_forever()

        results: list[int] = []
        serve.after = after  # type: ignore[attr-defined]
        async with hostile_server(1, serve) as addr:
            code, _ = await d.link_clusters([cluster(1, addr)], 3000)
            assert code == S.LLM_SUCCESS
            await wait_until(lambda: bool(results), 5, 0.01)
            assert results == [1]  # refused
            assert d.link_statistics(1).transport == "tcp"


async def test_grants_outside_the_peers_published_caches_are_refused() -> None:
    """Even a proven peer's grant may only name memory it published as reachable: here an
    in-process peer whose registry is tampered with to grant our secret buffer."""
    secret = np.full(4096, 0x33, dtype=np.uint8)
    opts = endpoint_options(listen=True, ra=True)
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        theirs = p.cache_manager.allocate_cache(dd.CacheDesc(1, [1, 4096], dd.DataType.DT_UINT8))
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options(ra=True)) as d:
            await link(d, 1, p.listen_address)
            assert d.link_statistics(1).transport == "in-process"
            entry = cache_entry(p, theirs.cache_id)
            entry.addrs = np.array([secret.ctypes.data], dtype=np.uint64)  # the lie
            engine = engine_of(p)
            engine.registry._changed()
            engine.registry.reachable_regions()
            engine.links.reachable_by_peer = lambda *a: True  # type: ignore[method-assign]
            # ...but the table the decoder checks against came from before the lie, and a
            # fresh one is fetched only on a miss: publish nothing reachable any more.
            entry.remote_accessible = False
            mine = d.cache_manager.allocate_cache(dd.CacheDesc(1, [1, 4096], dd.DataType.DT_UINT8))
            mine.tensors[0][...] = 0x77
            with pytest.raises(dd.LLMException) as err:
                await d.cache_manager.push_cache(
                    dd.CacheKeyByIdAndIndex(1, theirs.cache_id, 0), mine
                )
            assert err.value.status_code in (S.LLM_LINK_FAILED, S.LLM_PARAM_INVALID)
    assert (secret == 0x33).all()


async def test_a_peer_on_a_tcp_link_claiming_direct_access_gets_a_stream_grant() -> None:
    """The caps a request carries are the initiator's claim: over a TCP link a peer that
    claims it can read our memory itself (``pvr``, ``inproc``, ``pools``, ``nixl``) is still
    served over the stream, so it never learns our addresses from a grant."""
    opts = endpoint_options("tcp", listen=True, ra=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        public = await p.request("register", kind="cache", num_tensors=1, shape=[1, 256])
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True)
        ) as d:
            await link(d, 1, p.listen)
            claim = {"inproc": True, "pools": True, "pvr": True, "nixl": True}
            engine_of(d).request_caps = lambda *a: claim  # type: ignore[method-assign]
            mine = d.cache_manager.allocate_cache(dd.CacheDesc(1, [1, 256], dd.DataType.DT_UINT8))
            await d.cache_manager.pull_cache(dd.CacheKeyByIdAndIndex(1, public, 0), mine)
            assert [r.mode for r in d.link_statistics(1).recent] == ["stream"]


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_caches_that_are_not_remote_accessible_stay_private(transport: str) -> None:
    """By id or address a peer reaches only remote-accessible caches; their addresses are all
    the published table shows."""
    opts = endpoint_options(transport, listen=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        private = await p.request(
            "register", kind="cache", num_tensors=1, shape=[1, 256], remote_accessible=False
        )
        public = await p.request("register", kind="cache", num_tensors=1, shape=[1, 256])
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options(transport)) as d:
            await link(d, 1, p.listen)
            lnk = link_of(d, 1).raw
            table = {c.cache_id: c for c in (await lnk.view.fetch_table(5)).typed.caches}
            assert table[private].addrs == () and table[public].addrs
            cm = d.cache_manager
            mine = cm.allocate_cache(dd.CacheDesc(1, [1, 256], dd.DataType.DT_UINT8))
            with pytest.raises(dd.LLMException) as err:
                await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, private, 0), mine)
            assert err.value.status_code == S.LLM_PARAM_INVALID
            await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, public, 0), mine)  # allowed


# ---------------------------------------------------------------------------- authentication
def test_an_empty_auth_key_is_an_error() -> None:
    from llmdd_async._options import parse_options

    with pytest.raises(dd.LLMException) as err:
        parse_options({"llm.EnableCacheManager": "1", "llm.AuthKey": ""})
    assert err.value.status_code == S.LLM_PARAM_INVALID


async def test_frames_injected_into_a_keyed_link_break_it() -> None:
    """After a keyed handshake every frame carries a tag under a per-link key: bytes a relay
    injects (here: a well-formed PING written straight onto the socket) are refused."""
    opts = endpoint_options("tcp", listen=True, **{"llm.AuthKey": "s3cret"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", **{"llm.AuthKey": "s3cret"})
        ) as d:
            await link(d, 1, p.listen_address)
            ours = link_of(d, 1)
            assert await ours.raw.roundtrip(Message(MT.PING), MT.PONG, 5) is not None  # tagged: ok
            ours.sock.sendall(encode(Message(MT.PING)))  # untagged, as an injector would
            await wait_link_down(p, 2)
            assert "authentication" in str(link_of(p, 2, alive=False).broken)


async def test_the_mac_covers_the_whole_transcript() -> None:
    """A relay that changes any identity field (here: the role) fails the handshake."""
    from llmdd_async._net import handshake as _handshake

    opts = endpoint_options("tcp", listen=True, **{"llm.AuthKey": "k"})
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", **{"llm.AuthKey": "k"})
        ) as d:
            real = _handshake.send_message

            async def tamper(sock: socket.socket, msg: Message) -> None:
                if msg.type == MT.LINK_REQ:
                    msg = Message(msg.type, 0, {**msg.fields, "role": 0})
                await real(sock, msg)

            _handshake.send_message = tamper  # type: ignore[assignment]
            try:
                code, _ = await d.link_clusters([cluster(1, p.listen_address)], 2000)
            finally:
                _handshake.send_message = real  # type: ignore[assignment]
            assert code == S.LLM_LINK_FAILED
            await link(d, 1, p.listen_address)  # untampered: fine


# ---------------------------------------------------------------------------- link takeover
async def test_a_live_link_is_never_replaced_by_a_second_peer_with_its_cluster_id() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)
            first = link_of(p, 2)
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as evil:
                _, codes = await evil.link_clusters([cluster(1, p.listen_address)], 2000)
                assert codes == [S.LLM_ALREADY_LINK]
                assert "already has a live link" in (evil.link_failure(1) or "")
            assert link_of(p, 2, alive=False) == first and first.alive


async def test_two_endpoints_linking_to_each_other_at_once_both_succeed() -> None:
    """hixl's sample: both sides call link_clusters on each other at the same moment."""
    for _ in range(5):
        a_opts, b_opts = endpoint_options("tcp", listen=True), endpoint_options("tcp", listen=True)
        async with (
            dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(a_opts) as a,
            dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(b_opts) as b,
        ):
            results: dict[str, Any] = {}

            async def go(
                name: str, me: dd.LLMDataDist, other: int, addr: Any, out: dict[str, Any]
            ) -> None:
                out[name] = await me.link_clusters([cluster(other, addr)], 3000)

            async with anyio.create_task_group() as tg:
                tg.start_soon(go, "a", a, 2, b.listen_address, results)
                tg.start_soon(go, "b", b, 1, a.listen_address, results)
            assert results["a"] == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), results
            assert results["b"] == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), results
            # One connection, usable both ways.
            ca = a.cache_manager.allocate_cache(
                dd.CacheDesc(1, [1, 64], dd.DataType.DT_UINT8), [dd.CacheKey(1, 7)]
            )
            ca.tensors[0][...] = 9
            cb = b.cache_manager.allocate_cache(dd.CacheDesc(1, [1, 64], dd.DataType.DT_UINT8))
            await b.cache_manager.pull_cache(dd.CacheKey(1, 7), cb)
            assert (cb.tensors[0] == 9).all()
            cb2 = b.cache_manager.allocate_cache(
                dd.CacheDesc(1, [1, 64], dd.DataType.DT_UINT8), [dd.CacheKey(2, 8)]
            )
            cb2.tensors[0][...] = 4
            await a.cache_manager.pull_cache(dd.CacheKey(2, 8), ca)
            assert (ca.tensors[0] == 4).all()
            # Both sides unlink at once: codes, never an exception.
            async with anyio.create_task_group() as tg:
                tg.start_soon(_unlink, a, 2, results, "ua")
                tg.start_soon(_unlink, b, 1, results, "ub")
            assert results["ua"][0] == S.LLM_SUCCESS and results["ub"][0] == S.LLM_SUCCESS


async def _unlink(d: dd.LLMDataDist, cid: int, out: dict[str, Any], key: str) -> None:
    out[key] = await d.unlink_clusters([cluster(cid)], 2000)


# ---------------------------------------------------------------------------- resources
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_links_whose_peer_hung_up_hold_no_socket() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        before = _open_fds()
        for i in range(40):
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 100 + i).running(
                endpoint_options("tcp")
            ) as d:
                await link(d, 1, p.listen_address)
                link_of(d, 1).sock.close()  # hang up without a word
        await wait_until(
            lambda: all(lnk.sock.fileno() == -1 for lnk in links_of(p).values()), 10, 0.01
        )
        links = links_of(p)
        assert len(links) == 40 and not any(lnk.alive for lnk in links.values())  # listed...
        assert _open_fds() <= before  # ...but holding no socket


async def test_an_idle_link_holds_no_scratch_buffer() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)
            lnk = link_of(p, 2)
            big = [
                k
                for k, v in vars(lnk.raw).items()
                if isinstance(v, (bytearray, memoryview)) and len(v) > 65536
            ]
            assert big == []


async def test_a_request_flood_is_refused_busy_and_pings_are_backpressured() -> None:
    """A peer that floods PINGs and never reads stops being read once 64 replies are owed (its
    flood stays in its own socket buffer); the endpoint keeps serving others.

    How fast the endpoint reads the flood depends on the machine: on a loaded one a socket that
    stays unwritable for a second is a slow reader, not a stopped one (the test used to stop
    there, and found 2 replies owed instead of 64). So it floods until 64 replies are owed,
    then checks that nothing more is read."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        endpoint_options("tcp", listen=True)
    ) as p:
        h = await raw_link(p.listen_address, 66, rcvbuf=4096)  # it never reads its PONGs
        s = h.sock
        lnk = link_of(p, 66)
        # Only to be quick: the endpoint's unsent PONGs fill a small send buffer sooner (with
        # the kernel's 4 MB it takes ~110k PINGs, 20 s on a loaded machine); the limit is
        # the same whatever the buffer.
        lnk.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        chunk = encode(Message(MT.PING)) * 4096
        pending = memoryview(b"")
        sent = 0
        with anyio.move_on_after(120):  # generous: the endpoint's own pace on a loaded machine
            while sent < 1 << 30 and lnk.replies_left:
                if not pending:
                    pending = memoryview(chunk)
                with anyio.move_on_after(0.2):
                    await anyio.wait_writable(s)
                try:
                    n = s.send(pending, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                pending, sent = pending[n:], sent + n
        assert lnk.replies_left == 0, f"the endpoint read {sent} bytes of PINGs, owes fewer"
        # Stopped: what the peer sends from now on stays in the sockets' buffers.
        unread = _unread(lnk.sock)
        with anyio.move_on_after(2):
            while True:
                await anyio.wait_writable(s)
                with contextlib.suppress(BlockingIOError):
                    s.send(pending or chunk, socket.MSG_DONTWAIT)
        await anyio.sleep(0.5)
        assert lnk.replies_left == 0  # 64 replies owed, no more
        assert _unread(lnk.sock) >= unread > 0, "the endpoint went on reading"
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options("tcp")) as d:
            await link(d, 1, p.listen_address)  # others are still served
        h.close()


def _unread(sock: socket.socket) -> int:
    """Bytes in ``sock``'s receive queue that nobody read yet."""
    import fcntl
    import struct
    import termios

    return int(struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0])


async def test_repeated_block_indices_cannot_amplify_a_request() -> None:
    opts = endpoint_options("tcp", listen=True, ra=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        victim = await p.request(
            "register",
            kind="blocks",
            num_tensors=1,
            shape=[4, 1024],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True)
        ) as d:
            await link(d, 1, p.listen)
            mine = d.cache_manager.allocate_blocks_cache(
                dd.CacheDesc(1, [64, 1024], dd.DataType.DT_UINT8)
            )
            from llmdd_async._net.grants import TransferRequest

            engine = engine_of(d)
            spec = TransferRequest(
                "pull",
                Address.decode({"by": "cache_id", "cache_id": victim, "index": 0}),
                "blocks",
                engine.registry.entries[mine.cache_id],
                src_blocks=np.zeros(64, np.uint64),  # block 0, 64 times: 16 x the cache
                dst_blocks=np.arange(64, dtype=np.uint64),
            )
            with pytest.raises(dd.LLMException) as err:
                await run_spec(engine, engine.links.get(1), spec)
            assert err.value.status_code == S.LLM_PARAM_INVALID
            assert "more than" in str(err.value)


# ---------------------------------------------------------------------------- errors
async def test_a_pull_after_the_peer_died_says_why() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
            await link(d, 1, p.listen)
            p.kill()
            await wait_link_down(d, 1)
        mine = d.cache_manager.allocate_cache(dd.CacheDesc(1, [1, 64], dd.DataType.DT_UINT8))
        with pytest.raises(dd.LLMException) as err:
            await d.cache_manager.pull_cache(dd.CacheKey(1, 1), mine)
        assert err.value.status_code == S.LLM_LINK_FAILED
        assert "link to cluster 1 is down: peer closed the connection" in str(err.value)
        assert d.link_failure(1) == "peer closed the connection"


async def test_wait_for_link_returns_when_the_peer_links() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        with pytest.raises(dd.LLMException) as err:
            await p.wait_for_link(2, 50)
        assert err.value.status_code == S.LLM_TIMEOUT
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.wait_for_link, 2, 5000)
                await link(d, 1, p.listen_address)


async def test_link_failure_reasons_are_kept_per_cluster() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        code, _ = await d.link_clusters([cluster(1, ("127.0.0.1", port))], 1000)
        assert code == S.LLM_LINK_FAILED
        assert "refused" in (d.link_failure(1) or "") or "111" in (d.link_failure(1) or "")
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 5).running(endpoint_options(listen=True)) as p:
            code, _ = await d.link_clusters([cluster(1, p.listen_address)], 1000)
            assert code == S.LLM_LINK_FAILED
            assert "cluster 5, not 1" in (d.link_failure(1) or "")


async def test_pushes_by_key_outside_remote_accessible_mode_are_refused() -> None:
    """A key grants pulls: in request/response mode a peer cannot write through it (nor by
    id into a cache that is not remote accessible)."""

    from llmdd_async._net.grants import TransferRequest

    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        private = p.cache_manager.allocate_cache(
            dd.CacheDesc(1, [1, 256], dd.DataType.DT_UINT8, dd.Placement.HOST),
            [dd.CacheKey(1, 7)],
        )
        private.tensors[0][...] = 9
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)
            engine = engine_of(d)
            mine = d.cache_manager.allocate_cache(dd.CacheDesc(1, [1, 256], dd.DataType.DT_UINT8))
            mine.tensors[0][...] = 0x41
            entry = engine.registry.entries[mine.cache_id]
            for target in (
                Address.decode({"by": "req_key", "id": 7, "model_id": 0}),
                Address.decode({"by": "cache_id", "cache_id": private.cache_id, "index": 0}),
            ):
                with pytest.raises(dd.LLMException) as err:
                    await run_spec(
                        engine,
                        engine.links.get(1),
                        TransferRequest("push", target, "slot", entry),
                    )
                assert err.value.status_code == S.LLM_PARAM_INVALID
            assert (private.tensors[0] == 9).all()
            # ...while the pull that key is for works.
            await d.cache_manager.pull_cache(dd.CacheKey(1, 7), mine)
            assert (mine.tensors[0] == 9).all()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_a_grant_for_other_blocks_of_ours_is_refused(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The initiator checks that a grant writes only the blocks it asked for: a target that
    shifts our destination by three blocks breaks the link instead. (Request/response mode:
    in remote-accessible mode a same-host pull is planned by the initiator, with no grant.)"""
    from llmdd_async._net import target as _target

    real = _target.resolve_and_plan

    def shifted(engine: Any, link: Any, req: Any) -> Any:
        entries, plan, slot_info, mode, n = real(engine, link, req)
        plan = _target.Plan(plan.src, plan.dst + np.uint64(3 * 64), plan.nbytes)
        return entries, plan, slot_info, mode, n

    opts = endpoint_options(transport, listen=True)
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        p.cache_manager.allocate_blocks_cache(
            dd.CacheDesc(1, [8, 64], dd.DataType.DT_UINT8), dd.BlocksCacheKey(1, 0)
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options(transport)) as d:
            await link(d, 1, p.listen_address)
            mine = d.cache_manager.allocate_blocks_cache(
                dd.CacheDesc(1, [8, 64], dd.DataType.DT_UINT8)
            )
            mine.tensors[0][...] = 5
            monkeypatch.setattr(_target, "resolve_and_plan", shifted)
            with pytest.raises(dd.LLMException) as err:
                await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), mine, [0], [0])
            assert err.value.status_code == S.LLM_LINK_FAILED
            assert (mine.tensors[0] == 5).all()  # block 3 untouched


async def test_a_second_grant_outside_the_selection_breaks_the_link() -> None:
    """A target that answers one request with two GRANTs, the first right and the second
    naming blocks we did not ask for (before its DATA): the second is checked like the first,
    so the link breaks and not one byte of ours is written."""
    from llmdd_async._messages import Grant

    opts = endpoint_options("tcp", listen=True)
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        theirs = p.cache_manager.allocate_blocks_cache(
            dd.CacheDesc(1, [8, 64], dd.DataType.DT_UINT8), dd.BlocksCacheKey(1, 0)
        )
        theirs.tensors[0][...] = 7
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options("tcp")) as d:
            await link(d, 1, p.listen_address)
            mine = d.cache_manager.allocate_blocks_cache(
                dd.CacheDesc(1, [8, 64], dd.DataType.DT_UINT8)
            )
            mine.tensors[0][...] = 5
            await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), mine, [0], [0])
            assert (mine.tensors[0][0] == 7).all() and (mine.tensors[0][1:] == 5).all()
            mine.tensors[0][...] = 5
            target_side = link_of(p, 2).raw
            real = target_side.send_soon
            doubled = []

            def send_soon(frames: list[Any], views: Any, done: Any) -> bool:
                first = frames[0] if frames else None
                if isinstance(first, Message) and first.type == MT.GRANT:
                    first = Grant.decode(first)
                if isinstance(first, Grant):  # (typed, as the target's small path sends it)
                    assert first.ok and first.local is not None
                    shifted = dataclasses.replace(first, local=first.local + np.uint64(3 * 64))
                    frames = [frames[0], shifted, *frames[1:]]
                    doubled.append(first.req_id)
                return bool(real(frames, views, done))

            target_side.send_soon = send_soon
            with pytest.raises(dd.LLMException) as err:
                await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), mine, [0], [0])
            assert doubled, "the target's small path sends no GRANT through send_soon any more"
            assert err.value.status_code == S.LLM_LINK_FAILED
            assert (mine.tensors[0] == 5).all()  # neither block 0 nor block 3 written


async def test_a_malformed_host_field_only_costs_the_peer_its_link() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        endpoint_options("same-host", listen=True)
    ) as p:
        s = socket.create_connection(p.listen_address)
        s.setblocking(False)
        h = RawPeer(s)
        await h.send(Message(MT.HELLO, 0, {"version": PROTOCOL_VERSION, "nonce": new_nonce()}))
        await h.recv(MT.CHALLENGE)
        await h.send(Message(MT.LINK_REQ, 0, peer_identity(9, host="x", uds="llmdd-async/1/zz")))
        ack = await h.recv(MT.LINK_ACK)
        assert ack.fields["status"] != 0  # same-host required, nothing provable: refused
        s.close()
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)  # the endpoint is fine

    def serve(h: RawPeer, peer: dict[str, Any]) -> dict[str, Any]:
        return server_identity(1, host=["not", "a", "dict"])

    serve.after = lambda h: anyio.sleep(0.2)  # type: ignore[attr-defined]
    async with hostile_server(1, serve) as addr:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("same-host")
        ) as d:
            assert await d.link_clusters([cluster(1, addr)], 2000) == (
                S.LLM_LINK_FAILED,
                [S.LLM_LINK_FAILED],
            )  # a code, not an exception


async def test_the_serve_budget_tells_the_initiator_at_once() -> None:
    """A request that outlives what the target grants a peer (``llm.ServeTimeout``) is
    aborted there, and the initiator hears it then, not at its own (much later) deadline."""
    opts = endpoint_options("tcp", listen=True, ra=True, **{"llm.ServeTimeout": "200"})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True, **{"llm.SyncKvCacheWaitTime": "60000"})
        ) as d:
            await link(d, 1, p.listen)
            mine = d.cache_manager.allocate_blocks_cache(
                dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8)
            )
            lnk = link_of(d, 1).raw

            async def stall(*args: Any, **kwargs: Any) -> bool:
                return True  # the initiator "sends" its push data but never does

            lnk.send_stream = stall  # type: ignore[method-assign]
            send_soon = lnk.send_soon

            def drop_data(frames: list[Any], views: Any, done: Any) -> bool:
                last = frames[-1]  # (a DATA frame is a Message; a request may be typed)
                if isinstance(last, Message) and last.type == MT.DATA:  # a small push's DATA
                    done()  # (or behind its request: the request alone goes)
                    return send_soon(frames[:-1], [], lambda: None) if frames[:-1] else True
                return send_soon(frames, views, done)

            lnk.send_soon = drop_data  # type: ignore[method-assign]
            task = d.cache_manager.push_blocks(dd.BlocksCacheKey(1, 0), mine, [0], [0])
            with anyio.fail_after(10):  # far below the 60 s this side would wait
                with pytest.raises(dd.LLMException) as err:
                    await task
            assert err.value.status_code == S.LLM_TIMEOUT
            assert "budget" in str(err.value)


async def test_a_silent_old_link_gives_way_to_the_peer_linking_again() -> None:
    """A live link is never replaced, but one that does not answer a PING (a peer whose host
    died, or that restarted behind a half-open connection) does not lock the peer out."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        endpoint_options("tcp", listen=True)
    ) as p:
        async with PeerProcess.start(dd.LLMRole.DECODER, 2, endpoint_options("tcp")) as old:
            await old.request("link", cluster_id=1, ip="127.0.0.1", port=p.listen_address[1])
            stale = await wait_link_listed(p, 2)
            old.pause()  # silent, its connection still open
            try:
                async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
                    endpoint_options("tcp")
                ) as new:
                    await link(new, 1, p.listen_address, timeout=10000)
                    assert not stale.alive and link_of(p, 2, alive=False) != stale
            finally:
                old.resume()


async def test_established_links_do_not_count_against_the_handshake_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only connections still in their handshake are capped (a flood of half-open
    handshakes); links that are up do not use that allowance."""
    from llmdd_async._net import listener

    monkeypatch.setattr(listener, "_MAX_IN_SETUP", 3)
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        async with (
            dd.LLMDataDist(dd.LLMRole.DECODER, 20).running(endpoint_options("tcp")) as a,
            dd.LLMDataDist(dd.LLMRole.DECODER, 21).running(endpoint_options("tcp")) as b,
            dd.LLMDataDist(dd.LLMRole.DECODER, 22).running(endpoint_options("tcp")) as c,
            dd.LLMDataDist(dd.LLMRole.DECODER, 23).running(endpoint_options("tcp")) as e,
        ):
            for d in (a, b, c, e):
                await link(d, 1, p.listen_address)  # the 4th is refused if up links counted
            assert sum(lnk.alive for lnk in links_of(p).values()) == 4


def _pidfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return n


async def test_a_failed_link_leaves_no_side_channel_access_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's last side-channel message may arrive after the link already failed (here:
    the endpoint there is another cluster id); what it carries is dropped, not leaked."""
    from llmdd_async._net import side_channel

    real = side_channel.recv_with_fds

    async def late(sock: socket.socket, decoder: Decoder, expect: MT) -> tuple[Message, list[int]]:
        if expect == MT.PROVE_FIN:
            await anyio.sleep(0.3)
        return await real(sock, decoder, expect)

    monkeypatch.setattr(side_channel, "recv_with_fds", late)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            before = _pidfds()
            for _ in range(3):
                code, _ = await d.link_clusters([cluster(9, p.listen)], 2000)
                assert code == S.LLM_LINK_FAILED  # the endpoint there is cluster 1
            await wait_until(lambda: _pidfds() == before, 5, 0.02)
            assert _pidfds() == before
