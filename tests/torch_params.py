"""Torch inputs for the tests of core modules: made when the test runs, so that collecting a core test
module imports no torch (``pytest -m "not torch"`` then needs none), and marked ``torch``.

>>> import pytest
>>> made(2.0), repr(tensor(lambda torch: torch.ones(2)).values[0])
(2.0, 'tensor')
"""

import pytest

__all__ = ["TORCH", "Deferred", "made", "tensor"]

TORCH = pytest.param("torch", marks=pytest.mark.torch)
"""The ``"torch"`` kind of a parametrized test, marked ``torch``."""


class Deferred:
    """A value made by ``make(torch)`` when the test runs (:func:`made`)."""

    def __init__(self, make):
        self.make = make

    def __repr__(self) -> str:
        return "tensor"


def tensor(make, *more, id=None):
    """A parameter set whose first value is ``make(torch)`` (made when the test runs), marked ``torch``."""
    return pytest.param(Deferred(make), *more, marks=pytest.mark.torch, id=id)


def made(value):
    """``value``, or the tensor it defers (torch imported now)."""
    return value.make(pytest.importorskip("torch")) if isinstance(value, Deferred) else value
