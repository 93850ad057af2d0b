import sys

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


RAY_INIT = dict(
    address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False
)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance (4 logical CPUs, quiet) shared by the modules one pytest worker runs: a
    start costs about 17 s of CPU on a 2-core machine. The actors a module made (its named ones, and
    the aggregators this process keeps handles to) are killed after it; a module that needs a Ray of
    its own uses :func:`own_ray`."""
    ray = pytest.importorskip("ray")
    for attempt in range(2):  # a busy machine may take longer than Ray waits for its node to start
        if ray.is_initialized():
            break
        try:
            ray.init(**RAY_INIT)
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for it
            ray.shutdown()
            if attempt or "timed out during startup" not in str(exc):
                raise
    yield ray
    if ray.is_initialized():
        from rlmetrics.backends.ray import shell, transport

        handles = [*shell._KEPT.values()]
        for kept in (transport._Sender._by_actor, transport._Watcher._by_actor):
            handles += [user.handle for user in kept.values()]
            kept.clear()
        shell._KEPT.clear()
        for actor in ray.util.list_named_actors(all_namespaces=True):
            try:
                handles.append(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            except ValueError:  # gone meanwhile
                pass
        for handle in handles:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - gone meanwhile, or not an actor this job may kill
                pass


@pytest.fixture(scope="module")
def own_ray():
    """For a module that starts a Ray of its own (a ``Cluster``): the shared instance of
    :func:`ray_session` is shut down first (the next module that asks for it starts it again)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    return ray


def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
