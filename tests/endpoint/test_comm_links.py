"""Comm-domain links (``link`` / ``query_register_mem_status`` / ``unlink``) between processes."""

from __future__ import annotations

import json

import anyio
import numpy as np
import pytest
from helpers import endpoint_options, expected_tensor

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, cache_entry, encode_key, free_port, wait_until

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode


def rank_table(ports: list[int]) -> str:
    """vllm-ascend's v1.2 table, on 127.0.0.1, with our ``llmdd_port`` extension."""
    return json.dumps(
        {
            "version": "1.2",
            "status": "completed",
            "server_count": str(len(ports)),
            "server_list": [
                {
                    "server_id": "127.0.0.1",
                    "device": [
                        {
                            "device_id": str(r),
                            "device_ip": "127.0.0.1",
                            "rank_id": str(r),
                            "llmdd_port": port,
                        }
                    ],
                }
                for r, port in enumerate(ports)
            ],
        }
    )


async def wait_ok(get_status) -> str:
    with anyio.fail_after(20):
        while (status := await get_status()) == "PREPARING":
            await anyio.sleep(0.02)
    return status


async def test_link_poll_pull_unlink() -> None:
    table = rank_table([free_port(), free_port()])
    ranks = {1: 0, 2: 1}
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options(ra=True)) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=[8, 256],
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=90,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options(ra=True)) as d:
            cm = d.cache_manager
            dst = cm.allocate_blocks_cache(dd.CacheDesc(2, [8, 256], dd.DataType.DT_UINT8))
            # We are rank 1: until rank 0 (the prompt) joins, nothing can link.
            comm = await d.link("pd_comm_a_b", ranks, table)
            assert d.query_register_mem_status(comm) == dd.RegisterMemStatus.PREPARING
            with pytest.raises(dd.LLMException) as err:
                cm.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [0], [0])
            assert err.value.status_code == S.LLM_NOT_YET_LINK
            peer_comm = await p.request(
                "comm_link",
                comm_name="pd_comm_a_b",
                ranks={str(k): v for k, v in ranks.items()},
                rank_table=table,
            )

            async def mine() -> str:
                return d.query_register_mem_status(comm).name

            async def theirs() -> str:
                return await p.request("comm_status", comm_id=peer_comm)

            assert await wait_ok(mine) == "OK"
            assert await wait_ok(theirs) == "OK"
            await cm.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [5, 6], [0, 1])
            for t in range(2):
                assert np.array_equal(
                    dst.tensors[t][[0, 1]], expected_tensor(90, t, (8, 256))[[5, 6]]
                )
            # after link(): new caches are not remote accessible by default, and cannot be
            later = cm.register_cache(
                dd.CacheDesc(1, [1, 8], dd.DataType.DT_UINT8), [np.zeros(8, np.uint8)]
            )
            assert not cache_entry(d, later.cache_id).remote_accessible
            with pytest.raises(dd.LLMException):
                cm.register_cache(
                    dd.CacheDesc(1, [1, 8], dd.DataType.DT_UINT8),
                    [np.zeros(8, np.uint8)],
                    remote_accessible=True,
                )
            await d.unlink(comm)
            with pytest.raises(dd.LLMException) as err:
                cm.pull_blocks(dd.BlocksCacheKey(1, 0), dst, [0], [0])
            assert err.value.status_code == S.LLM_NOT_YET_LINK
            with pytest.raises(dd.LLMException):
                d.query_register_mem_status(comm)  # forgotten


async def test_a_member_that_never_joins_fails_the_domain() -> None:
    table = rank_table([free_port(), free_port()])
    opts = endpoint_options(**{"llm.LinkTotalTime": "1"})
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
        comm = await d.link("lonely", {1: 0, 2: 1}, table)
        await wait_until(
            lambda: d.query_register_mem_status(comm) != dd.RegisterMemStatus.PREPARING,
            10,
            0.05,
        )
        assert d.query_register_mem_status(comm) == dd.RegisterMemStatus.FAILED


@pytest.mark.parametrize(
    ("name", "ranks", "table"),
    [
        ("", {1: 0, 2: 1}, None),
        ("x" * 128, {1: 0, 2: 1}, None),
        ("c", {2: 0}, None),
        ("c", {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, None),
        ("c", {1: 1, 2: 0}, None),  # ranks not ascending as iterated
        ("c", {1: 0, 3: 1}, None),  # this endpoint (2) is not a member
        ("c", {1: 0, 2: 1}, "{not json"),
        ("c", {1: 0, 2: 1}, json.dumps({"server_list": []})),
        ("c", {1: 0, 2: 1, 3: 2}, None),  # rank 2 has no device in the table
    ],
)
async def test_link_argument_rules(name, ranks, table) -> None:
    table = table or rank_table([free_port(), free_port()])
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
        with pytest.raises(dd.LLMException) as err:
            await d.link(name, ranks, table)
        assert err.value.status_code == S.LLM_PARAM_INVALID
        with pytest.raises(TypeError):
            await d.link("c", [(1, 0), (2, 1)], table)
        with pytest.raises(TypeError):
            await d.link("c", {1: 0, 2: 1}, json.loads(table) if table.startswith('{"') else 5)


async def test_link_needs_cache_manager_mode() -> None:
    async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running({}) as d:
        with pytest.raises(dd.LLMException) as err:
            await d.link("c", {1: 0, 2: 1}, rank_table([free_port(), free_port()]))
        assert err.value.status_code == S.LLM_PARAM_INVALID
