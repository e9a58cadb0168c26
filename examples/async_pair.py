"""Two endpoints over the async API in one program: ``pull_blocks``, then a layer-wise push.

    python examples/async_pair.py [--loop asyncio|uvloop|trio]

A prompt endpoint listens on 127.0.0.1 (any free port) and a decoder endpoint links to it.
The decoder pulls three prefilled blocks with ``pull_blocks``. Then the prompt runs a
"forward pass" over more tokens and streams each layer's K and V blocks to the decoder with
``transfer_cache_async`` as soon as its ``AsyncLayerSynchronizer`` says the layer is computed.
Both transfers are checked byte for byte; the exit status is 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

import anyio
import anyio.lowlevel
import numpy as np

import llmdd_async as dd

PROMPT_ID, DECODER_ID = 1, 2
LAYERS, BLOCKS, BLOCK_SHAPE = 4, 64, (16, 8, 64)  # 16 tokens x 8 heads x 64 dims per block
OPTIONS = {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"}


class ForwardPass(dd.AsyncLayerSynchronizer):
    """Layer ``i`` may be sent once the forward pass set ``ready[i]``."""

    def __init__(self, layers: int) -> None:
        self.ready = [anyio.Event() for _ in range(layers)]

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Wait for the layer; False (the transfer aborts) if ``timeout_in_millis`` passes."""
        with anyio.move_on_after(None if timeout_in_millis is None else timeout_in_millis / 1000):
            await self.ready[layer_index].wait()
            return True
        return False


def kv_arrays() -> list[np.ndarray]:
    """One tensor per layer for K and one for V, ``[L0K, L0V, L1K, ...]``, dim 0 = blocks."""
    return [np.zeros((BLOCKS, *BLOCK_SHAPE), np.float16) for _ in range(2 * LAYERS)]


def link_info(cluster_id: int, address: tuple[str, int]) -> dd.LLMClusterInfo:
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*address)
    return info


async def main() -> bool:
    """Run both transfers; True if every byte arrived as sent.

    Raises:
        LLMException: a transfer failed.
        RuntimeError: linking failed.
    """
    desc = dd.CacheDesc(2 * LAYERS, [BLOCKS, *BLOCK_SHAPE], dd.DataType.DT_FLOAT16)
    prompt_kv, decoder_kv = kv_arrays(), kv_arrays()
    prompt_options = {**OPTIONS, "llm.listenIpInfo": "127.0.0.1:0"}
    async with (
        dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT_ID).running(prompt_options) as prompt,
        dd.LLMDataDist(dd.LLMRole.DECODER, DECODER_ID).running(OPTIONS) as decoder,
    ):
        assert prompt.listen_address is not None
        code, codes = await decoder.link_clusters([link_info(PROMPT_ID, prompt.listen_address)])
        if code != dd.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed: {code} {codes}")
        src = prompt.cache_manager.register_blocks_cache(
            desc, prompt_kv, dd.BlocksCacheKey(PROMPT_ID, 0)
        )
        dst = decoder.cache_manager.register_blocks_cache(
            desc, decoder_kv, dd.BlocksCacheKey(DECODER_ID, 0)
        )

        # 1. The decoder pulls the prompt's blocks 3, 4, 5 into its blocks 10, 11, 12.
        for i, t in enumerate(prompt_kv):
            t[3:6] = i + 1
        await decoder.cache_manager.pull_blocks(
            dd.BlocksCacheKey(PROMPT_ID, 0), dst, [3, 4, 5], [10, 11, 12]
        )
        pairs = list(zip(prompt_kv, decoder_kv, strict=True))
        pulled = all(np.array_equal(d[10:13], s[3:6]) for s, d in pairs)
        print(f"pull_blocks: 3 blocks x {len(prompt_kv)} tensors, bytes match: {pulled}")

        # 2. The prompt computes blocks 20, 21 layer by layer; each layer goes out as soon as
        #    it is ready, into the decoder's blocks 30, 31, while the next layer computes.
        forward = ForwardPass(LAYERS)
        config = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(DECODER_ID, 0), range(LAYERS), range(LAYERS)
        )
        task = prompt.cache_manager.transfer_cache_async(
            src, forward, [config], [20, 21], [30, 31]
        )  # already running: it waits for layer 0
        for layer in range(LAYERS):
            for t in prompt_kv[2 * layer : 2 * layer + 2]:
                t[20:22] = np.random.default_rng(layer).standard_normal(t[20:22].shape)
            forward.ready[layer].set()
            await anyio.lowlevel.checkpoint()  # a real model would await its device here
        await task  # raises LLMException on failure
        streamed = all(np.array_equal(d[30:32], s[20:22]) for s, d in pairs)
        stats = task.statistics()
        print(
            f"transfer_cache_async: {LAYERS} layers, {stats.bytes} bytes, bytes match: {streamed}"
        )
    return pulled and streamed


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    args = parser.parse_args()
    if args.loop == "trio":
        ok = anyio.run(main, backend="trio")
    else:
        ok = anyio.run(main, backend_options={"use_uvloop": args.loop == "uvloop"})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    run()
