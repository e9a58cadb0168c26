"""The ``llmdd-async`` command (also ``python -m llmdd_async``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns the exit status (also used as the process's)."""
    parser = argparse.ArgumentParser(prog="llmdd-async", description="llmdd_async tools")
    sub = parser.add_subparsers(dest="command", required=True)
    from .demo.runner import build_parser
    from .demo.runner import main as demo_main

    build_parser(
        sub.add_parser(
            "demo",
            help="disaggregated prefill/decode of a small transformer, verified end to end",
        )
    )
    args, _ = parser.parse_known_args(argv)
    if args.command == "demo":
        rest = list(sys.argv[2:] if argv is None else argv[1:])
        return demo_main(rest)
    return 2


def entry() -> None:
    sys.exit(main())
