"""What a hostile or broken peer can do to an endpoint: nothing beyond a closed connection.

The peer here is this test, speaking the protocol through the library's own internals or raw
sockets, against a real endpoint in another process.
"""

from __future__ import annotations

import base64
import socket

import anyio
import numpy as np
import pytest
from helpers import cluster, endpoint_options, link, run_spec

import llmdd_async as dd
from llmdd_async._messages import Address
from llmdd_async._net.grants import TransferRequest
from llmdd_async._net.initiator import initiate
from llmdd_async._protocol import MT, Message, encode
from llmdd_async._task import CacheTask
from llmdd_async.testing import PeerProcess, encode_key, engine_of, link_of, wait_until

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode


async def test_garbage_on_the_listener_is_dropped() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        http = b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n"
        for junk in (http, b"\0" * 64, encode(Message(MT.DATA, 1))):
            with socket.create_connection(p.listen, timeout=5) as s:
                s.sendall(junk)
                try:
                    answer = s.recv(100)
                except ConnectionResetError:
                    answer = b""
                assert answer == b""  # closed without a word
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen)  # still serving real peers


async def test_writes_outside_registered_memory_are_refused() -> None:
    opts = endpoint_options("tcp", listen=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        victim = await p.request("register", kind="cache", num_tensors=1, shape=[1, 256])
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options("tcp")) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            src = cm.allocate_cache(dd.CacheDesc(1, [1, 256], dd.DataType.DT_UINT8))
            src.tensors[0][...] = 0xAB
            engine = engine_of(d)
            lnk = link_of(d, 1).raw
            table_addr = (await lnk.view.fetch_table(5)).by_id[victim].addrs[0]
            for addr in (4096, table_addr + 128, table_addr - 64):
                spec = TransferRequest(
                    "push",
                    Address.decode({"by": "addrs"}),
                    "slot",
                    engine.registry.entries[src.cache_id],
                    raw_addrs=np.array([addr], np.uint64),
                    raw_tensor_bytes=256,
                    raw_count=1,
                )

                async def body(ctl, spec=spec) -> None:
                    await initiate(engine, lnk, spec, ctl.token, ctl.deadline)

                task = engine.start_task(CacheTask("hostile"), body, 5)
                with pytest.raises(dd.LLMException) as err:
                    await task
                assert err.value.status_code == S.LLM_PARAM_INVALID
            got = base64.b64decode(await p.request("read", cache_id=victim, tensor=0))
            assert got == b"\0" * 256  # untouched
            # ...while the same push to exactly the registered range is accepted.
            spec = TransferRequest(
                "push",
                Address.decode({"by": "addrs"}),
                "slot",
                engine.registry.entries[src.cache_id],
                raw_addrs=np.array([table_addr], np.uint64),
                raw_tensor_bytes=256,
                raw_count=1,
            )

            async def ok_body(ctl) -> None:
                await initiate(engine, lnk, spec, ctl.token, ctl.deadline)

            await engine.start_task(CacheTask("legit"), ok_body, 5)
            got = base64.b64decode(await p.request("read", cache_id=victim, tensor=0))
            assert got == b"\xab" * 256


async def test_a_peer_that_speaks_nonsense_after_the_handshake_loses_only_its_link() -> None:
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(listen=True)) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=3,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen)
            lnk = link_of(d, 1)
            lnk.sock.sendall(b"\x00" * 64)  # not a frame
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 3).running(endpoint_options()) as e:
                await link(e, 1, p.listen)
                dst = e.cache_manager.allocate_blocks_cache(
                    dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8)
                )
                await e.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [1], [1])
                assert dst.tensors[0][1].any()


async def test_negative_block_indices_cannot_reach_outside_a_cache() -> None:
    """Block lists travel as u64; 2**64 - k must not become "k blocks before the cache"."""
    opts = endpoint_options("tcp", listen=True, ra=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, opts) as p:
        victim = await p.request(
            "register",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=5,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            endpoint_options("tcp", ra=True)
        ) as d:
            await link(d, 1, p.listen)
            engine = engine_of(d)
            lnk = link_of(d, 1).raw
            mine = d.cache_manager.allocate_blocks_cache(
                dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8)
            )
            entry = engine.registry.entries[mine.cache_id]
            for op in ("pull", "push"):
                for bad in (2**64 - 1, 2**64 - 1000, 2**63):
                    blocks = np.array([bad], dtype=np.uint64)
                    spec = TransferRequest(
                        op,
                        Address.decode({"by": "cache_id", "cache_id": victim, "index": 0}),
                        "blocks",
                        entry,
                        src_blocks=blocks if op == "pull" else np.array([0], np.uint64),
                        dst_blocks=np.array([0], np.uint64) if op == "pull" else blocks,
                    )
                    with pytest.raises(dd.LLMException) as err:
                        await run_spec(engine, lnk, spec)
                    assert err.value.status_code == S.LLM_PARAM_INVALID
            got = base64.b64decode(await p.request("read", cache_id=victim, tensor=0))
            from llmdd_async.testing import pattern

            assert got == pattern(5, 256).tobytes()  # untouched, and the peer is alive


async def test_in_process_links_are_proven_by_the_kernel_not_by_the_peer() -> None:
    """The in-process path trusts the peer's addresses, so it needs the kernel's word
    (SO_PEERCRED on the side channel); identity fields in the handshake mean nothing."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True)) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            await link(d, 1, p.listen_address)
            assert d.link_statistics(1).transport == "in-process"  # a real one: proven
            await d.unlink_clusters([cluster(1)], force=True)
            links = engine_of(d).links
            honest = links.identity
            # The decoder now hides its side channel: nothing can be proven, so TCP.
            links.identity = lambda: {**honest(), "uds": None}
            await link(d, 1, p.listen_address)
            assert d.link_statistics(1).transport == "tcp"


async def test_cancel_while_waiting_for_the_send_lock_does_not_hang() -> None:
    """A push cancelled while the peer's big pull holds our send lock returns promptly."""
    big = (48, 1 << 20)
    opts = endpoint_options(
        "tcp", listen=True, ra=True, **{"llm.MemPoolConfig": '{"memory_size": 134217728}'}
    )
    async with PeerProcess.start(dd.LLMRole.DECODER, 3, opts) as p:
        theirs = await p.request("alloc", kind="blocks", num_tensors=1, shape=list(big))
        await p.request(
            "register",
            kind="blocks",
            num_tensors=1,
            shape=[4, 64],
            blocks_key=encode_key(dd.BlocksCacheKey(3, 0)),
        )
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 4).running(opts) as d:
            await link(d, 3, p.listen)
            cm = d.cache_manager
            cm.allocate_blocks_cache(  # what the peer pulls
                dd.CacheDesc(1, list(big), dd.DataType.DT_UINT8), dd.BlocksCacheKey(4, 0)
            )
            small = cm.allocate_blocks_cache(dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8))
            await cm.push_blocks(dd.BlocksCacheKey(3, 0), small, [0], [0])  # table snapshot
            for _ in range(3):
                # the peer pulls 48 MiB from us: our send lock is busy streaming it...
                pull = await p.call(
                    "pull_blocks",
                    {"key": encode_key(dd.BlocksCacheKey(4, 0))},
                    {"cache": theirs},
                    list(range(48)),
                    list(range(48)),
                    wait=False,
                )
                # Wait until a worker streams one of its 32 MiB frames under our send lock
                # (a fixed sleep raced with the peer starting its pull on a loaded machine).
                ours = link_of(d, 3)
                await wait_until(lambda: ours.streaming, 10, 0.0005)  # noqa: B023 (awaited here)
                task = cm.push_blocks(dd.BlocksCacheKey(3, 0), small, [1], [1])
                for _ in range(3):
                    await anyio.lowlevel.checkpoint()
                assert not ours.send_path_free and not task.done()
                task.cancel()  # ...while our push waits for it
                with anyio.fail_after(10):
                    with pytest.raises(dd.LLMException):
                        await task
                assert await p.request("wait_task", task=pull) == 0
            await cm.push_blocks(dd.BlocksCacheKey(3, 0), small, [2], [2])  # link still fine
