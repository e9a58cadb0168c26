"""The test kit's child processes stop cleanly however the block that ran them ends."""

from __future__ import annotations

import anyio
import pytest

import llmdd_async as dd
from llmdd_async._childproc import ChildProcess
from llmdd_async.testing import PeerProcess

pytestmark = pytest.mark.anyio


async def test_a_peer_whose_block_is_cancelled_exits_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelling the block also cancels the reader of the child's replies: the exit must not
    wait for a reply nobody reads (it waited out its 5 s bound, then killed the child)."""
    killed_at: list[float] = []
    kill = ChildProcess.kill

    def recording_kill(self: ChildProcess) -> None:
        killed_at.append(anyio.current_time())
        kill(self)

    monkeypatch.setattr(ChildProcess, "kill", recording_kill)
    with anyio.CancelScope() as scope:
        async with PeerProcess.start(dd.LLMRole.PROMPT, 1, {"llm.listenIpInfo": "127.0.0.1:0"}):
            cancelled_at = anyio.current_time()
            scope.cancel()
            await anyio.sleep(30)
    assert scope.cancelled_caught
    # The kill that follows every close came before the exit's 5 s bound ran out (it ran out
    # before, every time: exactly 5 s after the cancel).
    assert len(killed_at) == 1 and killed_at[0] - cancelled_at < 5


async def test_a_peers_cluster_info_links_to_it_and_one_that_does_not_listen_says_so() -> None:
    from llmdd_async.testing import PeerError

    async with PeerProcess.start(dd.LLMRole.PROMPT, 7, {"llm.listenIpInfo": "127.0.0.1:0"}) as p:
        info = p.cluster_info()
        assert info.remote_cluster_id == 7
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 8).running({}) as d:
            code, _ = await d.link_clusters([info], 10000)
            assert code == dd.LLMStatusCode.LLM_SUCCESS
            assert d.link_statistics(7) is not None
    async with PeerProcess.start(dd.LLMRole.DECODER, 9, {}) as quiet:
        with pytest.raises(PeerError, match="does not listen"):
            quiet.cluster_info()
