"""The benchmark programs' command lines: every option documented, small configurations run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from llmdd_async._doctor import cpu_idle

BENCH = REPO / "benchmarks"

#: Prints, for every benchmark, each option's (dest, help, default).
_DESCRIBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
out = {}
for name in ("plan", "throughput", "layerwise", "nixl_overhead", "small_requests"):
    mod = __import__(name)
    p = mod.build_parser()
    out[name] = [
        [a.dest, a.help, a.default, p.formatter_class.__name__]
        for a in p._actions if a.option_strings and a.dest != "help"
    ]
print(json.dumps(out))
"""


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_every_benchmark_option_has_help_and_a_default() -> None:
    out = _bench("-c", _DESCRIBE, str(BENCH))
    assert out.returncode == 0, out.stderr
    described = json.loads(out.stdout)
    assert set(described) == {"plan", "throughput", "layerwise", "nixl_overhead", "small_requests"}
    for name, options in described.items():
        assert {o[0] for o in options} >= {"json", "repeat"}, name
        for dest, help_text, default, formatter in options:
            assert help_text, (name, dest)
            assert default is not None, (name, dest)
            assert formatter == "ArgumentDefaultsHelpFormatter", name


@pytest.mark.parametrize(
    "args",
    [
        ["--layer-mib", "0"],
        ["--layer-kib", "1536"],
        ["--layers", "-1"],
        ["--ratios", "1,-2"],
        ["--transports", "tcp,udp"],
        ["--repeat", "x"],
        ["--compute", "gpu"],
    ],
)
def test_bad_layerwise_options_are_usage_errors(args: list[str]) -> None:
    out = _bench(str(BENCH / "layerwise.py"), *args)
    assert out.returncode == 2
    assert "usage:" in out.stderr and "Traceback" not in out.stderr


def test_layerwise_helpers() -> None:
    # The benchmark pins BLAS thread counts in os.environ at import; that must not leak into
    # later tests' child processes (their numpy would then round differently from this one).
    saved = dict(os.environ)
    sys.path.insert(0, str(BENCH))
    try:
        import layerwise
    finally:
        sys.path.remove(str(BENCH))
        os.environ.clear()
        os.environ.update(saved)
    for mib in (1, 2, 3, 8):
        blocks = layerwise.layer_blocks(mib)
        assert blocks >= 1
        assert 2 * blocks * layerwise.BLOCK == mib << 20  # exactly the asked size
    with pytest.raises(ValueError):
        layerwise.layer_blocks(0)
    assert layerwise.layer_geometry(64 << 10) == (1, 32 << 10)  # small: a block per tensor
    assert layerwise.layer_geometry(8 << 20) == (8, layerwise.BLOCK)
    for bad in (0, 3, 3 * layerwise.BLOCK):
        with pytest.raises(ValueError):
            layerwise.layer_geometry(bad)
    assert layerwise.hidden_percent(exposed=3.0, after_prefill=2.0) == 0.0  # not negative
    assert layerwise.hidden_percent(exposed=0.5, after_prefill=2.0) == 75.0
    assert layerwise.hidden_percent(exposed=-0.1, after_prefill=2.0) == 100.0
    assert layerwise.hidden_percent(exposed=1.0, after_prefill=0.0) == 0.0


@pytest.mark.parametrize("compute", ["cpu", "device"])
def test_smallest_layerwise_run(tmp_path: Path, compute: str) -> None:
    result = tmp_path / "layerwise.json"
    out = _bench(
        str(BENCH / "layerwise.py"),
        *("--layers", "2", "--layer-mib", "1", "--ratios", "0.5", "--compute", compute),
        *("--transports", "tcp", "--repeat", "1", "--json", str(result)),
    )
    assert out.returncode == 0, out.stderr
    written = json.loads(result.read_text())
    (row,) = written["rows"]
    # how idle CPUs wait, as `llmdd-async doctor` reads it: it moves small requests' latency
    assert written["machine"]["cpu_idle"] == cpu_idle().detail
    assert row["KiB/layer"] == 1024 and row["layers"] == 2 and row["compute"] == compute
    assert 0.0 <= row["hidden %"] <= 100.0
    assert row["transfer CPU us/layer"] > 0  # a transfer costs its process some CPU
    # the same pace's floor, measured in the run: a raw send from a loop woken once a layer
    assert row["paced floor CPU us/layer"] > 0
    assert row["CPU / floor"] == row["transfer CPU us/layer"] / row["paced floor CPU us/layer"]


def test_smallest_peers_run(tmp_path: Path) -> None:
    # benchmarks/peers.py on tiny sizes: our own row must run; Mooncake's and NIXL's rows run
    # where they are installed and say "not installed" where they are not.
    result = tmp_path / "peers.json"
    out = _bench(
        str(BENCH / "peers.py"),
        *("--rounds", "1", "--blocks", "32", "--small", "3", "--concurrency", "2"),
        *("--per-request", "4", "--waves", "1", "--repeat", "1"),
        *("--transports", "same-host", "--loops", "asyncio", "--ucx", "cma"),
        *("--json", str(result)),
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["engine"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {
        "llmdd-async same-host asyncio",
        "mooncake tcp",
        "nixl UCX_TLS=cma,tcp,self",
    }
    ours = rows["llmdd-async same-host asyncio"]
    assert ours["status"] == "ok"
    # CPU per request of both processes, for the sequential and the in-flight requests
    for k in ("cpu_us", "peer_cpu_us", "conc_cpu_us", "conc_peer_cpu_us"):
        assert ours[k] > 0, k
    for row in rows.values():
        assert row["status"] in ("ok", "not installed", "not loadable"), row
        if row["status"] == "ok":
            assert row["bulk_gbps"] > 0 and row["p50_us"] > 0 and row["req_per_s"] > 0


def test_smallest_small_requests_run(tmp_path: Path) -> None:
    result = tmp_path / "small.json"
    out = _bench(
        str(BENCH / "small_requests.py"),
        *("--cases", "tcp-16,same-host-1", "--loops", "asyncio", "--requests", "20"),
        *("--pool", "32", "--repeat", "2", "--timeline", "--json", str(result)),
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(result.read_text())["rows"]
    assert [(r["case"], r["loop"], r["requests"]) for r in rows] == [
        ("tcp-16", "asyncio", 20),
        ("same-host-1", "asyncio", 20),
    ]
    for r in rows:
        assert r["p99_us"] >= r["p50_us"] > 0 and r["cpu_us"] > 0 and r["floor_us"] > 0
    assert rows[0]["peer_cpu_us"] > 0  # the target served the streamed pulls
    # --timeline: the streamed pulls split into phases from both sides' stamps; the one-sided
    # same-host pulls send nothing, so none of theirs is split
    tcp, same_host = rows[0], rows[1]
    assert 0 <= tcp["phases_skipped"] < 40 and tcp["stamped_p50_us"] > 0
    # (a wake-up counts 0 where the read started before the send returned: a busy machine)
    assert all(v >= 0 for v in tcp["phases_us"].values()), tcp["phases_us"]
    assert all(tcp["phases_us"][k] > 0 for k in ("call", "peer", "receive")), tcp["phases_us"]
    assert same_host["phases_skipped"] == 40 and set(same_host["phases_us"].values()) == {None}
    assert "Where a request's time goes" in out.stdout
    assert _bench(str(BENCH / "small_requests.py"), "--cases", "tcp-2").returncode == 2


#: Imports every benchmark (running its own ``sys.path`` setup), then prints each module it
#: names anywhere in its source, functions included, that cannot be found. Optional extras a
#: benchmark checks for itself are left out.
_UNRESOLVED = """
import ast, importlib.util, json, sys
from pathlib import Path
bench = Path(sys.argv[1])
optional = {"vllm", "nixl", "nixl_cu12", "mooncake", "torch", "uvloop", "trio"}
sys.path.insert(0, str(bench))
missing = {}
for path in sorted(bench.glob("[!_]*.py")):
    __import__(path.stem)
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] not in optional and importlib.util.find_spec(name) is None:
                missing.setdefault(path.name, []).append(name)
print(json.dumps(missing))
"""


def test_every_module_a_benchmark_imports_can_be_found() -> None:
    # vllm_pd.py imported its engine helper from a folder the tests had moved out of.
    out = _bench("-c", _UNRESOLVED, str(BENCH))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {}


@pytest.mark.parametrize("cpus", ["all", "one"])
def test_the_asyncio_floor_of_peers_runs_each_end_on_a_cpu_of_its_own(
    monkeypatch: pytest.MonkeyPatch, cpus: str
) -> None:
    from helpers import check_floor_ends, watch_floor_ends

    sys.path.insert(0, str(BENCH))
    try:
        import peers
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("peers", None)  # (a later import finds the file again)
    before = os.sched_getaffinity(0)
    allowed = before if cpus == "all" else {min(before)}  # ("one": nothing to pin)
    os.sched_setaffinity(0, allowed)
    try:
        ours, theirs = watch_floor_ends(monkeypatch, peers)
        p50, p99 = peers.asyncio_rpc_us(20, 4096)
        assert 0 < p50 <= p99
        check_floor_ends(ours, theirs, allowed)
    finally:
        os.sched_setaffinity(0, before)
