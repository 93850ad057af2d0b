"""The rlmetrics command line: demo, report, plot, compare, bench (each has --help).

rlmetrics demo                     # a simulated GRPO run on an embedded Ray instance
rlmetrics report runs/demo         # last/min/max/mean per metric
rlmetrics plot runs/demo -m 'critic/score/*' -o score.png
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from rlmetrics.cli import bench, demo, plot, report

    parser = argparse.ArgumentParser(
        prog="rlmetrics", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    report.add_parser(sub)
    plot.add_parsers(sub)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)
