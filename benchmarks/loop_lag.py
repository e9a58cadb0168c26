"""How long one hostile peer's requests hold an endpoint's event loop (issue 19, item 6).

A victim endpoint (cluster 1, TCP, remote-accessible mode) runs in this process with a
:class:`llmdd_async.testing.LoopLagProbe`, a thread that samples its RSS, and a legit peer
(cluster 2, in this process) that keeps pulling a small cache with a deadline. Each attack runs
in a child process (a raw peer speaking the wire protocol, so that its own work does not show
up in the victim's loop):

* ``none``: no attack (the machine's own lag: compare the others with it);
* ``reverse x8``: 8 requests of 129 KiB, each every block of an 80-tensor, 8192-block cache
  (16-byte blocks) in reverse order (655,360 descriptors that do not merge);
* ``blocks 48MiB``: one request naming 3,145,728 blocks of a one-tensor cache;
* ``tensors 4M``: one request whose initiator layout claims 4,194,304 tensors;
* ``table x200``: 200 table requests against 2000 registered caches;
* ``peer table x11``: the victim asks the attacker for its table (as a transfer on a new link
  does) and refreshes it ten times (as grants outside what it knew make it); each answer is
  a table of 7,000 caches (894 KiB of JSON).

Per attack: the probe's largest lag (wall ms, scheduling and GIL waits included: on a loaded
machine an upper bound) and the CPU time the loop's thread spent in that longest stretch
(``max_busy_ms``: the work done on the loop at a stretch), the RSS peak above the level before
the attack (MB, sampled by a thread every 2 ms), the victim's answers, and the legit pulls
(1 s deadline each) that failed. Run:
``python benchmarks/loop_lag.py [--attacks idle,reverse,blocks,tensors,table,peertable]
[--json PATH]``
(under a minute). Targets (benchmark, not test): max lag under 50 ms, no legit pull failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import anyio
import numpy as np
from _common import csv_of, parser, print_table, write_json

import llmdd_async as dd
from llmdd_async.testing import LoopLagProbe

ATTACKS = ("idle", "reverse", "blocks", "tensors", "table", "peertable")
BLOCKS, TENSORS, BB = 8192, 80, 16
TABLE_CACHES = 2000
#: tables the victim asks the attacker for (``peertable``), and the caches each lists
PEER_TABLES, PEER_TABLE_CACHES = 11, 7000
LEGIT_DEADLINE_MS = 1000


# ---------------------------------------------------------------------------- attacker (child)
def _request(
    req_id: int,
    cache_id: int,
    src: np.ndarray,
    dst: np.ndarray,
    local: Any,
    tb: int,
    count: int,
    **extra: Any,
) -> Any:
    from llmdd_async._protocol import MT, Message

    fields = {
        "op": "pull",
        "target": {"by": "cache_id", "cache_id": cache_id, "index": 0},
        "shape": "blocks",
        "layout": [tb, count, True],
        "caps": {},
        "timeout_ms": 20_000,
        **extra,
    }
    arrays = {
        "local_addrs": np.ascontiguousarray(local, "<u8"),
        "src_blocks": np.ascontiguousarray(src, "<u8"),
        "dst_blocks": np.ascontiguousarray(dst, "<u8"),
    }
    return Message(MT.XFER_REQ, req_id, fields, arrays)


async def _attack(name: str, port: int, info: dict[str, Any]) -> dict[str, Any]:
    import helpers

    from llmdd_async._messages import Grant, wire_status
    from llmdd_async._protocol import MT, Message, encode

    peer = await helpers.raw_link(("127.0.0.1", port), 66, remote_accessible=True)
    tb = BLOCKS * BB
    base = 1 << 40
    frames: list[bytes] = []
    if name == "reverse":
        local = base + np.arange(TENSORS, dtype=np.uint64) * np.uint64(tb)
        src = np.arange(BLOCKS - 1, -1, -1, dtype=np.uint64)
        dst = np.arange(BLOCKS, dtype=np.uint64)
        for i in range(8):
            frames.append(encode(_request(i + 1, info["c80"], src, dst, local, tb, BLOCKS)))
    elif name == "blocks":
        n = 3 << 20
        src = np.arange(n, dtype=np.uint64) % np.uint64(BLOCKS)
        frames.append(encode(_request(1, info["c1"], src, src, [base], tb, BLOCKS)))
    elif name == "tensors":
        local = base + np.arange(4 << 20, dtype=np.uint64) * np.uint64(tb)
        one = np.zeros(1, np.uint64)
        frames.append(
            encode(
                _request(
                    1, info["c80"], one, one, local, tb, BLOCKS, src_range=[0, 1], dst_range=[0, 1]
                )
            )
        )
    elif name == "peertable":
        return await _serve_tables(peer)
    else:
        frames = [encode(Message(MT.TABLE_REQ))] * 200
    t0 = time.monotonic()
    for f in frames:
        await peer.send_bytes(f)
    answers: dict[str, int] = {}
    want = {"reverse": 8, "table": 200}.get(name, 1)
    got = 0
    owed: dict[int, int] = {}
    try:
        with anyio.fail_after(60):
            while got < want or owed:
                msg = await peer.frame()
                if msg.type == MT.GRANT:
                    code = str(wire_status(msg).name)
                    answers[code] = answers.get(code, 0) + 1
                    got += 1
                    if code == "LLM_SUCCESS":
                        owed[msg.req_id] = Grant.decode(msg).total or 0
                elif msg.type == MT.DATA:
                    owed[msg.req_id] -= msg.payload_len
                    if owed[msg.req_id] <= 0:
                        del owed[msg.req_id]
                elif msg.type == MT.TABLE:
                    answers["TABLE"] = answers.get("TABLE", 0) + 1
                    got += 1
    except (EOFError, OSError) as exc:
        answers["closed"] = 1
        answers["why"] = repr(exc)  # type: ignore[assignment]
    peer.close()
    return {"answers": answers, "seconds": time.monotonic() - t0}


async def _serve_tables(peer: Any) -> dict[str, Any]:
    """Answer the victim's table requests with a big table (``peertable``)."""
    from llmdd_async._protocol import MT, Message, encode

    cache = {"tensor_bytes": 4096, "count": 1, "is_blocks": False, "remote_accessible": True}
    caches = [
        {**cache, "cache_id": i, "addrs": [(1 << 46) + i * 4096], "placement": 0}
        for i in range(PEER_TABLE_CACHES)
    ]
    table = encode(Message(MT.TABLE, 0, {"caches": caches, "blocks_keys": {}}))
    t0, sent = time.monotonic(), 0
    try:
        with anyio.fail_after(60):
            while sent < PEER_TABLES:
                msg = await peer.frame()
                if msg.type == MT.TABLE_REQ:
                    await peer.send_bytes(table)
                    sent += 1
                elif msg.type == MT.PING:
                    await peer.send(Message(MT.PONG))
    except (EOFError, OSError):
        pass
    peer.close()
    return {"answers": {"TABLE": sent}, "seconds": time.monotonic() - t0}


async def _ask_tables(v: dd.LLMDataDist) -> None:
    """The victim's side of ``peertable``: its table of the attacker, then refreshes."""
    links = v._engine.links.links
    with anyio.fail_after(30):
        while 66 not in links:
            await anyio.sleep(0.01)
    view = links[66].view
    await view.fetch_table(10)
    for _ in range(PEER_TABLES - 1):
        await view.refresh(10)


# ---------------------------------------------------------------------------- victim (parent)
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


class RssPeak:
    """A thread sampling this process's RSS every 2 ms (the loop may be held meanwhile)."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mb())

    def __enter__(self) -> RssPeak:
        self.peak = _rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


async def _legit(d: dd.LLMDataDist, cache_id: int, stop: anyio.Event, out: dict[str, Any]) -> None:
    cm = d.cache_manager
    mine = cm.allocate_cache(dd.CacheDesc(1, [1, 4096], dd.DataType.DT_UINT8))
    try:
        while not stop.is_set():
            t = time.monotonic()
            task = cm.pull_cache(dd.CacheKeyByIdAndIndex(1, cache_id, 0), mine)
            code = await task.synchronize(LEGIT_DEADLINE_MS)
            out["pulls"] += 1
            out["worst_ms"] = max(out["worst_ms"], (time.monotonic() - t) * 1e3)
            if code != dd.LLMStatusCode.LLM_SUCCESS:
                out["failed"] += 1
            await anyio.sleep(0.01)
    finally:
        cm.deallocate_cache(mine)


async def victim(attacks: list[str]) -> list[dict[str, Any]]:
    pool = json.dumps({"memory_size": 256 << 20, "page_shift": 16})
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": pool,
        "llm.Transport": "tcp",
        "llm.listenIpInfo": "127.0.0.1:0",
    }
    rows = []
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as v:
        cm = v.cache_manager
        c80 = cm.allocate_blocks_cache(dd.CacheDesc(TENSORS, [BLOCKS, BB], dd.DataType.DT_UINT8))
        c1 = cm.allocate_blocks_cache(dd.CacheDesc(1, [BLOCKS, BB], dd.DataType.DT_UINT8))
        small = cm.allocate_cache(dd.CacheDesc(1, [1, 4096], dd.DataType.DT_UINT8))
        keep = []
        if "table" in attacks:
            for _ in range(TABLE_CACHES):
                arr = np.zeros(64, np.uint8)
                keep.append(
                    cm.register_cache(dd.CacheDesc(1, [1, 64], dd.DataType.DT_UINT8), [arr])
                )
        info = {"c80": c80.cache_id, "c1": c1.cache_id}
        address = v.listen_address
        assert address is not None
        port = address[1]
        import helpers

        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            helpers.endpoint_options("tcp", ra=True)
        ) as legit:
            await helpers.link(legit, 1, ("127.0.0.1", port))
            for name in attacks:
                gc.collect()
                await anyio.sleep(0.2)
                stop = anyio.Event()
                stats = {"pulls": 0, "failed": 0, "worst_ms": 0.0}
                probe = LoopLagProbe()
                with RssPeak() as rss:
                    before = rss.peak
                    async with probe.running(), anyio.create_task_group() as tg:
                        tg.start_soon(_legit, legit, small.cache_id, stop, stats)
                        if name == "idle":
                            await anyio.sleep(2)
                            text = ['{"answers": {}}']
                        else:
                            if name == "peertable":
                                tg.start_soon(_ask_tables, v)
                            out = await anyio.run_process(
                                [
                                    sys.executable,
                                    __file__,
                                    "--attacker",
                                    name,
                                    "--port",
                                    str(port),
                                    "--info",
                                    json.dumps(info),
                                ],
                                stderr=subprocess.STDOUT,
                                check=False,
                            )
                            text = out.stdout.decode().strip().splitlines()
                            if out.returncode:
                                text.append(json.dumps({"answers": {"error": text[-3:]}}))
                        stop.set()
                result = json.loads(text[-1])
                hostile = v._engine.links.links.pop(66, None)  # its cluster id, free again
                if hostile is not None and hostile.broken is not None:
                    result["answers"]["victim_saw"] = repr(hostile.broken)[:80]
                rows.append(
                    {
                        "attack": {
                            "idle": "none (baseline)",
                            "reverse": "reverse x8",
                            "blocks": "blocks 48MiB",
                            "tensors": "tensors 4M",
                            "table": "table x200",
                            "peertable": f"peer table x{PEER_TABLES}",
                        }[name],
                        "max_lag_ms": probe.max_lag_ms,
                        "max_busy_ms": probe.max_busy_ms,
                        "rss_peak_mb": rss.peak - before,
                        "answers": json.dumps(result["answers"], sort_keys=True),
                        "legit_pulls": stats["pulls"],
                        "legit_failed": stats["failed"],
                        "legit_worst_ms": stats["worst_ms"],
                    }
                )
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "loop_lag")
    p.add_argument(
        "--attacks",
        type=csv_of(*ATTACKS),
        default=list(ATTACKS),
        help="attacks to run, comma-separated",
    )
    p.add_argument("--attacker", choices=ATTACKS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--info", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.attacker:
        print(json.dumps(anyio.run(_attack, args.attacker, args.port, json.loads(args.info))))
        return
    rows = anyio.run(victim, args.attacks)
    cols = [
        "attack",
        "max_lag_ms",
        "max_busy_ms",
        "rss_peak_mb",
        "answers",
        "legit_pulls",
        "legit_failed",
        "legit_worst_ms",
    ]
    print_table(
        "loop lag of the victim while one peer attacks (target: max lag < 50 ms)", rows, cols
    )
    path = write_json("loop_lag", {"rows": rows}, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
