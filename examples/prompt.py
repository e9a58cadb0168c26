"""A prompt (prefill) endpoint with the blocking facade, for two terminals.

    python examples/prompt.py --listen 127.0.0.1:26000
    python examples/decoder.py --prompt 127.0.0.1:26000

The prompt registers a paged KV cache (what serving engines do at start-up), fills a few
blocks, and waits for the decoder to pull them. Code written for ``llm_datadist`` looks exactly
like this with its import changed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
)

PROMPT_ID, LAYERS, BLOCKS, BLOCK_SHAPE = 1, 4, 64, (16, 8, 64)  # 16 tokens x 8 heads x 64 dims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:26000", help="ip:port to listen on")
    parser.add_argument("--seconds", type=float, default=60, help="how long to serve")
    args = parser.parse_args()

    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.listen_ip_info = args.listen
    config.sync_kv_timeout = 5000
    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    datadist.init(config.generate_options())

    # One tensor per layer for K and one for V, [L0K, L0V, L1K, ...], dim 0 = blocks.
    kv = [np.zeros((BLOCKS, *BLOCK_SHAPE), np.float16) for _ in range(2 * LAYERS)]
    desc = CacheDesc(len(kv), [BLOCKS, *BLOCK_SHAPE], DataType.DT_FLOAT16)
    datadist.cache_manager.register_blocks_cache(
        desc, [t.ctypes.data for t in kv], BlocksCacheKey(PROMPT_ID, 0)
    )
    for i, t in enumerate(kv):  # "prefill": blocks 3, 4 and 5 of every tensor
        t[3:6] = i + 1
    print(f"prompt {PROMPT_ID} serving on {args.listen}: blocks 3-5 are filled", flush=True)
    try:
        time.sleep(args.seconds)
    finally:
        datadist.finalize()


if __name__ == "__main__":
    main()
