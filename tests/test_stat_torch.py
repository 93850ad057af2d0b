"""Tests of rlmetrics.core.stat on torch tensors: dtypes, masks on the device, one host read, torch's
median."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from rlmetrics.core.stat import Stat  # noqa: E402
from tests.test_stat import assert_matches  # noqa: E402

pytestmark = pytest.mark.torch
NAN, INF = math.nan, math.inf


TORCH_DTYPES = [torch.bfloat16, torch.int64, torch.bool, torch.float32, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4)])
def test_torch_tensors(dtype, shape) -> None:
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 50).to(dtype)
    x = t.to(torch.float64).numpy().ravel()
    assert_matches(Stat.of(t), x)
    assert_matches(Stat.of(t, sketch=True), x)
    assert Stat.of(t.requires_grad_(True) if t.is_floating_point() else t).count == x.size


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_sketch_median_equals_torch_median_of_masked_values(kind) -> None:
    rng = np.random.default_rng(2)
    values = rng.standard_normal((8, 33))
    mask = rng.random((8, 33)) > 0.4
    t, tmask = torch.from_numpy(values), torch.from_numpy(mask)
    stat = Stat.of(t, mask=tmask, sketch=True) if kind == "torch" else Stat.of(values, mask=mask, sketch=True)
    assert stat.sketch is not None and stat.sketch.is_exact
    assert stat.sketch.median() == torch.median(t[torch.from_numpy(mask)]).item()
    assert stat.sketch.count == mask.sum()
    merged = Stat.of(values[:3], mask=mask[:3], sketch=True).merge(Stat.of(t[3:], mask=mask[3:], sketch=True))
    assert merged.sketch.median() == torch.median(t[torch.from_numpy(mask)]).item()
    assert Stat.of(values).merge(stat).sketch is None  # kept only when both sides carry one


# ---------------------------------------------------------------------------------------- one host transfer


class _HostCalls(TorchFunctionMode):
    """Records every tensor method that materialises data on the host (on a GPU: a device→host copy)."""

    HOST = {"cpu", "numpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__array__"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.HOST:
            self.calls.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


class _ScalarReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense: every C++-level tensor -> Python scalar read (item, float(), ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "_local_scalar_dense" in str(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sketch", [False, True])
def test_torch_input_is_read_back_once(sketch) -> None:
    # There is no device on CPU, so this cannot time a transfer. What it proves: the torch path calls exactly
    # one host-materialising method (.numpy()) -- on the 7-number summary without a sketch -- and no
    # .item()/.tolist()/float()/bool() on any tensor (each a blocking sync on a GPU), neither from Python
    # (function mode) nor hidden in C++ (no aten._local_scalar_dense at the dispatcher). tests/test_syncs.py
    # counts the syncs themselves, on an emulated device.
    b, t = 4, 16
    values = torch.randn(b, t)
    mask = torch.rand(b, t) > 0.3
    weight = torch.rand(b, 1)
    with _HostCalls() as host, _ScalarReads() as reads:
        stat = Stat.of(values, mask=mask, weight=weight, sketch=sketch, nan_strategy="error", name="x")
    assert [c[0] for c in host.calls] == ["numpy"], host.calls
    if not sketch:
        assert host.calls[0][1] == 7
    assert reads.count == 0
    assert_matches(stat, values.double().numpy(), (mask * weight).double().numpy(), rel=1e-12)


def test_error_strategy_ignores_masked_non_finite_tensors() -> None:
    assert Stat.of(torch.tensor([1.0, INF]), mask=torch.tensor([1, 0]), nan_strategy="error").mean == 1.0


def test_masked_out_tensor_weights_are_ignored() -> None:
    # e.g. weight = 1 / n_tokens, inf (or nan) on padded rows that the mask removes
    t = torch.tensor
    assert Stat.of(t([1.0, 2.0]), mask=t([1, 0]), weight=t([2.0, NAN])).count == 2.0
