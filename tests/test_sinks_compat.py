"""The private tracker APIs the sinks use are all in ``rlmetrics.sinks.compat``, and each exists in
the installed trackers: an upgrade that removes one fails here, by name, not in a resumed run."""

import re
from pathlib import Path

import rlmetrics
from rlmetrics.sinks import compat

PRIVATE = re.compile(
    r"(Task|SqlAlchemyStore|trackio|wandb|swanlab)\._\w|\.internal\b|(wandb|swanlab)\.proto\b"
)
"""A tracker's private name: ``X._name``, an ``internal`` module, W&B's and SwanLab's protobufs
(TensorBoard's event protobufs are its documented file format)."""


def test_every_private_tracker_api_the_sinks_use_exists():
    assert compat.check() == []


def test_no_sink_but_compat_reaches_into_a_trackers_private_api():
    sinks = Path(rlmetrics.__file__).parent / "sinks"
    for path in sorted(sinks.glob("*.py")):
        if path.name != "compat.py":
            code = path.read_text().split('"""', 2)[-1]  # past the module docstring, which may name them
            assert not PRIVATE.search(code), path.name
