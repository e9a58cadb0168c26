"""A hostile target's GRANTs over a same-host link, where the initiator copies (local mode):
only the one grant it checked is ever acted on, and a pull never sends our memory."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import llmdd_async as dd
from llmdd_async._messages import Grant, Mode, Result
from llmdd_async._net.host import Served
from llmdd_async._net.target import resolve_and_plan
from llmdd_async._transports.tcp import StreamPlan
from llmdd_async.testing import DEFAULT_OPTIONS, engine_of, linked_pair

pytestmark = pytest.mark.anyio

BLOCK = 2 << 20  # over a MiB: the initiator's task copies it, not its reader


def _nothing() -> None:
    return None


async def test_a_second_grant_cannot_turn_a_pull_into_a_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GRANT 1 (local mode) sends the copy to a task; GRANT 2, the same ranges in stream mode,
    # replaced it before the task ran: the task took the push's path, streamed our stale
    # destination to the target, and the pull ended as a success on the target's RESULT.
    opts = {**DEFAULT_OPTIONS, "llm.Transport": "same-host"}
    async with linked_pair(opts) as (prompt, decoder):
        desc = dd.CacheDesc(1, [4, BLOCK], dd.DataType.DT_UINT8)
        src = np.full((4, BLOCK), 0x11, np.uint8)
        prompt.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
        dst = np.full((4, BLOCK), 0x5A, np.uint8)  # a previous request's bytes
        cache = decoder.cache_manager.register_blocks_cache(desc, [dst])
        server = engine_of(prompt).links.server
        sink = np.zeros(BLOCK, np.uint8)

        async def two_grants(link: Any, req: Any, request: Any) -> None:
            _, plan, _, _, _ = resolve_and_plan(server.host, link, request)
            total = plan.total_bytes
            first = Grant(
                req.req_id, mode=Mode.LOCAL, total=total, local=plan.dst, nbytes=plan.nbytes,
                remote=plan.src,
            )  # fmt: skip
            second = Grant(
                req.req_id, mode=Mode.STREAM, total=total, local=plan.dst, nbytes=plan.nbytes
            )
            req.stream = StreamPlan(
                np.array([sink.ctypes.data], np.uint64), np.array([BLOCK], np.uint64)
            )
            link.send_soon([first.encode(), second.encode()], [], _nothing)
            with anyio.move_on_after(2):
                await req.data_event.wait()
                link.send_soon([Result(req.req_id).encode()], [], _nothing)

        monkeypatch.setattr(server, "serve_now", lambda link, request: Served.TASK)
        monkeypatch.setattr(server, "serve_request", two_grants)
        with pytest.raises(dd.LLMException) as caught:
            with anyio.fail_after(10):
                await decoder.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [1], [1])
        assert caught.value.status_code == dd.LLMStatusCode.LLM_LINK_FAILED, caught.value
        assert "a second GRANT for the same request" in str(caught.value)
        assert not sink.any()  # nothing of ours reached the target
