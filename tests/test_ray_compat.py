"""The private Ray APIs of ``rlmetrics.backends.ray.compat`` exist in the installed Ray.

If this fails after a Ray upgrade, the message names what Ray removed; the Ray backend must then be
adapted (compat.py is the only place that uses them).
"""

import pytest

pytest.importorskip("ray")

from rlmetrics.backends.ray import compat  # noqa: E402

pytestmark = pytest.mark.ray


def test_every_private_ray_api_the_backend_uses_exists():
    missing = compat.check()
    assert not missing, f"Ray {compat.ray.__version__} lacks {missing}: adapt backends/ray/compat.py"


def test_calls_on_a_shut_down_ray_raise_instead_of_starting_ray(own_ray):
    assert not compat.ray.is_initialized()
    with pytest.raises(ConnectionError, match="shut down"):
        compat.remote(object())
    assert not compat.ray.is_initialized()
