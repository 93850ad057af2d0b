"""The package as users get it (issue 46, "packaging as users get it"): the wheel built from the
checkout, installed into a fresh venv with its dependencies from the package index, used from a
folder outside the checkout."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def build(kind: str, out: Path) -> Path:
    """The wheel or sdist of the checkout, built with its own setuptools (no download), in ``out``."""
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(out)!r}))"
    name = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300
    ).stdout.split()[-1]
    return out / name


def test_the_wheel_ships_its_license_and_types_and_a_core_install_names_the_extras(tmp_path):
    wheel = build("wheel", tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_text = z.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
    assert "rlmetrics/py.typed" in names and "Apache License" in license_text
    assert not [n for n in names if "demo" in n or "grpo" in n]  # the GRPO demo stays in the checkout
    assert "License-Expression: Apache-2.0" in meta and "Classifier: Typing :: Typed" in meta
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)]
    subprocess.run(pip, check=True, timeout=600, capture_output=True)
    away = tmp_path / "elsewhere"
    away.mkdir()
    (away / "m.jsonl").write_text('{"step": 0, "time": 0, "metrics": {"critic/score/mean": 1.0}}\n')
    code = "import rlmetrics, sys; c = rlmetrics.connect('local', world_size=1)\n"
    code += "c.submit_metric({'a/mean': [1.0, 2.0]}); c.wait_submit(); print(dict(c.result(0)))"
    core = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=away, capture_output=True, text=True
    )
    assert core.returncode == 0 and "{'a/mean': 1.5}" in core.stdout, core.stderr
    cli = venv / "bin" / "rlmetrics"
    out = subprocess.run(
        [str(cli), "report", "m.jsonl"], cwd=away, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "pip install 'rlmetrics[console]'" in out.stderr, out.stderr


def test_the_sdist_ships_no_tests_it_cannot_run(tmp_path):
    """setuptools adds ``tests/test*.py`` to an sdist, without the conftest and helpers they need."""
    with tarfile.open(build("sdist", tmp_path)) as tar:
        names = tar.getnames()
    assert not [n for n in names if "/tests/" in n] and any(n.endswith("/LICENSE") for n in names)
