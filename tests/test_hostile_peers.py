"""What a hostile or broken peer can do to an endpoint: nothing beyond a closed connection.

The peer here is this test, speaking the protocol through the library's own internals or raw
sockets, against a real endpoint in another process.
"""

from __future__ import annotations

import base64
import socket

import numpy as np
import pytest
from helpers import endpoint_options, link

import llmdd_async as dd
from llmdd_async._protocol import MT, Message, encode
from llmdd_async._task import CacheTask
from llmdd_async._transfer import XferSpec, initiate
from llmdd_async.testing import PeerProcess, encode_key

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
            engine = d._engine
            lnk = engine.links.get(1)
            table_addr = int(
                next(c for c in (await lnk.fetch_table(5))["caches"] if c["cache_id"] == victim)[
                    "addrs"
                ][0]
            )
            for addr in (4096, table_addr + 128, table_addr - 64):
                spec = XferSpec(
                    "push",
                    {"by": "addrs"},
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
            spec = XferSpec(
                "push",
                {"by": "addrs"},
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
            lnk = d._engine.links.get(1)
            lnk.sock.sendall(b"\x00" * 64)  # not a frame
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 3).running(endpoint_options()) as e:
                await link(e, 1, p.listen)
                dst = e.cache_manager.allocate_blocks_cache(
                    dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8)
                )
                await e.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [1], [1])
                assert dst.tensors[0][1].any()
