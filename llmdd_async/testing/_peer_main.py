"""A scriptable endpoint in its own process: JSON commands on stdin, JSON replies on stdout.

Started by :class:`llmdd_async.testing.PeerProcess`; not meant to be run by hand.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

import llmdd_async as dd
from llmdd_async._childproc import CommandServer, run_server
from llmdd_async.bench.timeline import SocketStamps
from llmdd_async.testing import decode_key, options_of, pattern, wait_link_down


class Peer(CommandServer):
    def __init__(self) -> None:
        self.dd: dd.LLMDataDist | None = None
        self.caches: dict[int, dd.Cache] = {}
        self.keep: dict[int, list[np.ndarray]] = {}
        self.tasks: dict[int, dd.CacheTask] = {}
        self.stop = anyio.Event()
        self.stamps = SocketStamps()

    # Commands -------------------------------------------------------------------
    async def start(self, role: int, cluster_id: int, options: dict[str, str]) -> Any:
        self.dd = dd.LLMDataDist(dd.LLMRole(role), cluster_id)
        await self.start_endpoint(self.dd, options)
        self.legacy = not options_of(self.dd).cache_manager
        return self.dd.listen_address

    @property
    def manager(self) -> Any:
        """The endpoint's manager: kv_cache_manager in legacy mode, else cache_manager."""
        assert self.dd is not None
        return self.dd.kv_cache_manager if self.legacy else self.dd.cache_manager

    def _desc(self, a: dict[str, Any]) -> dd.CacheDesc:
        return dd.CacheDesc(
            a["num_tensors"],
            a["shape"],
            dd.DataType[a.get("dtype", "DT_UINT8")],
            dd.Placement[a.get("placement", "DEVICE")],
        )

    def _fill(self, cache: dd.Cache, seed: int | None) -> None:
        if seed is None:
            return
        for i, t in enumerate(cache.tensors):
            t.reshape(-1).view(np.uint8)[:] = pattern(seed + i, t.nbytes)

    async def alloc(self, **a: Any) -> int:
        cm = self.manager
        desc = self._desc(a)
        if a.get("kind") == "blocks":
            key = decode_key(a.get("blocks_key"))
            cache = cm.allocate_blocks_cache(desc, key)
        else:
            cache = cm.allocate_cache(desc, [decode_key(k) for k in a.get("keys", [])])
        self.caches[cache.cache_id] = cache
        self._fill(cache, a.get("seed"))
        return cache.cache_id

    async def register(self, **a: Any) -> int:
        cm = self.dd.cache_manager  # type: ignore[union-attr]
        desc = self._desc(a)
        arrays = [np.zeros(desc.size, np.uint8) for _ in range(desc.num_tensors)]
        ra = a.get("remote_accessible")
        if a.get("kind") == "blocks":
            cache = cm.register_blocks_cache(desc, arrays, decode_key(a.get("blocks_key")), ra)
        else:
            keys = [decode_key(k) for k in a.get("keys", [])]
            cache = cm.register_cache(desc, arrays, keys, ra)
        self.caches[cache.cache_id] = cache
        self.keep[cache.cache_id] = arrays
        self._fill(cache, a.get("seed"))
        return cache.cache_id

    async def fill(self, cache_id: int, seed: int) -> None:
        self._fill(self.caches[cache_id], seed)

    async def read(self, cache_id: int, tensor: int) -> str:
        t = self.caches[cache_id].tensors[tensor]
        return base64.b64encode(t.tobytes()).decode()

    async def comm_link(self, comm_name: str, ranks: dict[str, int], rank_table: str) -> int:
        info = {int(k): v for k, v in ranks.items()}
        return await self.dd.link(comm_name, info, rank_table)  # type: ignore[union-attr]

    async def comm_status(self, comm_id: int) -> str:
        return self.dd.query_register_mem_status(comm_id).name  # type: ignore[union-attr]

    async def comm_unlink(self, comm_id: int) -> None:
        await self.dd.unlink(comm_id)  # type: ignore[union-attr]

    async def addrs(self, cache_id: int) -> list[int]:
        return self.caches[cache_id].tensor_addrs

    async def cpu_seconds(self) -> float:
        """This process's CPU time so far (user and system, every thread), for benchmarks
        that report what a request costs both sides."""
        return time.process_time()

    async def stamp_sockets(self, on: bool) -> list[list[Any]] | None:
        """Start (``on``) or stop stamping this process's socket calls, for benchmarks that
        split a request's time between the processes (:mod:`llmdd_async.bench.timeline`);
        stopping returns the stamps."""
        if on:
            self.stamps.start()
            return None
        return [list(e) for e in self.stamps.stop()]

    async def digest(self, cache_id: int) -> list[str]:
        return [hashlib.sha256(t.tobytes()).hexdigest() for t in self.caches[cache_id].tensors]

    async def link(self, cluster_id: int, ip: str, port: int, timeout_ms: int = 3000) -> Any:
        ci = dd.LLMClusterInfo()
        ci.remote_cluster_id = cluster_id
        ci.append_local_ip_info("127.0.0.1", 0)
        ci.append_remote_ip_info(ip, port)
        code, codes = await self.dd.link_clusters([ci], timeout_ms)  # type: ignore[union-attr]
        return [int(code), [int(c) for c in codes]]

    async def unlink(self, cluster_id: int, force: bool = False, timeout_ms: int = 3000) -> Any:
        ci = dd.LLMClusterInfo()
        ci.remote_cluster_id = cluster_id
        code, codes = await self.dd.unlink_clusters([ci], timeout_ms, force)  # type: ignore
        return [int(code), [int(c) for c in codes]]

    async def call(
        self, method: str, args: list[Any], kwargs: dict[str, Any], wait: bool = True
    ) -> Any:
        """Run a CacheManager method; caches and keys given as {"cache": id} / {"key": ...}."""
        cm = self.manager

        def conv(v: Any) -> Any:
            if isinstance(v, dict) and "cache" in v:
                return self.caches[v["cache"]]
            if isinstance(v, dict) and "key" in v:
                return decode_key(v["key"])
            if isinstance(v, dict) and "range" in v:
                return range(*v["range"])
            return v

        result = getattr(cm, method)(
            *[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()}
        )
        if isinstance(result, dd.CacheTask):
            if not wait:
                self.tasks[id(result)] = result
                return id(result)
            return await _status_of(result)
        if isinstance(result, dd.Cache):
            self.caches[result.cache_id] = result
            return result.cache_id
        return None

    async def wait_link_down(self, cluster_id: int, timeout_s: float = 5) -> None:
        """Return once this endpoint's link to ``cluster_id`` is down or gone.

        Raises:
            TimeoutError: still alive after ``timeout_s``.
        """
        assert self.dd is not None
        await wait_link_down(self.dd, cluster_id, timeout_s)

    async def link_statistics(self, cluster_id: int) -> dict[str, Any]:
        """The link's transport, transfer count, bytes and recent transfers (each ``op``,
        ``mode``, ``nbytes`` and ``seconds``).

        Raises:
            LLMException: LLM_NOT_YET_LINK without a link to ``cluster_id``.
        """
        s = self.dd.link_statistics(cluster_id)  # type: ignore[union-attr]
        recent = [
            {"op": r.op, "mode": r.mode, "nbytes": r.nbytes, "seconds": r.finished - r.started}
            for r in s.recent
        ]
        return {
            "transport": s.transport,
            "transfers": s.transfers,
            "bytes": s.bytes,
            "recent": recent,
        }

    async def mooncake_entry(self) -> dict[str, Any] | None:
        """This endpoint's Mooncake entry as a linked peer fetches it (its engine's ``host``,
        ``port``, ``instance``, ...), or None (no Mooncake engine, or it does not listen)."""
        from .._transports.mooncake import MooncakeEndpoint

        engine = self.dd._engine  # type: ignore[union-attr]
        ep = None if engine is None else engine.transport_endpoint
        return ep.table_entry() if isinstance(ep, MooncakeEndpoint) else None

    async def link_failure(self, cluster_id: int) -> str | None:
        """Why the last link to ``cluster_id`` failed or broke, or None."""
        return self.dd.link_failure(cluster_id)  # type: ignore[union-attr]

    async def transfer_layers(
        self,
        cache_id: int,
        blocks_key: list[Any],
        src_blocks: list[int],
        dst_blocks: list[int],
        fill_seed: int | None = None,
        compute_s: float = 0.0,
    ) -> dict[str, Any]:
        """``transfer_cache_async`` of every layer (K and V: 2 tensors) of a blocks cache to
        the peer's ``blocks_key``, signalled through ``LayerEvents`` layer by layer as a
        forward pass would; with ``fill_seed``, layer ``i``'s tensors are filled from it just
        before layer ``i`` is signalled (so only a layer-wise send can carry those bytes);
        ``compute_s``: each layer "computes" that long first (a sleep, as an accelerator's
        forward pass leaves the CPU free). Its status code (0 on success), per-config results,
        the layers moved, ``exposed_s`` (last layer signalled -> transfer done) and
        ``total_s``."""
        cache = self.caches[cache_id]
        layers = len(cache.tensors) // 2
        cfg = dd.TransferWithCacheKeyConfig(decode_key(blocks_key), range(layers), range(layers))
        events = dd.LayerEvents()
        cm = self.dd.cache_manager  # type: ignore[union-attr]
        t0 = time.perf_counter()
        task = cm.transfer_cache_async(cache, events, [cfg], src_blocks, dst_blocks)
        for layer in range(layers):
            if compute_s:
                await anyio.sleep(compute_s)
            if fill_seed is not None:
                for t in (2 * layer, 2 * layer + 1):
                    arr = cache.tensors[t].reshape(-1).view(np.uint8)
                    arr[:] = pattern(fill_seed + t, arr.nbytes)
            events.layer_ready(layer)
            await anyio.lowlevel.checkpoint()  # the next layer computes while this one moves
        signalled = time.perf_counter()
        status = await _status_of(task)
        done = time.perf_counter()
        results = await task.get_results()
        return {
            "status": status,
            "results": [None if r is None else int(r) for r in results],
            "layers": [lt.layer for lt in task.statistics().layers],
            "exposed_s": done - signalled,
            "total_s": done - t0,
        }

    async def wait_task(self, task: int) -> int:
        return await _status_of(self.tasks.pop(task))


async def _status_of(task: dd.CacheTask) -> int:
    """Await ``task``; its status code (0 for success)."""
    try:
        await task
    except dd.LLMException as exc:
        return int(exc.status_code)
    return 0


def main() -> None:
    run_server(Peer())
    # Its endpoint is finalized and its replies sent: end now. Native engines' teardown at
    # interpreter exit (a Mooncake engine holds the GIL for about a second) would only keep
    # the parent waiting for a process that has nothing left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
