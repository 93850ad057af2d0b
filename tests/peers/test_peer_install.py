"""The peer environment as ``make install-peers`` leaves it."""

import importlib.metadata
from pathlib import Path

import pytest

pytest.importorskip("siirl")

pytestmark = pytest.mark.torch


def test_siirl_version_and_no_stray_top_level_packages():
    """siiRL 0.2.0 is the peer; the ``tests``/``examples``/``docs`` packages its wheel puts into
    site-packages were removed (a regular package ``tests`` there shadows our ``tests/`` in Ray
    workers, which then cannot import ``tests.test_ray_backend``)."""
    dist = importlib.metadata.distribution("siirl")
    assert dist.version == "0.2.0"
    stray = [t for t in ("tests", "examples", "docs") if (Path(dist.locate_file(t)) / "__init__.py").exists()]
    assert not stray, f"run `make install-peers` (or delete {stray} of siiRL from site-packages)"


def test_verl_version_and_no_stray_top_level_packages():
    """verl 0.9.1 is the second peer; its wheel's top-level ``tests`` and ``scripts`` packages were
    removed as siiRL's are."""
    pytest.importorskip("verl")
    dist = importlib.metadata.distribution("verl")
    assert dist.version == "0.9.1"
    stray = [t for t in ("tests", "scripts") if any(f.parts[0] == t and Path(dist.locate_file(f)).exists()
                                                    for f in dist.files)]  # fmt: skip
    assert not stray, f"run `make install-peers` (or delete {stray} of verl from site-packages)"
