"""``rlmetrics [COMMAND] --help`` as a user reads it in a terminal: plain text (no Sphinx markup),
every option's default shown, each command described in its own words; and a ``-m`` glob that
matches nothing says which names of the run were near."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlmetrics
from rlmetrics.cli import build_parser

pytestmark = pytest.mark.slow  # subprocesses

SRC = Path(rlmetrics.__file__).resolve().parents[1]  # the command runs the package these tests import
COMMANDS = ("demo", "report", "plot", "compare")
MARKUP = re.compile(r"``|:(?:class|mod|func|meth|attr|data|exc):`")


def rlmetrics_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}  # one line per option
    return subprocess.run([sys.executable, "-m", "rlmetrics", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Each command's --help ("" for rlmetrics --help), as printed."""
    out = {}
    for command in ("", *COMMANDS):
        run = rlmetrics_cli(*filter(None, [command, "--help"]))
        assert run.returncode == 0, run.stderr
        out[command] = run.stdout
    return out


def option_entries(help_text: str) -> dict[str, str]:
    """An option's entry of a --help text (its lines joined), by its first option string.

    >>> option_entries("options:\\n  -o OUT, --output OUT\\n                 PNG file\\n  --quick  small")
    {'-o': '-o OUT, --output OUT PNG file', '--quick': '--quick small'}
    """
    entries: dict[str, str] = {}
    for line in help_text.splitlines():
        if line.startswith("  -"):
            entry = line.split()
            entries[entry[0].rstrip(",")] = " ".join(entry)
        elif line.startswith("   ") and entries:
            last = next(reversed(entries))
            entries[last] += " " + " ".join(line.split())
    return entries


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_help_is_plain_text(helps, command):
    assert MARKUP.findall(helps[command]) == []


def test_help_says_the_demo_trains(helps):
    assert "simulated" not in helps[""] and "GRPO" in helps[""]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_shows_its_default(helps, command):
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    entries = option_entries(helps[command])
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, [], argparse.SUPPRESS) or isinstance(default, bool):
            continue  # a flag, or an option without a default
        assert f"(default: {default})" in entries[action.option_strings[0]], action.option_strings


def test_plot_and_compare_describe_themselves(helps):
    def description(text: str) -> str:
        return text.split("\n\n", 1)[1].split("positional arguments:")[0]

    assert description(helps["plot"]) != description(helps["compare"])
    assert "rlmetrics compare" in description(helps["compare"])


@pytest.mark.parametrize("command", ["report", "plot"])
def test_a_glob_that_matches_nothing_says_what_was_near(command, tmp_path):
    from rlmetrics.sinks import JsonlSink

    names = [f"critic/score/{r}" for r in ("mean", "max", "min")] + ["actor/entropy"]
    with JsonlSink(tmp_path / "metrics.jsonl") as sink:
        for step in range(2):
            sink.log(dict.fromkeys(names, float(step)), step)
    png = ["-o", str(tmp_path / "x.png")] if command == "plot" else []
    out = rlmetrics_cli(command, str(tmp_path), "-m", "critic/score", *png)
    assert out.returncode != 0
    assert "no metric matches 'critic/score'" in out.stderr
    assert "did you mean 'critic/score/*' (3 metrics)?" in out.stderr
