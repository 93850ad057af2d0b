import pytest

from rlmetrics.core import reduce


@pytest.fixture(autouse=True)
def _restore_reduction_registry():
    """Tests may register reductions; every test starts from the built-in registry."""
    special, globs = dict(reduce.SPECIAL_METRICS), dict(reduce._GLOBS)
    yield
    reduce.SPECIAL_METRICS.clear()
    reduce.SPECIAL_METRICS.update(special)
    reduce._GLOBS.clear()
    reduce._GLOBS.update(globs)
    reduce._resolve_by_rules.cache_clear()


@pytest.fixture(autouse=True)
def _no_tracking_server(monkeypatch):
    """A developer's ``MLFLOW_TRACKING_URI`` would send the tests' runs to their server: unset
    (a test that wants one sets it)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance for the tests of one module (4 logical CPUs, quiet), shut down after."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
