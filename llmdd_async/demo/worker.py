"""A demo worker process (prefill, decode, or the monolithic reference), driven by JSON lines.

Started by :mod:`llmdd_async.demo.runner`; not meant to be run by hand.
"""

from __future__ import annotations

import base64
import sys
import time
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

import llmdd_async as dd
from llmdd_async._childproc import CommandServer, run_server
from llmdd_async.demo.model import ModelConfig, TinyTransformer

#: spare blocks beyond a request's needs, so block tables are a real, shuffled choice
SPARE_BLOCKS = 8


def b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.float32).tobytes()).decode()


class Worker(CommandServer):
    def __init__(self) -> None:
        self.stop = anyio.Event()
        self.dd: dd.LLMDataDist | None = None
        self.cache: dd.Cache | None = None
        self.kv: list[tuple[np.ndarray, np.ndarray]] = []
        self.model: TinyTransformer | None = None
        self.num_blocks = 0

    async def start(
        self,
        role: str,
        cluster_id: int,
        options: dict[str, str],
        model: dict[str, int],
        capacity_tokens: int,
    ) -> dict[str, Any]:
        config = ModelConfig(**model)
        self.model = await anyio.to_thread.run_sync(TinyTransformer, config)
        self.num_blocks = config.blocks_for(capacity_tokens) + SPARE_BLOCKS
        desc_shape = [self.num_blocks, *config.kv_block_shape]
        if role == "mono":
            self.kv = [
                (np.zeros(desc_shape, np.float32), np.zeros(desc_shape, np.float32))
                for _ in range(config.layers)
            ]
            return {"listen": None}
        self.dd = dd.LLMDataDist(
            dd.LLMRole.PROMPT if role == "prefill" else dd.LLMRole.DECODER, cluster_id
        )
        await self.start_endpoint(self.dd, options)
        cm = self.dd.cache_manager
        desc = dd.CacheDesc(2 * config.layers, desc_shape, dd.DataType.DT_FLOAT)
        self.cache = cm.allocate_blocks_cache(desc, dd.BlocksCacheKey(cluster_id, 0))
        t = self.cache.tensors
        self.kv = [(t[2 * i], t[2 * i + 1]) for i in range(config.layers)]
        return {"listen": self.dd.listen_address}

    async def link(self, cluster_id: int, ip: str, port: int) -> str:
        ci = dd.LLMClusterInfo()
        ci.remote_cluster_id = cluster_id
        ci.append_local_ip_info("127.0.0.1", 0)
        ci.append_remote_ip_info(ip, port)
        code, _ = await self.dd.link_clusters([ci], 5000)  # type: ignore[union-attr]
        if code != dd.LLMStatusCode.LLM_SUCCESS:
            raise dd.LLMException(f"link to cluster {cluster_id} failed: {code}", status_code=code)
        return str(self.dd.link_statistics(cluster_id).transport)  # type: ignore[union-attr]

    async def block_table(self, tokens: int, seed: int) -> list[int]:
        """A shuffled choice of physical blocks for a request of ``tokens`` tokens."""
        assert self.model is not None
        need = self.model.config.blocks_for(tokens)
        perm = np.random.default_rng(seed).permutation(self.num_blocks)
        return [int(b) for b in perm[:need]]

    async def prefill(
        self,
        prompt: list[int],
        table: list[int],
        dst_cluster: int | None,
        dst_table: list[int] | None,
        overlap: bool,
    ) -> dict[str, Any]:
        """Compute the prompt layer by layer; with a destination, stream its KV there
        (overlapped with compute, or only after the whole prefill when ``overlap`` is False)."""
        assert self.model is not None
        assert self.cache is not None
        assert self.dd is not None
        model, cm = self.model, self.dd.cache_manager
        layers = model.config.layers
        tokens = np.asarray(prompt, dtype=np.int64)
        nb = model.config.blocks_for(len(prompt))
        src_blocks, blocks_table = table[:nb], np.asarray(table, dtype=np.int64)
        events = dd.LayerEvents()
        compute: list[list[float]] = []
        t0 = time.perf_counter()
        task = None
        if dst_cluster is not None and overlap:
            task = self._start_push(cm, events, dst_cluster, src_blocks, dst_table, layers)

        def on_layer(i: int) -> None:
            now = time.perf_counter()
            compute[-1].append(now - t0)
            if overlap:
                events.layer_ready(i)
            if i + 1 < layers:
                compute.append([now - t0])

        def forward() -> np.ndarray:
            compute.append([time.perf_counter() - t0])
            return model.prefill(tokens, self.kv, blocks_table, on_layer=on_layer)

        logits = await anyio.to_thread.run_sync(forward)
        t_computed = time.perf_counter() - t0
        if dst_cluster is not None and not overlap:
            for i in range(layers):
                events.layer_ready(i)
            task = self._start_push(cm, events, dst_cluster, src_blocks, dst_table, layers)
        transfer = None
        if task is not None:
            await task
            stats = task.statistics()
            offset = stats.started - t0
            transfer = {
                "bytes": stats.bytes,
                "seconds": stats.seconds,
                "gbps": stats.gbps,
                "layers": [
                    [lt.layer, lt.ready + offset, lt.started + offset, lt.finished + offset]
                    for lt in stats.layers
                ],
                "landed": stats.seconds + offset,
            }
        return {
            "first_token": int(np.argmax(logits)),
            "logits": b64(logits),
            "compute": compute,
            "computed": t_computed,
            "transfer": transfer,
            "t0": t0,  # perf_counter at the prefill's start: one clock for every process
            "table": src_blocks,
        }

    def _start_push(
        self,
        cm: Any,
        events: dd.LayerEvents,
        dst_cluster: int,
        src_blocks: list[int],
        dst_table: list[int] | None,
        layers: int,
    ) -> Any:
        assert dst_table is not None
        cfg = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(dst_cluster, 0), range(0, layers), range(0, layers)
        )
        return cm.transfer_cache_async(
            self.cache, events, [cfg], src_blocks, dst_table[: len(src_blocks)]
        )

    async def decode(
        self,
        first_token: int,
        start_pos: int,
        steps: int,
        table: list[int],
        pull_from: int | None = None,
        src_table: list[int] | None = None,
    ) -> dict[str, Any]:
        """Generate ``steps`` tokens from the KV in ``table`` (pulled first when asked)."""
        assert self.model is not None
        model = self.model
        pull = None
        if pull_from is not None:
            assert self.dd is not None
            assert src_table is not None
            assert self.cache is not None
            nb = len(src_table)
            task = self.dd.cache_manager.pull_blocks(
                dd.BlocksCacheKey(pull_from, 0), self.cache, src_table, table[:nb]
            )
            await task
            stats = task.statistics()
            pull = {
                "bytes": stats.bytes,
                "seconds": stats.seconds,
                "gbps": stats.gbps,
                "started": stats.started,
            }
        t0 = time.perf_counter()
        tokens, logits = await anyio.to_thread.run_sync(
            model.generate,
            first_token,
            start_pos,
            steps,
            self.kv,
            np.asarray(table, dtype=np.int64),
        )
        return {
            "tokens": tokens,
            "logits": b64(logits[0]),
            "seconds": time.perf_counter() - t0,
            "pull": pull,
        }

    async def reference(self, prompt: list[int], steps: int, table: list[int]) -> dict[str, Any]:
        """The monolithic run: prefill and decode in this one process."""
        assert self.model is not None
        model, blocks = self.model, np.asarray(table, dtype=np.int64)

        def run() -> tuple[np.ndarray, list[int], list[np.ndarray], float]:
            t0 = time.perf_counter()
            logits = model.prefill(np.asarray(prompt, dtype=np.int64), self.kv, blocks)
            took = time.perf_counter() - t0
            first = int(np.argmax(logits))
            toks, outs = model.generate(first, len(prompt), steps, self.kv, blocks)
            return logits, [first, *toks], outs, took

        logits, tokens, outs, took = await anyio.to_thread.run_sync(run)
        return {
            "first_token": tokens[0],
            "logits": b64(logits),
            "tokens": tokens[1:],
            "decode_logits": b64(outs[0]),
            "prefill_seconds": took,
        }


def main() -> None:
    # The "model" computes in a Python thread here (on an accelerator it would not hold the
    # GIL): a short switch interval lets the event loop run the transfer between numpy calls.
    sys.setswitchinterval(0.0005)
    run_server(Worker())


if __name__ == "__main__":
    main()
