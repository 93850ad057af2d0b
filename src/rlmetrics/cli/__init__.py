"""The rlmetrics command line: report, plot, compare.

    rlmetrics report runs/demo         # last/min/max/mean per metric
    rlmetrics plot runs/demo -m 'critic/score/*' -o runs/demo/score.png

rlmetrics COMMAND --help describes a command and its options.
"""
# A command's --help prints its module's docstring: plain text for a terminal (no Sphinx markup).

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rlmetrics.extras import EXTRA_OF, MissingExtra

NEEDS = {"report": "console", "plot": "console,plot"}
"""The extras each command uses (``compare`` is ``plot``'s); what a core-only install is told to add."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an option's help ends with its default (none for flags and ``None``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default, help = action.default, action.help or ""
        if not action.option_strings or default in (None, argparse.SUPPRESS, []) or isinstance(default, bool):
            return help
        return f"{help} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with :class:`HelpFormatter`; its subcommands' parsers are Parsers too."""

    def __init__(self, **kwargs) -> None:
        super().__init__(formatter_class=HelpFormatter, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from rlmetrics.cli import plot, report

    parser = Parser(prog="rlmetrics", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report.add_parser(sub)
    plot.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if list(argv if argv is not None else sys.argv[1:])[:1] == ["demo"]:
        print("rlmetrics demo: the demo left the package in 0.2.0; from a checkout's root run "
              "`make demo` or `python -m examples.grpo` (docs/demo.md)", file=sys.stderr)  # fmt: skip
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ImportError as exc:  # a core-only install: the extras to add, not a traceback
        module = (getattr(exc, "name", None) or "").split(".")[0]
        if not isinstance(exc, MissingExtra) and module not in EXTRA_OF:
            raise
        needs = NEEDS.get(args.command, NEEDS["plot"])
        print(f"rlmetrics {args.command} needs {module!r}, which is not installed: pip install "
              f"'rlmetrics[{needs}]'", file=sys.stderr)  # fmt: skip
        return 2
