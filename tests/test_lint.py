"""The tree stays ruff-clean and its typed modules mypy-clean (what `make lint` checks), so CI catches
drift."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "src", "tests", "benchmarks", "examples", "conftest.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


def test_mypy():
    """The typed modules ([tool.mypy] files of pyproject.toml) stay free of type errors."""
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
