"""``rlmetrics [COMMAND] --help`` and the demo's ``python -m examples.grpo --help`` as a user reads
them in a terminal: plain text (no Sphinx markup), every option's default shown, each command
described in its own words; and a ``-m`` glob that matches nothing says which names of the run were
near."""

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
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("report", "plot", "compare")
DEMO = "demo"  # python -m examples.grpo, the demo's own command line
MARKUP = re.compile(r"``|:(?:class|mod|func|meth|attr|data|exc):`")


def rlmetrics_cli(*args: str, module: str = "rlmetrics") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(ROOT)])}
    env["COLUMNS"] = "200"  # one line per option
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Each command's --help ("" for rlmetrics --help), as printed."""
    out = {}
    for command in ("", *COMMANDS, DEMO):
        run = (
            rlmetrics_cli("--help", module="examples.grpo")
            if command == DEMO
            else rlmetrics_cli(*filter(None, [command, "--help"]))
        )
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


@pytest.mark.parametrize("command", ("", *COMMANDS, DEMO))
def test_help_is_plain_text(helps, command):
    assert MARKUP.findall(helps[command]) == []


def test_help_says_the_demo_trains(helps):
    assert "simulated" not in helps[DEMO] and "GRPO" in helps[DEMO]


@pytest.mark.parametrize("command", (*COMMANDS, DEMO))
def test_every_option_shows_its_default(helps, command):
    if command == DEMO:
        from examples.grpo.demo import build_parser as demo_parser

        parser = demo_parser()
    else:
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


def write_run(folder, names, steps=3):
    from rlmetrics.sinks import JsonlSink

    with JsonlSink(folder / "metrics.jsonl") as sink:
        for step in range(steps):
            sink.log({n: float(step + i) for i, n in enumerate(names)}, step)


NAMES = [
    "critic/score/mean",
    "critic/score/max",
    "critic/vf_explained_var",
    "actor/grad_norm",
    "actor/entropy",
]


def test_one_glob_dialect_for_the_cli_keys_and_health_rules(tmp_path, caplog):
    """``critic/*`` selects the same names in ``report -m``, ``make_sinks(keys=)`` and a health rule."""
    from rlmetrics.health import Monitor, NonFinite
    from rlmetrics.sinks import Sink, Tracking, make_sinks, read_jsonl

    want = ["critic/score/mean", "critic/score/max", "critic/vf_explained_var"]
    write_run(tmp_path, NAMES)
    out = rlmetrics_cli("report", str(tmp_path), "-m", "critic/*")
    assert out.returncode == 0, out.stderr
    assert [n for n in NAMES if n in out.stdout] == want
    monitor = Monitor([NonFinite(patterns=("critic/*",))])
    alerts = monitor.observe(0, dict.fromkeys(NAMES, float("nan")))
    assert sorted(a.metric for a in alerts) == sorted(want)
    got = []

    class Recorder(Sink):
        tracker = "recorder"

        def log(self, metrics, step):
            got.append(sorted(metrics))

        def close(self):
            pass

    with Tracking([Recorder()], health=None, keys=["critic/*"], overview=False) as tracking:
        tracking.log(dict.fromkeys(NAMES, 1.0), 0)
    assert got == [sorted(want)] and not caplog.records  # it matched: no "matched no key" warning
    with make_sinks(["jsonl"], tmp_path / "keys", keys=["critic/*"]) as tracking:
        tracking.log(dict.fromkeys(NAMES, 1.0), 0)
    assert set(read_jsonl(tmp_path / "keys" / "metrics.jsonl").names()) >= set(NAMES)  # JSONL: every key


@pytest.mark.parametrize("command", ["report", "plot", "compare"])
def test_each_of_several_globs_is_checked(command, tmp_path):
    """A typo in one of several ``-m`` globs is refused with its own did-you-mean, not dropped."""
    write_run(tmp_path, NAMES)
    runs = [str(tmp_path), str(tmp_path)] if command == "compare" else [str(tmp_path)]
    png = [] if command == "report" else ["-o", str(tmp_path / "x.png")]
    out = rlmetrics_cli(command, *runs, "-m", "critic/*", "-m", "actr/*", "-m", "actor/entropi", *png)
    assert out.returncode != 0
    assert "no metric matches 'actr/*', 'actor/entropi'" in out.stderr
    assert "did you mean 'actor/*' (2 metrics), 'actor/entropy'?" in out.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("command", ["plot", "compare"])
def test_plot_without_m_draws_the_core_metrics(command, tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path, NAMES)
    runs = [str(tmp_path), str(tmp_path)] if command == "compare" else [str(tmp_path)]
    out = rlmetrics_cli(command, *runs, "-o", str(tmp_path / "core.png"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "core.png").stat().st_size > 0
    if command == "compare":  # the table of last values: the core metrics the run has, no other
        assert all(n in out.stdout for n in ("critic/score/mean", "actor/grad_norm", "actor/entropy"))
        assert "critic/score/max" not in out.stdout and "critic/vf_explained_var" not in out.stdout
    empty = tmp_path / "other"
    empty.mkdir()
    write_run(empty, ["my/loss"])
    out = rlmetrics_cli(command, *([str(empty)] * len(runs)), "-o", str(empty / "x.png"))
    assert out.returncode != 0 and "no core metric" in out.stderr and "give -m GLOB" in out.stderr
