"""The demo, end to end, in its smallest configuration: the verdict must be PASS."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
from helpers import TRANSPORTS

from llmdd_async.demo import runner
from llmdd_async.demo.runner import DemoConfig, run_demo

pytestmark = pytest.mark.anyio

SMALL = {
    "layers": 2,
    "heads": 2,
    "head_dim": 16,
    "vocab": 97,
    "block_size": 4,
    "prompt": 37,
    "tokens": 5,
}
# the demo over NIXL (UCX loopback); a missing NIXL skips, or fails under CI=true
DEMO_NIXL = [p for p in TRANSPORTS if getattr(p, "id", None) == "nixl"]
ASYNCIO = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])


@ASYNCIO
@pytest.mark.parametrize("transport", ["tcp", "same-host", "auto", *DEMO_NIXL])
@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_small_demo_passes(transport: str, mode: str) -> None:
    report = await run_demo(DemoConfig(**SMALL, transport=transport, mode=mode))
    assert report["verdict"] == {
        "ok": True,
        "tokens_identical": True,
        "first_token_logits_bit_identical": True,
        "decode_logits_bit_identical": True,
    }
    assert len(report["tokens"]) == SMALL["tokens"] + 1
    assert report["kv_bytes"] >= report["config"]["prompt"] * 2 * 2 * 2 * 16 * 4
    assert report["transport"] == (transport if transport in ("tcp", "nixl") else "same-host")
    if mode == "push":
        assert report["ttft_layerwise_s"] > 0 and report["ttft_sequential_s"] > 0
    # Both modes show when the KV moved, in the report and in its text.
    assert all(row["transfer"] is not None for row in report["timeline"])
    assert all(row["transfer"][0] <= row["transfer"][1] for row in report["timeline"])
    text = runner.render(report)
    assert "n/a" not in text and "    after prefill" not in text
    # The text counts the tokens the JSON lists (the prefill's first one included).
    assert f"{len(report['tokens'])} generated" in text


async def test_small_demo_on_every_event_loop(anyio_backend) -> None:
    loop = "uvloop" if anyio_backend[1].get("use_uvloop") else anyio_backend[0]
    report = await run_demo(DemoConfig(**SMALL, loop=loop))
    assert report["verdict"]["ok"]


def test_the_command_prints_json_and_exits_zero(tmp_path) -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    out = subprocess.run(
        [sys.executable, "-m", "llmdd_async", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["verdict"]["ok"] is True


def test_a_failed_verdict_exits_nonzero(monkeypatch, capsys) -> None:
    async def broken(config, progress, *args):
        report = await run_demo(config, progress, *args)
        report["verdict"] = dict(report["verdict"], ok=False, tokens_identical=False)
        return report

    monkeypatch.setattr(runner, "run_demo", broken)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert runner.main(args) == 1
    assert "VERDICT: FAIL" in capsys.readouterr().out


def test_report_compares_bits_not_closeness() -> None:
    import base64

    import numpy as np

    def b64(a):
        return base64.b64encode(np.asarray(a, np.float32).tobytes()).decode()

    close = np.float32(1.0) + np.finfo(np.float32).eps  # one ulp away
    run = {
        "logits": b64([1.0, 2.0]),
        "first_token": 1,
        "computed": 0.1,
        "compute": [[0.0, 0.1]],
        "transfer": {
            "landed": 0.2,
            "seconds": 0.1,
            "bytes": 1,
            "gbps": 1.0,
            "layers": [[0, 0, 0, 0.2]],
        },
    }
    decoded = {"logits": b64([3.0]), "tokens": [4], "seconds": 0.1, "pull": None}
    ref = {
        "logits": b64([close, 2.0]),
        "first_token": 1,
        "tokens": [4],
        "decode_logits": b64([3.0]),
    }
    config = DemoConfig(**{**SMALL, "layers": 1})
    report = runner._report(config, "tcp", run, decoded, None, ref, 1.0)
    assert report["verdict"]["first_token_logits_bit_identical"] is False
    assert report["verdict"]["ok"] is False


def test_timeline_picture(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="--timeline needs the demo extra (matplotlib)")
    path = tmp_path / "timeline.png"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert runner.main([*args, "--timeline", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "0"], "--tokens: must be >= 1, got 0"),
        (["--prompt", "0"], "--prompt: must be >= 1, got 0"),
        (["--layers", "-3"], "--layers: must be >= 1, got -3"),
        (["--heads", "x"], "--heads: not an integer: 'x'"),
        (["--head-dim", "15"], "--head-dim: must be even"),
        (["--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["--timeline", "/nonexistent-dir/t.png"], "directory '/nonexistent-dir' does not exist"),
        (["--mode", "pul"], "invalid choice: 'pul'"),
    ],
)
def test_bad_values_are_usage_errors_before_the_run(args, message, capsys) -> None:
    from llmdd_async import _cli

    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: llmdd-async demo") and message in err


def test_timeline_directory_is_refused(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="--timeline needs the demo extra (matplotlib)")
    with pytest.raises(SystemExit) as exit_info:
        runner.build_parser().parse_args(["--timeline", str(tmp_path)])
    assert exit_info.value.code == 2
    ok = runner.build_parser().parse_args(["--timeline", str(tmp_path / "t.png")])
    assert ok.timeline == str(tmp_path / "t.png")


def test_every_option_has_help_with_its_default(capsys) -> None:
    from llmdd_async import _cli

    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    parser = runner.build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= {"layers", "tokens", "timeline", "verbose"}
    for action in options:
        assert action.help, action.dest
        assert f"{' '.join(action.help.split())} (default: {action.default})" in text, action.dest


def test_pull_timeline_picture_has_transfer_bars(monkeypatch, tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="--timeline needs the demo extra (matplotlib)")
    import matplotlib.axes

    report = anyio.run(run_demo, DemoConfig(**SMALL, mode="pull"))
    bars: list[str | None] = []
    barh = matplotlib.axes.Axes.barh

    def spy(self, *args, **kwargs):
        bars.append(kwargs.get("color"))
        return barh(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", spy)
    runner.write_timeline(report, str(tmp_path / "pull.png"))
    assert bars.count("tab:orange") == SMALL["layers"]  # one transfer bar per layer
    assert (tmp_path / "pull.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verbose_shows_the_library_events_on_stderr() -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    out = subprocess.run(
        [sys.executable, "-m", "llmdd_async", "demo", "--json", "--verbose", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["verdict"]["ok"] is True  # stdout stays the JSON report
    assert "llmdd_async.engine: engine.up" in out.stderr
    assert "llmdd_async.link: link.up" in out.stderr
    assert "llmdd_async.engine: transfer.complete" in out.stderr
