"""The ``llmdd-async`` command (also ``python -m llmdd_async``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``llmdd-async`` argument parser with its ``demo``, ``bench`` and ``doctor``
    subcommands (parsing runs nothing; the docs reference and its test use it)."""
    from . import __version__
    from ._doctor import build_parser as doctor_parser
    from .bench.runner import build_parser as bench_parser
    from .demo.runner import build_parser as demo_parser

    parser = argparse.ArgumentParser(prog="llmdd-async", description="llmdd_async tools")
    parser.add_argument("--version", action="version", version=f"llmdd-async {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser(
        sub.add_parser(
            "demo",
            help="disaggregated prefill/decode of a small transformer, verified end to end",
        )
    )
    bench_parser(
        sub.add_parser(
            "bench",
            help="pull/push latency and throughput against a real peer, with machine limits",
        )
    )
    doctor_parser(
        sub.add_parser(
            "doctor",
            help="check the optional dependencies (vLLM, torch, NIXL, uvloop) and how idle CPUs "
            "wait, and print fixes",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns the exit status (also used as the process's)."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo.runner import run

        return run(args)
    if args.command == "bench":
        from .bench.runner import run as bench_run

        return bench_run(args)
    if args.command == "doctor":
        from ._doctor import run as doctor_run

        return doctor_run(args)
    return 2


def entry() -> None:
    sys.exit(main())
