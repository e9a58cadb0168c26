"""``llmdd-async bench``: an installed benchmark with a real peer and same-run limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import llmdd_async as dd


def _bench(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmdd_async", "bench", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


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
    assert "req_per_s" in done.stdout
    assert "ETA" not in done.stderr  # no progress bar where stderr is no terminal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # only what was asked


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


def test_outputs_and_memory_are_checked_before_the_sweep(tmp_path: Path) -> None:
    for bad, words in [
        (["--plot", str(tmp_path / "nope" / "x.png")], "no such directory"),
        (["--json", str(tmp_path)], "is a directory"),
        (["--plot", "-"], "needs a file name"),
        (["--block-kib", "1048576", "--blocks", "64", "--concurrency", "64"], "more than 50%"),
    ]:
        t0 = time.monotonic()
        done = _bench(*bad, cwd=tmp_path)
        assert done.returncode == 2, (bad, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert time.monotonic() - t0 < 30  # refused at once, not after a sweep
    assert list(tmp_path.iterdir()) == []


def test_bench_options_are_validated_and_documented() -> None:
    for bad in (["--blocks", "0"], ["--ops", "copy"], ["--loops", "tokio"]):
        done = _bench(*bad)
        assert done.returncode == 2 and "usage:" in done.stderr and "Traceback" not in done.stderr
    helptext = _bench("--help").stdout
    for option in ("--block-kib", "--concurrency", "--transports", "--plot", "--json"):
        assert option in helptext
    assert "default: [1, 64]" in helptext
