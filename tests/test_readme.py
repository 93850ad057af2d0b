"""README's Python examples run as written."""

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

README = Path(__file__).resolve().parents[1] / "README.md"
QUICK_START = re.search(r"## Quick start.*?```python\n(.*?)```.*?```\n(.*?)```", README.read_text(), re.S)
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if b != QUICK_START[1]]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code, capsys):
    exec(compile(code, str(README), "exec"), {})


def test_quick_start_prints_what_readme_shows(capsys):
    """The seed loop of the quick start: each step's line as README shows it."""
    code, shown = QUICK_START.groups()
    exec(compile(code, str(README), "exec"), {})
    printed = [line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert printed == shown.strip().splitlines()
