"""``llmdd-async bench``: an installed benchmark with a real peer and same-run limits."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import llmdd_async as dd
from llmdd_async._doctor import cpu_idle
from llmdd_async._transports.nixl import available as nixl_available

#: NIXL over loopback, with cma between the processes of this host
UCX_LOOPBACK = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "cma,tcp,self"}
#: a Python that cannot import NIXL or Mooncake, as where they are not installed
_WITHOUT_PEERS = (
    "import sys\n"
    "for m in ('nixl', 'nixl_cu12', 'nixl_cu13', 'mooncake'): sys.modules[m] = None\n"
    "from llmdd_async._cli import main\n"
    "sys.exit(main(['bench', *sys.argv[1:]]))\n"
)
#: a tiny sweep: 16 KiB blocks, 1 and 2 per request, 1 and 2 in flight
_TINY = ("--block-kib", "16", "--blocks", "1,2", "--concurrency", "1,2", "--requests", "8")


def _bench(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, prog: str = ""
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", prog] if prog else [sys.executable, "-m", "llmdd_async", "bench"]
    return subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def _check_ratios(result: dict[str, Any]) -> None:
    """Every row's ratios are to the limit its transport is held against."""
    limits = result["limits"]
    for r in result["rows"]:
        assert r["requests"] >= 4 and r["req_per_s"] > 0 and 0 < r["p50_us"] <= r["p99_us"], r
        assert r["limit_gb_per_s"] == limits[f"{r['limit']}_gbps"] > 0
        if r["concurrency"] == 1:
            size = str(r["blocks"] * r["block_kib"] * 1024)
            assert abs(r["latency_ratio"] - r["p50_us"] / limits["floor_p50_us"][size]) < 1e-9
            assert r["bandwidth_ratio"] is None
        else:
            assert r["latency_ratio"] is None
            assert abs(r["bandwidth_ratio"] - r["gb_per_s"] / r["limit_gb_per_s"]) < 1e-9


def test_the_smallest_sweep_writes_rows_with_their_limits(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _bench(
        "--block-kib", "16", "--blocks", "1,2", "--concurrency", "1,4", "--requests", "8",
        "--ops", "pull,push", "--transports", "tcp", "--loops", "asyncio", "--json", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2  # ops x blocks per request x concurrency
    assert {(r["op"], r["blocks"], r["concurrency"]) for r in rows} == {
        (op, b, c) for op in ("pull", "push") for b in (1, 2) for c in (1, 4)
    }
    floors = result["limits"]["floor_p50_us"]
    assert set(floors) == {str(16 << 10), str(32 << 10)}  # one per size sent one at a time
    for r in rows:
        assert r["requests"] >= 4 and r["req_per_s"] > 0 and r["p50_us"] <= r["p99_us"]
        assert r["limit_gb_per_s"] == result["limits"]["raw_socket_gbps"] > 0
        assert r["mode"] == "remote-accessible"
        # CPU per request of both processes: a request costs each side something
        assert r["cpu_us"] > 0 and r["peer_cpu_us"] > 0
        if r["concurrency"] == 1:  # latency-bound: against the floor, not a bandwidth
            assert r["bandwidth_ratio"] is None
            size = str(r["blocks"] * r["block_kib"] * 1024)
            assert abs(r["latency_ratio"] - r["p50_us"] / floors[size]) < 1e-9
        else:
            assert r["latency_ratio"] is None
            assert abs(r["bandwidth_ratio"] - r["gb_per_s"] / r["limit_gb_per_s"]) < 1e-9
    meta = result["meta"]
    assert meta["version"] == dd.__version__ and meta["loops"] == ["asyncio"]
    assert meta["host"]["cpus"] == os.cpu_count() and meta["time"].endswith("+00:00")
    idle = cpu_idle()
    assert meta["host"]["cpu_idle"] == idle.detail
    # A machine whose idle CPUs slow every small request says so under the table, with the fix.
    said = [line for line in done.stdout.splitlines() if line.startswith("cpu-idle")]
    assert said == (
        [] if idle.state == "ok" else [f"cpu-idle {idle.state}: {idle.detail}; fix: {idle.fix}"]
    )
    assert "req_per_s" in done.stdout
    assert "ETA" not in done.stderr  # no progress bar where stderr is no terminal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # only what was asked


def test_both_modes_run_in_one_sweep(tmp_path: Path) -> None:
    """``--modes remote-accessible,default``: the same workload with and without
    llm.EnableRemoteCacheAccessible, each row naming its mode."""
    done = _bench(
        "--block-kib", "16", "--blocks", "1", "--concurrency", "1", "--requests", "8",
        "--ops", "pull,push", "--transports", "tcp", "--loops", "asyncio",
        "--modes", "remote-accessible,default", "--json", "-", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # pushes need remote-accessible mode (as upstream): default mode runs the pull only
    assert [(r["mode"], r["op"]) for r in result["rows"]] == [
        ("remote-accessible", "pull"),
        ("remote-accessible", "push"),
        ("default", "pull"),
    ]
    assert all(r["cpu_us"] > 0 and r["peer_cpu_us"] > 0 for r in result["rows"])
    assert result["meta"]["modes"] == ["remote-accessible", "default"]
    assert "peer_cpu_us" in done.stderr  # the table, on stderr with --json -


def test_tensors_split_each_block_and_every_row_says_over_how_many(tmp_path: Path) -> None:
    """``--tensors 2,8``: the same blocks split over two tensors, then over eight (a model's K
    and V of four layers: more, smaller ranges per request), each layout a row of its own."""
    done = _bench(
        "--block-kib", "16", "--tensors", "2,8", "--blocks", "1,2", "--concurrency", "1",
        "--requests", "8", "--ops", "pull", "--transports", "tcp,same-host",
        "--loops", "asyncio", "--modes", "default", "--json", "-", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert sorted((r["transport"], r["tensors"], r["blocks"]) for r in result["rows"]) == [
        (t, n, b) for t in ("same-host", "tcp") for n in (2, 8) for b in (1, 2)
    ]
    _check_ratios(result)  # (one floor per size: the layout does not change the bytes)
    assert result["meta"]["tensors"] == [2, 8]
    assert " tensors " in done.stderr.splitlines()[0]  # a column of the table


def test_json_to_stdout_and_no_file_unless_asked(tmp_path: Path) -> None:
    done = _bench(
        "--block-kib", "16", "--blocks", "1", "--concurrency", "1", "--requests", "4",
        "--ops", "pull", "--transports", "tcp", "--loops", "asyncio", "--json", "-",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["rows"]) == 1  # stdout is the JSON alone
    assert "req_per_s" in done.stderr  # the table went to stderr
    assert list(tmp_path.iterdir()) == []


def test_busy_poll_goes_to_both_endpoints_and_into_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = _bench(
        "--block-kib", "16", "--blocks", "1", "--concurrency", "1", "--requests", "4",
        "--ops", "pull", "--transports", "tcp", "--loops", "asyncio", "--json", "-",
        "--busy-poll", "300", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["meta"]["busy_poll_us"] == 300
    for bad in ("-5", "10001", "1e3"):
        refused = _bench("--busy-poll", bad)
        assert refused.returncode == 2 and "usage:" in refused.stderr, bad
    # Both ends get the option (this process's endpoint, and the peer's through its options).
    from llmdd_async.bench import runner

    seen: list[dict[str, str]] = []
    real_start = runner.PeerProcess.start

    def start(role: Any, cluster_id: int, options: dict[str, str], *a: Any, **k: Any) -> Any:
        seen.append(options)
        return real_start(role, cluster_id, options, *a, **k)

    monkeypatch.setattr(runner.PeerProcess, "start", start)
    real_running = dd.LLMDataDist.running

    def running(self: Any, options: dict[str, str]) -> Any:
        seen.append(options)
        return real_running(self, options)

    monkeypatch.setattr(dd.LLMDataDist, "running", running)
    args = runner.build_parser().parse_args(
        ["--block-kib", "16", "--blocks", "1", "--concurrency", "1", "--requests", "4",
         "--ops", "pull", "--transports", "tcp", "--loops", "asyncio", "--busy-poll", "250"]
    )  # fmt: skip
    rows = runner.run_on_loop(
        "asyncio", runner._measure, "tcp", "asyncio", "remote-accessible", args, lambda: None
    )
    assert rows and len(seen) == 2
    assert all(o["llm.BusyPoll"] == "250" for o in seen)


def test_pushes_alone_in_default_mode_are_refused_before_the_sweep(tmp_path: Path) -> None:
    done = _bench("--ops", "push", "--modes", "default", cwd=tmp_path)
    assert done.returncode == 2
    assert "pulls only" in done.stderr and "Traceback" not in done.stderr


_UNEVEN = "does not split a block of"


def test_outputs_and_memory_are_checked_before_the_sweep(tmp_path: Path) -> None:
    for bad, words in [
        (["--plot", str(tmp_path / "nope" / "x.png")], "no such directory"),
        (["--json", str(tmp_path)], "is a directory"),
        (["--plot", "-"], "needs a file name"),
        (["--block-kib", "1048576", "--blocks", "64", "--concurrency", "64"], "more than 50%"),
        (["--block-kib", "16,64", "--tensors", "2,3"], f"--tensors 3 {_UNEVEN} 16, 64 KiB"),
    ]:
        t0 = time.monotonic()
        done = _bench(*bad, cwd=tmp_path)
        assert done.returncode == 2, (bad, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert time.monotonic() - t0 < 30  # refused at once, not after a sweep
    assert list(tmp_path.iterdir()) == []


def test_bench_options_are_validated_and_documented() -> None:
    bad_args = (
        ["--blocks", "0"], ["--tensors", "0"], ["--ops", "copy"], ["--loops", "tokio"],
        ["--transports", "x"],
    )  # fmt: skip
    for bad in bad_args:
        done = _bench(*bad)
        assert done.returncode == 2 and "usage:" in done.stderr and "Traceback" not in done.stderr
    helptext = _bench("--help").stdout
    for option in ("--block-kib", "--tensors", "--concurrency", "--transports", "--plot", "--json"):
        assert option in helptext
    assert "default: [1, 64]" in helptext
    for transport in ("nixl", "nixl-raw", "mooncake-raw"):
        assert transport in helptext


@pytest.mark.skipif(
    not nixl_available() and os.environ.get("CI") != "true",
    reason="NIXL is not installed (pip install --no-deps nixl-cu12)",
)
def test_nixl_and_nixls_own_api_run_in_the_same_sweep_as_ours(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _bench(
        *_TINY, "--ops", "pull,push", "--transports", "tcp,nixl,nixl-raw",
        "--loops", "asyncio,uvloop", "--json", str(out), cwd=tmp_path, env=UCX_LOOPBACK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    points = {(op, b, c) for op in ("pull", "push") for b in (1, 2) for c in (1, 2)}
    for transport, loop, limit in [
        ("tcp", "asyncio", "raw_socket"),
        ("tcp", "uvloop", "raw_socket"),
        ("nixl", "asyncio", "memcpy"),  # UCX_TLS has cma: one host's memory is the limit
        ("nixl", "uvloop", "memcpy"),
        ("nixl-raw", "-", "memcpy"),  # the peer engine has no event loop: it runs once
    ]:
        rows = [r for r in result["rows"] if (r["transport"], r["loop"]) == (transport, loop)]
        assert sorted((r["op"], r["blocks"], r["concurrency"]) for r in rows) == sorted(points)
        assert {(r["limit"], r["block_kib"]) for r in rows} == {(limit, 16)}, transport
    assert len(result["rows"]) == 5 * len(points)
    _check_ratios(result)
    meta = result["meta"]
    assert meta["transports"] == ["tcp", "nixl", "nixl-raw"]
    assert meta["ucx"]["UCX_TLS"] == "cma,tcp,self"
    assert meta["engines"]["nixl"] == meta["engines"]["nixl-raw"]
    assert "nixl" in meta["engines"]["nixl-raw"] and "tcp" not in meta["engines"]
    for name in ("nixl-raw", "memcpy", "raw_socket"):
        assert name in done.stdout  # one table, ours and theirs


def test_a_transport_not_installed_is_refused_before_the_sweep(tmp_path: Path) -> None:
    # A Python where NIXL and Mooncake cannot be imported (sys.modules[name] = None, what an
    # absent package looks like to importlib), the rest of the sweep valid.
    for transport, words in [
        ("nixl", "pip install --no-deps nixl-cu12"),
        ("nixl-raw", "pip install --no-deps nixl-cu12"),
        ("mooncake-raw", "pip install mooncake-transfer-engine-non-cuda"),
    ]:
        t0 = time.monotonic()
        done = _bench(
            *_TINY, "--transports", f"tcp,{transport}", "--loops", "asyncio",
            "--json", str(tmp_path / "bench.json"), cwd=tmp_path, prog=_WITHOUT_PEERS,
        )  # fmt: skip
        assert done.returncode == 2, (transport, done.stderr)
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("llmdd-async bench: ")
        assert f"--transports {transport} needs" in done.stderr and words in done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""
        assert time.monotonic() - t0 < 30  # refused at once, not after a sweep
    assert list(tmp_path.iterdir()) == []  # no JSON: nothing ran


@pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="Mooncake is an optional peer, not installed "
    "(pip install mooncake-transfer-engine-non-cuda; Debian libibverbs1 librdmacm1 libnuma1)",
)
def test_mooncake_runs_in_the_same_sweep_as_ours(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _bench(
        *_TINY, "--ops", "pull,push", "--transports", "tcp,mooncake-raw", "--tensors", "2,4",
        "--loops", "asyncio", "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = [r for r in result["rows"] if r["transport"] == "mooncake-raw"]
    points = {
        (op, b, c, n) for op in ("pull", "push") for b in (1, 2) for c in (1, 2) for n in (2, 4)
    }
    assert {(r["op"], r["blocks"], r["concurrency"], r["tensors"]) for r in rows} == points
    assert {(r["loop"], r["limit"]) for r in rows} == {("-", "raw_socket")}  # TCP: the socket
    assert len(result["rows"]) == 2 * len(points)  # ours too, in the same run
    _check_ratios(result)
    assert "mooncake-transfer-engine" in result["meta"]["engines"]["mooncake-raw"]


@pytest.mark.parametrize(
    ("tls", "nixl_limit"),
    [
        (None, "memcpy"),  # UCX picks: shared memory or cma between processes of one host
        ("cma,tcp,self", "memcpy"),
        ("shm,tcp", "memcpy"),
        ("^ib", "memcpy"),
        ("tcp", "raw_socket"),
        ("tcp,self", "raw_socket"),
    ],
)
def test_each_transport_is_held_against_its_own_limit(
    tls: str | None, nixl_limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmdd_async.bench.runner import _limit_of

    if tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    assert _limit_of("nixl") == _limit_of("nixl-raw") == nixl_limit
    assert _limit_of("same-host") == "memcpy"
    assert _limit_of("tcp") == _limit_of("mooncake-raw") == "raw_socket"


@pytest.mark.parametrize("cpus", ["all", "one"])
def test_the_floor_runs_each_end_on_a_cpu_of_its_own_and_puts_the_caller_back(
    monkeypatch: pytest.MonkeyPatch, cpus: str
) -> None:
    from helpers import check_floor_ends, watch_floor_ends

    from llmdd_async.bench import limits

    before = os.sched_getaffinity(0)
    allowed = before if cpus == "all" else {min(before)}  # ("one": nothing to pin)
    os.sched_setaffinity(0, allowed)
    try:
        ours, theirs = watch_floor_ends(monkeypatch, limits)
        p50, p99 = limits.raw_rpc_us(4096, n=20)
        assert 0 < p50 <= p99
        check_floor_ends(ours, theirs, allowed)
    finally:
        os.sched_setaffinity(0, before)
