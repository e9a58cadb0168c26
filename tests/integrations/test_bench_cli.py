"""``llmdd-async bench``: an installed benchmark with a real peer and same-run limits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmdd_async", "bench", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_the_smallest_sweep_writes_rows_with_their_limits(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _bench(
        "--block-kib", "16", "--blocks", "1,2", "--concurrency", "1,4", "--requests", "8",
        "--ops", "pull,push", "--transports", "tcp", "--loops", "asyncio", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2  # ops x blocks per request x concurrency
    assert {(r["op"], r["blocks"], r["concurrency"]) for r in rows} == {
        (op, b, c) for op in ("pull", "push") for b in (1, 2) for c in (1, 4)
    }
    for r in rows:
        assert r["requests"] >= 4 and r["req_per_s"] > 0 and r["p50_us"] <= r["p99_us"]
        assert r["limit_gbps"] == result["limits"]["raw_socket_gbps"] > 0
        assert abs(r["ratio"] - r["gbps"] / r["limit_gbps"]) < 1e-9
    assert "req_per_s" in done.stdout and "/8" in done.stderr  # the table, the progress bar


def test_bench_options_are_validated_and_documented() -> None:
    for bad in (["--blocks", "0"], ["--ops", "copy"], ["--loops", "tokio"]):
        done = _bench(*bad)
        assert done.returncode == 2 and "usage:" in done.stderr and "Traceback" not in done.stderr
    helptext = _bench("--help").stdout
    for option in ("--block-kib", "--concurrency", "--transports", "--plot", "--json"):
        assert option in helptext
    assert "default: [1, 64]" in helptext
