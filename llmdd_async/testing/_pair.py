"""Two linked endpoints in this process, for tests of code that uses llmdd_async."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping

import llmdd_async as dd

__all__ = ["DEFAULT_OPTIONS", "linked_pair"]

#: What :func:`linked_pair` and the pytest fixtures start endpoints with: cache-manager mode,
#: remote-accessible mode (push and layer-wise transfers), a 64 MiB device pool and a 16 MiB
#: host pool (both lazily touched).
DEFAULT_OPTIONS: Mapping[str, str] = {
    "llm.EnableCacheManager": "1",
    "llm.EnableRemoteCacheAccessible": "1",
    "llm.MemPoolConfig": json.dumps({"memory_size": 64 << 20}),
    "llm.HostMemPoolConfig": json.dumps({"memory_size": 16 << 20}),
}

LISTEN_ANY = "127.0.0.1:0"


def cluster_info(cluster_id: int, address: tuple[str, int]) -> dd.LLMClusterInfo:
    """An ``LLMClusterInfo`` that links from 127.0.0.1 to ``address`` of ``cluster_id``."""
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(address[0], address[1])
    return info


@contextlib.asynccontextmanager
async def linked_pair(
    options: Mapping[str, str] | None = None,
    *,
    prompt_cluster_id: int = 1,
    decoder_cluster_id: int = 2,
    prompt_options: Mapping[str, str] | None = None,
    decoder_options: Mapping[str, str] | None = None,
    timeout: int = 3000,
) -> AsyncIterator[tuple[dd.LLMDataDist, dd.LLMDataDist]]:
    """Run a PROMPT and a DECODER endpoint in this process, the decoder linked to the prompt;
    yield ``(prompt, decoder)`` and stop both on exit (even on error or cancellation).

    Both sides start with ``options`` (default :data:`DEFAULT_OPTIONS`) updated by their own
    ``prompt_options`` / ``decoder_options``; the prompt listens on ``127.0.0.1:0`` unless its
    options name ``llm.listenIpInfo``. Works on asyncio, uvloop and trio.

    Raises:
        LLMException: an endpoint failed to start (invalid options, pools, listen address).
        RuntimeError: the link failed (the message holds the status codes).
    """
    common = dict(DEFAULT_OPTIONS if options is None else options)
    p_opts = {"llm.listenIpInfo": LISTEN_ANY, **common, **(prompt_options or {})}
    d_opts = {**common, **(decoder_options or {})}
    async with (
        dd.LLMDataDist(dd.LLMRole.PROMPT, prompt_cluster_id).running(p_opts) as prompt,
        dd.LLMDataDist(dd.LLMRole.DECODER, decoder_cluster_id).running(d_opts) as decoder,
    ):
        address = prompt.listen_address
        if address is None:
            raise RuntimeError("the prompt endpoint does not listen (llm.listenIpInfo)")
        code, codes = await decoder.link_clusters(
            [cluster_info(prompt_cluster_id, address)], timeout
        )
        if code != dd.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"linking the pair failed: {code.name} {[c.name for c in codes]}")
        yield prompt, decoder
