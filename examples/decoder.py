"""A decoder endpoint with the blocking facade: links to the prompt and pulls its blocks.

python examples/prompt.py --listen 127.0.0.1:26000
python examples/decoder.py --prompt 127.0.0.1:26000
"""

from __future__ import annotations

import argparse

import numpy as np

from llmdd_async.sync import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

PROMPT_ID, DECODER_ID, LAYERS, BLOCKS, BLOCK_SHAPE = 1, 2, 4, 64, (16, 8, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default="127.0.0.1:26000", help="the prompt's ip:port")
    args = parser.parse_args()
    ip, port = args.prompt.rsplit(":", 1)

    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.sync_kv_timeout = 5000
    datadist = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    datadist.init(config.generate_options())
    try:
        kv = [np.zeros((BLOCKS, *BLOCK_SHAPE), np.float16) for _ in range(2 * LAYERS)]
        desc = CacheDesc(len(kv), [BLOCKS, *BLOCK_SHAPE], DataType.DT_FLOAT16)
        cache = datadist.cache_manager.register_blocks_cache(desc, [t.ctypes.data for t in kv])

        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = PROMPT_ID
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info(ip, int(port))
        code, codes = datadist.link_clusters([cluster], 5000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"link failed: {code} {codes}")

        # The prompt's blocks 3, 4, 5 land in our blocks 10, 11, 12.
        datadist.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT_ID, 0), cache, [3, 4, 5], [10, 11, 12]
        )
        ok = all(bool((t[10:13] == i + 1).all()) for i, t in enumerate(kv))
        print(
            f"pulled 3 blocks x {len(kv)} tensors from {args.prompt}: "
            f"{'bytes match' if ok else 'MISMATCH'}"
        )
        datadist.unlink_clusters([cluster], 5000)
        raise SystemExit(0 if ok else 1)
    finally:
        datadist.finalize()


if __name__ == "__main__":
    main()
