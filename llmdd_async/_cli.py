"""The ``llmdd-async`` command (also ``python -m llmdd_async``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns the exit status (also used as the process's)."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="llmdd-async", description="llmdd_async tools")
    parser.add_argument("--version", action="version", version=f"llmdd-async {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from .demo.runner import build_parser, run

    build_parser(
        sub.add_parser(
            "demo",
            help="disaggregated prefill/decode of a small transformer, verified end to end",
        )
    )
    from .bench.runner import build_parser as bench_parser
    from .bench.runner import run as bench_run

    bench_parser(
        sub.add_parser(
            "bench",
            help="pull/push latency and throughput against a real peer, with machine limits",
        )
    )
    from ._doctor import build_parser as doctor_parser
    from ._doctor import run as doctor_run

    doctor_parser(
        sub.add_parser(
            "doctor",
            help="check the optional dependencies (vLLM, torch, NIXL, uvloop) and print fixes",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run(args)
    if args.command == "bench":
        return bench_run(args)
    if args.command == "doctor":
        return doctor_run(args)
    return 2


def entry() -> None:
    sys.exit(main())
