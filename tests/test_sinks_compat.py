"""The private tracker APIs the sinks use are all in ``rlmetrics.sinks.compat``, and each exists in
the installed trackers: an upgrade that removes one fails here, by name, not in a resumed run."""

import re
from pathlib import Path

import rlmetrics
from rlmetrics.sinks import compat

PRIVATE = re.compile(
    r"(Task|SqlAlchemyStore|trackio|wandb|swanlab)\._\w|\.internal\b|(wandb|swanlab)\.proto\b"
    r"|FROM experiments"
)
"""A tracker's private name: ``X._name``, an ``internal`` module, W&B's and SwanLab's protobufs
(TensorBoard's event protobufs are its documented file format), MLflow's store schema."""


def test_every_private_tracker_api_the_sinks_use_exists():
    assert compat.check() == []


def test_no_sink_but_compat_reaches_into_a_trackers_private_api():
    sinks = Path(rlmetrics.__file__).parent / "sinks"
    for path in sorted(sinks.glob("*.py")):
        if path.name != "compat.py":
            code = path.read_text().split('"""', 2)[-1]  # past the module docstring, which may name them
            assert not PRIVATE.search(code), path.name


def test_the_mlflow_store_schema_the_sinks_read_is_mlflows(tmp_path):
    """The installed MLflow still keeps its experiments in the ``experiments`` table of its store."""
    import sqlite3

    import pytest
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlflow.db"
    client = MlflowClient(f"sqlite:///{store}")
    client.search_experiments(max_results=1)  # MLflow creates its tables and the Default experiment
    assert compat.mlflow_store_has_experiment(store)
    (tmp_path / "empty.db").write_bytes(b"")
    assert not compat.mlflow_store_has_experiment(tmp_path / "empty.db")
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        compat.mlflow_store_has_experiment(tmp_path / "junk.db")
