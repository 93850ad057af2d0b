"""The peer environment as ``make install-peers`` leaves it."""

import importlib.metadata
from pathlib import Path

import pytest

pytest.importorskip("siirl")


def test_siirl_version_and_no_stray_top_level_packages():
    """siiRL 0.2.0 is the peer; the ``tests``/``examples``/``docs`` packages its wheel puts into
    site-packages were removed (a regular package ``tests`` there shadows our ``tests/`` in Ray
    workers, which then cannot import ``tests.test_ray_backend``)."""
    dist = importlib.metadata.distribution("siirl")
    assert dist.version == "0.2.0"
    stray = [t for t in ("tests", "examples", "docs") if (Path(dist.locate_file(t)) / "__init__.py").exists()]
    assert not stray, f"run `make install-peers` (or delete {stray} of siiRL from site-packages)"
