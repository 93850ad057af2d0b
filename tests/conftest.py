import pytest

from rlmetrics import reduce


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
