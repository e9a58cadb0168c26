"""``llmdd-async demo``: disaggregated prefill/decode of a small transformer, verified.

Three worker processes on 127.0.0.1 (free ports): a *prefill* endpoint computes the prompt
layer by layer and streams each layer's KV to a *decode* endpoint with
``transfer_cache_async`` while it computes the next layer (``--mode pull``: the decode endpoint
pulls the finished KV with ``pull_blocks`` instead); the decode endpoint generates tokens from
the KV it received. A *reference* process runs the same model monolithically. The demo checks
that the generated tokens are identical and the logits bit-identical, and exits non-zero if not.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from llmdd_async._childproc import ChildProcess, run_on_loop
from llmdd_async._transports import TRANSPORTS, installed
from llmdd_async.demo.model import ModelConfig

__all__ = ["DemoConfig", "main", "run_demo"]

PREFILL, DECODE = 1, 2
#: One BLAS thread everywhere: bit-identical results need identical arithmetic.
_DETERMINISTIC_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    layers: int = 8
    heads: int = 8
    head_dim: int = 64
    vocab: int = 4096
    block_size: int = 16
    prompt: int = 1024
    tokens: int = 32
    seed: int = 0
    transport: str = "auto"
    mode: str = "push"
    loop: str = "asyncio"

    def model(self) -> dict[str, int]:
        return {
            "layers": self.layers,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab,
            "block_size": self.block_size,
            "seed": self.seed,
        }


def _options(config: DemoConfig, capacity_tokens: int) -> dict[str, str]:
    model = ModelConfig(**config.model())
    blocks = model.blocks_for(capacity_tokens) + 16
    pool = blocks * config.block_size * model.kv_bytes_per_token() + (4 << 20)
    return {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": pool, "page_shift": 16}),
        "llm.Transport": config.transport,
        "llm.SyncKvCacheWaitTime": "60000",
        "llm.listenIpInfo": "127.0.0.1:0",
    }


def _floats(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype=np.float32)


async def run_demo(
    config: DemoConfig, progress: Callable[[str], None] = lambda _: None, verbose: bool = False
) -> dict[str, Any]:
    """Run the whole demo and return its report (``report["verdict"]["ok"]`` is the proof).

    The workers write to this process's stderr; ``verbose`` makes them log the library's
    events there (``LLMDD_ASYNC_LOG=debug``).

    Raises:
        ChildError: a worker failed.
    """
    from llmdd_async.demo.model import make_prompt

    capacity = config.prompt + config.tokens
    opts = _options(config, capacity)
    prompt = [int(t) for t in make_prompt(config.prompt, config.vocab, seed=config.seed + 1)]
    t_start = time.perf_counter()
    progress("starting the prefill, decode and reference workers")
    async with contextlib.AsyncExitStack() as stack:
        workers = {}
        env = dict(_DETERMINISTIC_ENV, **({"LLMDD_ASYNC_LOG": "debug"} if verbose else {}))
        for name in ("decode", "prefill", "reference"):
            workers[name] = await stack.enter_async_context(
                ChildProcess.spawn("llmdd_async.demo.worker", config.loop, env, inherit_stderr=True)
            )
        decode, prefill, ref = workers["decode"], workers["prefill"], workers["reference"]
        async with anyio.create_task_group() as tg:
            started: dict[str, Any] = {}

            async def start(name: str, role: str, cid: int) -> None:
                started[name] = await workers[name].request(
                    "start",
                    role=role,
                    cluster_id=cid,
                    options=opts,
                    model=config.model(),
                    capacity_tokens=capacity,
                )

            tg.start_soon(start, "decode", "decode", DECODE)
            tg.start_soon(start, "prefill", "prefill", PREFILL)
            tg.start_soon(start, "reference", "mono", 0)
        ip, port = started["decode"]["listen"]
        transport = await prefill.request("link", cluster_id=DECODE, ip=ip, port=port)
        progress(f"linked prefill -> decode over {transport}")
        src_table = await prefill.request("block_table", tokens=capacity, seed=11)
        dst_table = await decode.request("block_table", tokens=capacity, seed=22)
        push = config.mode == "push"
        progress("prefill with layer-wise KV streaming" if push else "prefill")
        main_run = await prefill.request(
            "prefill",
            prompt=prompt,
            table=src_table,
            dst_cluster=DECODE if push else None,
            dst_table=dst_table,
            overlap=True,
        )
        progress("decode from the received KV" if push else "decode pulls the KV, then decodes")
        decoded = await decode.request(
            "decode",
            first_token=main_run["first_token"],
            start_pos=config.prompt,
            steps=config.tokens,
            table=dst_table,
            pull_from=None if push else PREFILL,
            src_table=None if push else main_run["table"],
        )
        baseline = None
        if push:
            progress("baseline: the same prefill, KV sent only after the last layer")
            baseline = await prefill.request(
                "prefill",
                prompt=prompt,
                table=src_table,
                dst_cluster=DECODE,
                dst_table=dst_table,
                overlap=False,
            )
        progress("monolithic reference run")
        reference = await ref.request(
            "reference", prompt=prompt, steps=config.tokens, table=src_table
        )
    progress("comparing")
    return _report(
        config, transport, main_run, decoded, baseline, reference, time.perf_counter() - t_start
    )


def _report(
    config: DemoConfig,
    transport: str,
    run: dict[str, Any],
    decoded: dict[str, Any],
    baseline: dict[str, Any] | None,
    ref: dict[str, Any],
    wall: float,
) -> dict[str, Any]:
    first_equal = bool(np.array_equal(_floats(run["logits"]), _floats(ref["logits"])))
    decode_equal = bool(np.array_equal(_floats(decoded["logits"]), _floats(ref["decode_logits"])))
    tokens_equal = run["first_token"] == ref["first_token"] and decoded["tokens"] == ref["tokens"]
    computed = run["computed"]
    if config.mode == "push":
        transfer = run["transfer"]
        exposed = max(0.0, transfer["landed"] - computed)
        base = baseline["transfer"] if baseline else None
        transfer_only = base["seconds"] if base else transfer["seconds"]
        moved = transfer["bytes"]
        # Both TTFTs over the same prefill compute, so run-to-run compute noise cancels out.
        ttft_overlap: float | None = computed + exposed
        ttft_sequential = computed + transfer_only
        timeline = [
            {
                "layer": i,
                "compute": run["compute"][i],
                "transfer": transfer["layers"][i][2:] if i < len(transfer["layers"]) else None,
            }
            for i in range(config.layers)
        ]
    else:
        pull = decoded["pull"]
        ttft_overlap = None
        exposed = transfer_only = pull["seconds"]
        ttft_sequential = computed + transfer_only
        moved = pull["bytes"]
        # One pull_blocks request moves every layer: each layer shows the pull's interval,
        # on the prefill's clock (perf_counter is the same clock in every process of a host).
        start = pull["started"] - run["t0"] if "started" in pull and "t0" in run else None
        span = None if start is None else [start, start + pull["seconds"]]
        timeline = [
            {"layer": i, "compute": run["compute"][i], "transfer": span}
            for i in range(config.layers)
        ]
    gbps = moved / transfer_only / 1e9 if transfer_only > 0 else 0.0
    hidden = None if config.mode != "push" else max(0.0, 1 - exposed / transfer_only)
    return {
        "config": dataclasses.asdict(config),
        "transport": transport,
        "kv_bytes": moved,
        "gbps": gbps,
        "prefill_compute_s": computed,
        "ttft_layerwise_s": ttft_overlap,
        "ttft_sequential_s": ttft_sequential,
        "transfer_s": transfer_only,
        "exposed_transfer_s": exposed,
        "hidden_fraction": hidden,
        "decode_s_per_token": decoded["seconds"] / max(1, config.tokens),
        "tokens": [run["first_token"], *decoded["tokens"]],
        "timeline": timeline,
        "wall_s": wall,
        "verdict": {
            "ok": first_equal and decode_equal and tokens_equal,
            "tokens_identical": tokens_equal,
            "first_token_logits_bit_identical": first_equal,
            "decode_logits_bit_identical": decode_equal,
        },
    }


# ---------------------------------------------------------------------- presentation
def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f} ms"


def render(report: dict[str, Any]) -> str:
    c = report["config"]
    pull = c["mode"] == "pull"
    lines = [
        "",
        f"llmdd-async demo: {c['layers']} layers x {c['heads']} heads x {c['head_dim']} dims, "
        f"vocab {c['vocab']}, prompt {c['prompt']} tokens, {len(report['tokens'])} generated "
        f"(1 by the prefill, {len(report['tokens']) - 1} by the decode)",
        f"  mode {c['mode']}, transport {report['transport']}, loop {c['loop']}",
        "",
        f"  KV moved            {report['kv_bytes'] / 2**20:.1f} MiB",
        f"  prefill compute     {_ms(report['prefill_compute_s'])}",
        f"  KV transfer alone   {_ms(report['transfer_s'])} ({report['gbps']:.2f} GB/s"
        + (", pull_blocks after the prefill)" if pull else ")"),
        f"  time to first token {_ms(report['ttft_sequential_s'])} pulling after prefill"
        if pull
        else f"  time to first token {_ms(report['ttft_layerwise_s'])} with layer-wise "
        f"streaming, {_ms(report['ttft_sequential_s'])} sending after prefill",
    ]
    if report["hidden_fraction"] is not None:
        lines.append(
            f"  transfer hidden     {100 * report['hidden_fraction']:.0f} % behind compute "
            f"(exposed {_ms(report['exposed_transfer_s'])})"
        )
    lines.append(f"  decode              {_ms(report['decode_s_per_token'])} per token")
    lines += [
        "",
        "  per-layer timeline (ms from prefill start)"
        + ("; one pull moves every layer" if pull else ""),
        "  layer   compute            transfer",
    ]
    for row in report["timeline"]:
        comp = row["compute"]
        tr = row["transfer"]
        comp_s = f"{comp[0] * 1e3:7.1f} - {comp[1] * 1e3:7.1f}" if len(comp) == 2 else "?"
        tr_s = f"{tr[0] * 1e3:7.1f} - {tr[1] * 1e3:7.1f}" if tr else "after prefill"
        lines.append(f"  {row['layer']:5d}   {comp_s}    {tr_s}")
    v = report["verdict"]
    lines += [
        "",
        f"  generated tokens    {report['tokens'][:12]}"
        + (" ..." if len(report["tokens"]) > 12 else ""),
        f"  tokens identical to the monolithic run: {v['tokens_identical']}",
        f"  first-token logits bit-identical:       {v['first_token_logits_bit_identical']}",
        f"  decode-step logits bit-identical:       {v['decode_logits_bit_identical']}",
        "",
        "  VERDICT: " + ("PASS" if v["ok"] else "FAIL"),
        "",
    ]
    return "\n".join(lines)


def write_timeline(report: dict[str, Any], path: str) -> None:
    """Save the per-layer timeline as a picture (needs matplotlib: pip install 'llmdd-async[demo]').

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--timeline needs matplotlib: pip install 'llmdd-async[demo]'") from None
    rows = report["timeline"]
    pull = report["config"]["mode"] == "pull"
    fig, ax = plt.subplots(figsize=(10, 1 + 0.35 * len(rows)))
    for row in rows:
        y = row["layer"]
        c0, c1 = row["compute"][0] * 1e3, row["compute"][1] * 1e3
        ax.barh(
            y - 0.18,
            c1 - c0,
            left=c0,
            height=0.35,
            color="tab:blue",
            label="compute" if y == 0 else None,
        )
        if row["transfer"]:
            t0, t1 = row["transfer"][0] * 1e3, row["transfer"][1] * 1e3
            ax.barh(
                y + 0.18,
                max(t1 - t0, 0.05),
                left=t0,
                height=0.35,
                color="tab:orange",
                label=("KV pull (one request, all layers)" if pull else "KV transfer")
                if y == 0
                else None,
            )
    ax.set_xlabel("ms since prefill start")
    ax.set_ylabel("layer")
    ax.invert_yaxis()
    ax.legend(loc="upper right")
    ax.set_title(
        f"KV pulled after the prefill ({report['transport']})"
        if pull
        else f"layer-wise KV streaming ({report['transport']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _Progress:
    """rich progress when available, plain lines on stderr otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._rich: Any = None
        self._status: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console

                self._rich = Console(stderr=True)
            except ImportError:
                self._rich = None

    def __enter__(self) -> _Progress:
        if self._rich is not None:
            self._status = self._rich.status("starting")
            self._status.__enter__()
        return self

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        if self._status is not None:
            self._status.update(message)
            self._rich.log(message)
        else:
            print(f"[demo] {message}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.__exit__(None, None, None)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its messages
    return parse


def _even_positive(text: str) -> int:
    value = _int_at_least(2)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (rotary embedding), got {value}")
    return value


def _png_path(text: str) -> str:
    """A path the picture can be written to, checked before the run (which takes a while)."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib: pip install 'llmdd-async[demo]'")
    return text


def installed_transport(text: str) -> str:
    """``--transport``: a known transport whose optional package is installed (else the one
    line of usage error that says how to install it, before anything starts)."""
    spec = TRANSPORTS.get(text)
    if spec is not None and not installed(text):
        raise argparse.ArgumentTypeError(
            f"{text} is not installed here: {spec.install_hint.split('  ')[0]}"
        )
    return text  # an unknown name: argparse's choices say which are known


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's options (on ``parser``, e.g. a subcommand's, or a new parser).

    Invalid values make ``parse_args`` exit with status 2 and a usage message."""
    p = parser or argparse.ArgumentParser(prog="llmdd-async demo")
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    if p.description is None:
        p.description = (__doc__ or "").replace("``", "")  # --help is plain text
    d = DemoConfig()
    positive = _int_at_least(1)
    p.add_argument("--layers", type=positive, default=d.layers, help="transformer layers")
    p.add_argument("--heads", type=positive, default=d.heads, help="attention heads")
    p.add_argument(
        "--head-dim", type=_even_positive, default=d.head_dim, help="dimensions per head (even)"
    )
    p.add_argument("--vocab", type=positive, default=d.vocab, help="vocabulary size")
    p.add_argument(
        "--block-size", type=positive, default=d.block_size, help="tokens per KV cache block"
    )
    p.add_argument("--prompt", type=positive, default=d.prompt, help="prompt length in tokens")
    p.add_argument(
        "--tokens",
        type=positive,
        default=d.tokens,
        help="tokens the decode endpoint generates after the prefill's first one",
    )
    p.add_argument(
        "--seed", type=_int_at_least(0), default=d.seed, help="seed of the weights and prompt"
    )
    p.add_argument(
        "--transport",
        type=installed_transport,
        choices=["auto", "tcp", "same-host", "nixl", "mooncake"],
        default=d.transport,
        help="llm.Transport of both endpoints",
    )
    p.add_argument(
        "--mode",
        choices=["push", "pull"],
        default=d.mode,
        help="push: layer-wise transfer_cache_async; pull: pull_blocks after prefill",
    )
    p.add_argument(
        "--loop",
        choices=["asyncio", "uvloop", "trio"],
        default=d.loop,
        help="event loop of the worker processes",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON only")
    p.add_argument(
        "--timeline",
        metavar="PATH.png",
        type=_png_path,
        default=None,
        help="save the per-layer timeline picture (needs matplotlib)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the library's log events of the workers on stderr (LLMDD_ASYNC_LOG=debug)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed command-line arguments; returns the exit status."""
    config = DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})
    with _Progress(not args.json) as progress:
        report = run_on_loop(
            config.loop, run_demo, config, progress, bool(getattr(args, "verbose", False))
        )
    if args.timeline:
        write_timeline(report, args.timeline)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
        if args.timeline:
            print(f"  timeline written to {args.timeline}")
    return 0 if report["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
