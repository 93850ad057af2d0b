"""The metric reference of docs/metrics.md is generated from the code, and lists every name the code makes."""

import re
from pathlib import Path

import numpy as np
import pytest

from examples import seed_metrics
from rlmetrics.core.reduce import DEFAULT_RENAMES, rename
from rlmetrics.metrics import MFU_STAGES, catalog
from rlmetrics.metrics.data import compute_data_metric
from rlmetrics.metrics.memory import memory_metrics
from rlmetrics.metrics.mfu import compute_mfu_metrics
from rlmetrics.metrics.timing import compute_throughput_metrics, compute_timing_metrics
from rlmetrics.metrics.validation import process_validation_metrics

pytestmark = pytest.mark.torch

METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
REFERENCE = catalog.CATALOG + seed_metrics.CATALOG  # the library's metrics, then the example pack's


def produced_names() -> set[str]:
    """Every name the built-in metric functions report for a batch that has every key they read."""
    from tests.test_metrics_data import make_batch  # the batch builder of the data tests

    batch = make_batch(np.random.default_rng(0), 16, 8, 12, tool_calls=True)
    names = set(compute_data_metric(batch))
    timing = {"gen": 1.0, "ref": 0.5, "values": 0.5, "adv": 0.1, "update_actor": 2.0, "step": 4.0}
    names |= {rename(n, DEFAULT_RENAMES) for n in compute_timing_metrics(batch, timing)}
    names |= set(compute_throughput_metrics(batch, timing, 1))
    for stage in MFU_STAGES:
        names |= set(compute_mfu_metrics(batch, timing, 1, flops_per_token=1e9, peak_flops=1e12, stage=stage))
    names |= set(memory_metrics(1.0, 2.0, 3.0, 4.0, stage="gen"))  # what a CUDA rank reports
    rng = np.random.default_rng(1)
    n = 2 * 3 * 8
    val_inputs = (
        ["a"] * (n // 2) + ["b"] * (n // 2),
        [f"p{i // 8}" for i in range(n)],
        {
            "reward": rng.random(n).tolist(),
            "acc": (rng.random(n) < 0.5).astype(float).tolist(),
            "pred": rng.integers(0, 3, n).astype(str).tolist(),
        },
        rng.integers(1, 4, n),
    )
    val = process_validation_metrics(*val_inputs, exact=True)
    names |= set(val)
    for options in ({"tie": "none", "missing": "drop"}, {"missing": "count_as_zero"}, {"missing": "error"}):
        names |= set(process_validation_metrics(*val_inputs, exact=True, **options))
    return names | example_names()


def example_names() -> set[str]:
    """The names of the seed's example metrics (examples/seed_metrics): the name tuples of its modules."""
    names: set[str] = set()
    for module in (seed_metrics.custom, seed_metrics.advanced, seed_metrics.model, seed_metrics.conversation):
        for value in vars(module).values():
            if isinstance(value, tuple) and value and all(isinstance(v, str) and "/" in v for v in value):
                names |= set(value)
    return names


def test_every_produced_name_is_in_the_reference():
    names = produced_names()
    assert len(names) > 150
    missing = sorted(n for n in names if not any(catalog.covers(p, n) for p, _ in REFERENCE))
    assert missing == []


def test_every_reference_name_without_placeholders_is_produced():
    names = produced_names()
    stale = [n for p, _ in REFERENCE for n in catalog.expand(p) if "<" not in n and n not in names]
    assert stale == []


def test_the_library_reference_lists_no_example_metric():
    """The example pack documents its own names (seed_metrics.CATALOG); the library claims none of them."""
    claimed = sorted(n for n in example_names() if any(catalog.covers(p, n) for p, _ in catalog.CATALOG))
    assert claimed == []


def test_metrics_doc_carries_the_generated_table():
    text = METRICS_DOC.read_text()
    block = re.search(r"<!-- metric-reference -->\n(.*?)<!-- /metric-reference -->", text, re.S)
    assert block is not None, "docs/metrics.md lacks the metric-reference markers"
    assert block.group(1) == catalog.markdown_table(), "run: python -m rlmetrics.metrics.catalog"
    example = re.search(r"<!-- example-reference -->\n(.*?)<!-- /example-reference -->", text, re.S)
    assert example is not None, "docs/metrics.md lacks the example-reference markers"
    assert example.group(1) == catalog.markdown_table(seed_metrics.CATALOG)
