"""A hostile initiator's DATA frames for a push into our cache: they come in order, or the link
breaks; a RESULT means every granted byte was written."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from helpers import blocks_request, endpoint_options, raw_link

import llmdd_async as dd
from llmdd_async._messages import Data
from llmdd_async._protocol import MT
from llmdd_async.testing import link_of, wait_until

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("bb", [64, 1 << 20], ids=["from-the-reader", "from-a-task"])
async def test_a_pushs_bytes_sent_twice_instead_of_in_full_break_the_link(bb: int) -> None:
    # The first of two blocks sent twice makes as many bytes as both: counted, that ended the
    # push with a RESULT and the second block never written.
    opts = endpoint_options("tcp", listen=True, ra=True)
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as p:
        desc = dd.CacheDesc(1, [8, bb], dd.DataType.DT_UINT8)
        cache = p.cache_manager.allocate_blocks_cache(desc)
        cache.tensors[0][...] = 0x11
        assert p.listen_address is not None
        peer = await raw_link(p.listen_address, 9, remote_accessible=True)
        try:
            await peer.send(blocks_request("push", 5, cache.cache_id, [0, 1], [2, 3], 1, bb, 8))
            assert (await peer.frame()).type == MT.GRANT
            for _ in range(2):
                await peer.send(Data(5, 0, bb).encode())
                await peer.send_bytes(b"\xaa" * bb)
            with anyio.fail_after(10):
                assert await peer.closed_by_peer(), "the endpoint answered the push"
        finally:
            peer.close()
        await wait_until(lambda: not link_of(p, 9, alive=False).alive, 5)
        broken = link_of(p, 9, alive=False).broken
        assert "of a push whose bytes so far end at" in str(broken)
        assert (np.asarray(cache.tensors[0][3]) == 0x11).all()
