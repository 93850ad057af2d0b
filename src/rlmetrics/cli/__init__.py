"""The ``rlmetrics`` command line: ``rlmetrics demo``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmetrics", description="Distributed metrics for RL post-training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from rlmetrics.cli import demo

    demo.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)
