"""A torch endpoint in its own process (so its own torch / CUDA context), driven by JSON lines.

Started by :class:`gpu_kit.TorchPeer`; not meant to be run by hand. ``argv[1]`` is the torch
device of its caches (``cpu`` or ``cuda``). One ``{"id", "op", "args"}`` object per line on
stdin; one ``{"id", "ok", "result" | "error"}`` per line on the original stdout (anything else
the process prints goes to stderr, so it cannot corrupt the replies). Only public names of
llmdd_async are used.

Tensor ``i`` of a cache registered with ``seed=s`` holds the bytes ``pattern(s + i, nbytes)``
(``llmdd_async.testing.pattern``), so the parent computes the expected bytes on the host.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from typing import Any, TextIO

import anyio
import anyio.abc
import torch

import llmdd_async as dd
from llmdd_async.testing import pattern

DTYPES: dict[str, tuple[Any, dd.DataType]] = {
    "uint8": (torch.uint8, dd.DataType.DT_UINT8),
    "float16": (torch.float16, dd.DataType.DT_FLOAT16),
    "bfloat16": (torch.bfloat16, dd.DataType.DT_BF16),
}


class Endpoint:
    """One running LLMDataDist of this process and the caches registered on it."""

    def __init__(self, datadist: dd.LLMDataDist) -> None:
        self.dd = datadist
        self.stop = anyio.Event()
        # cache id -> the llmdd tensors (views into the allocated torch tensors)
        self.tensors: dict[int, list[Any]] = {}
        self.keep: dict[int, list[Any]] = {}


class Server:
    """The commands; each is ``await self.<op>(**args)``."""

    tg: anyio.abc.TaskGroup

    def __init__(self, device: str, out: TextIO) -> None:
        self.device = torch.device(device)
        self.out = out
        self.endpoints: dict[int, Endpoint] = {}
        self._next = 1

    async def start(self, role: str, cluster_id: int, options: dict[str, str]) -> list[Any]:
        """Start an endpoint; ``[handle, ip, port]``.

        Raises:
            LLMException / Exception: whatever starting it raised.
        """
        ep = Endpoint(dd.LLMDataDist(dd.LLMRole[role], cluster_id))
        started = anyio.Event()
        error: list[BaseException] = []

        async def run() -> None:
            try:
                async with ep.dd.running(options):
                    started.set()
                    await ep.stop.wait()
            except Exception as exc:
                error.append(exc)
                started.set()

        self.tg.start_soon(run)
        await started.wait()
        if error:
            raise error[0]
        handle, self._next = self._next, self._next + 1
        self.endpoints[handle] = ep
        addr = ep.dd.listen_address
        assert addr is not None
        return [handle, addr[0], addr[1]]

    async def stop(self, ep: int) -> None:
        self.endpoints.pop(ep).stop.set()

    async def register(
        self,
        ep: int,
        layout: str,
        num_blocks: int,
        block_shape: list[int],
        count: int,
        dtype: str = "uint8",
        model_id: int = 0,
        seed: int | None = None,
    ) -> int:
        """Allocate torch tensors on this process's device and register them as a blocks
        cache under ``BlocksCacheKey(own cluster, model_id)``, remote-accessible.

        ``layout="plain"``: ``count`` tensors ``[num_blocks, *block_shape]``. ``"flash"``:
        ``count`` layers as vLLM's FlashAttention allocates them, ``[2, num_blocks,
        *block_shape]`` with ``block_shape = [block_size, kv_heads, head_dim]``, K (``t[0]``)
        and V (``t[1]``) registered as two tensors per layer. Returns the cache id.
        """
        e = self.endpoints[ep]
        tdtype, ddtype = DTYPES[dtype]
        if layout == "plain":
            keep = [
                torch.zeros([num_blocks, *block_shape], dtype=tdtype, device=self.device)
                for _ in range(count)
            ]
            tensors = list(keep)
        elif layout == "flash":
            keep = [
                torch.zeros([2, num_blocks, *block_shape], dtype=tdtype, device=self.device)
                for _ in range(count)
            ]
            tensors = [kv for layer in keep for kv in (layer[0], layer[1])]
        else:
            raise ValueError(f"unknown layout {layout!r}")
        block_elems = 1
        for d in block_shape:
            block_elems *= d
        desc = dd.CacheDesc(len(tensors), [num_blocks, block_elems], ddtype)
        key = dd.BlocksCacheKey(e.dd.cluster_id, model_id)
        cache = e.dd.cache_manager.register_blocks_cache(desc, tensors, key, True)
        e.tensors[cache.cache_id], e.keep[cache.cache_id] = tensors, keep
        if seed is not None:
            for i, t in enumerate(tensors):
                flat = t.reshape(-1).view(torch.uint8)
                flat.copy_(torch.from_numpy(pattern(seed + i, flat.numel())))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return int(cache.cache_id)

    async def read(self, ep: int, cache_id: int, tensor: int, rows: list[int]) -> str:
        """The bytes of blocks ``rows`` (in that order) of tensor ``tensor``, base64."""
        t = self.endpoints[ep].tensors[cache_id][tensor]
        flat = t.reshape(t.shape[0], -1).view(torch.uint8)
        return base64.b64encode(flat[rows].cpu().numpy().tobytes()).decode()

    async def fill(self, ep: int, cache_id: int, value: int) -> None:
        for t in self.endpoints[ep].tensors[cache_id]:
            t.view(torch.uint8).fill_(value)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ plumbing
    async def serve(self) -> None:
        stdin = anyio.wrap_file(sys.stdin)
        async with anyio.create_task_group() as tg:
            self.tg = tg
            async for line in stdin:
                if not line.strip():
                    continue
                req = json.loads(line)
                if req["op"] == "exit":
                    for e in self.endpoints.values():
                        e.stop.set()
                    self._reply({"id": req["id"], "ok": True, "result": None})
                    break
                tg.start_soon(self._one, req)

    async def _one(self, req: dict[str, Any]) -> None:
        try:
            result = await getattr(self, req["op"])(**req.get("args", {}))
            reply: dict[str, Any] = {"id": req["id"], "ok": True, "result": result}
        except Exception as exc:
            code = getattr(exc, "status_code", None)
            reply = {
                "id": req["id"],
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "code": None if code is None else int(code),
            }
        self._reply(reply)

    def _reply(self, reply: dict[str, Any]) -> None:
        self.out.write(json.dumps(reply) + "\n")
        self.out.flush()


def main() -> None:
    # Replies own the original stdout; stray prints (of any library) go to stderr instead.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    server = Server(sys.argv[1], out)
    anyio.run(server.serve)


if __name__ == "__main__":
    main()
