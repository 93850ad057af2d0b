"""The one state protocol: every state travels, merges and reduces the same way, and the wire and
the engine handle any state kind without code of their own for it."""

from __future__ import annotations

import numpy as np
import pytest

from rlmetrics.core.packing import Packed, pack
from rlmetrics.core.reduce import resolve
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import Stat
from rlmetrics.core.states import KINDS, State, decode_state, encode_state
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.engine.wire import SchemaTable, decode, encode
from rlmetrics.metrics.validation import encode_samples, process_validation_metrics
from rlmetrics.metrics.validation.samples import VALIDATION_SAMPLES, Samples


def test_every_kind_is_a_state_and_travels_unchanged():
    samples = Samples([((0, 1), encode_samples(["a"], ["p"], {"acc": [1.0]}))])
    for state in (Sketch.of([1.0, 5.0, 2.0]), Sketch.of(np.arange(1.0, 6000.0)), samples):
        assert isinstance(state, State) and KINDS[state.kind] is type(state)
        back = decode_state(*encode_state(state))
        assert (
            np.array_equal(back.to_array(), state.to_array())
            if state.kind == "sketch"
            else (back.records == state.records)
        )


def test_refused_travelling_forms():
    for kind, arr in [("nope", np.zeros(1)), (3, np.zeros(1)), ("sketch", [1.0]), ("samples", np.zeros(2))]:
        with pytest.raises(ValueError):
            decode_state(kind, arr)


def test_samples_merge_in_rank_order_whatever_the_arrival_order():
    """Two ranks' samples of one prompt: merged either way round, the single-process metrics."""
    sources, prompts, acc = ["s"] * 5, ["p"] * 5, [1.0, 0.0, 0.0, 1.0, 1.0]
    want = process_validation_metrics(sources, prompts, {"acc": acc})
    first = Samples([((0, 0), encode_samples(sources[:2], prompts[:2], {"acc": acc[:2]}))])
    second = Samples([((0, 1), encode_samples(sources[2:], prompts[2:], {"acc": acc[2:]}))])
    for merged in (first.merge(second), second.merge(first)):
        got = merged.reduce(VALIDATION_SAMPLES, resolve(VALIDATION_SAMPLES), Stat())
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-12)


class Counts:
    """A state kind the library does not know: counts of 0..3, reported as ``name/bucket{k}``."""

    kind = "counts-test"

    def __init__(self, counts) -> None:
        self.counts = np.asarray(counts, dtype=np.float64)

    def merge(self, other: Counts) -> Counts:
        return Counts(self.counts + other.counts)

    def to_array(self) -> np.ndarray:
        return self.counts

    @classmethod
    def from_array(cls, arr: np.ndarray) -> Counts:
        return cls(arr)

    def reduce(self, name: str, reduction, stat: Stat) -> dict[str, float]:
        return {f"{name}/bucket{k}": float(c) for k, c in enumerate(self.counts)}

    def validate(self) -> None:
        if not (np.isfinite(self.counts).all() and (self.counts >= 0).all()):
            raise ValueError("counts must be finite and >= 0")


@pytest.fixture
def counts_kind():
    KINDS[Counts.kind] = Counts
    yield
    del KINDS[Counts.kind]


def test_a_new_state_kind_needs_no_code_in_the_wire_or_the_engine(counts_kind):
    """Registered in KINDS, a state travels through the wire and merges in the engine like the
    built-in ones: the result reports what its reduce gives for the merged state."""
    engine, table = Aggregator(), SchemaTable()
    for rank, counts in enumerate([[1, 0, 2, 0], [0, 3, 1, 1]]):
        base = pack({"lengths/tally": [float(rank)]})
        packed = Packed(base.schema, base.stats, {0: Counts(counts)})
        items, close, unknown = decode(encode([(0, 0, 2, packed)], [0], send_names=True), table)
        assert not unknown and isinstance(items[0][3].states[0], Counts)
        engine.submit(f"rank{rank}", *items[0][:3], items[0][3])
        engine.close(f"rank{rank}", 0)
    res = engine.finalize(0)
    assert res.meta.complete
    assert {k: v for k, v in res.items() if "bucket" in k} == {
        "lengths/tally/bucket0": 1.0, "lengths/tally/bucket1": 3.0, "lengths/tally/bucket2": 3.0,
        "lengths/tally/bucket3": 1.0,
    }  # fmt: skip
    assert res["lengths/tally"] == 0.5  # the column's own Stat still merges as usual


def test_a_state_that_is_not_one_is_refused():
    engine = Aggregator()
    base = pack({"x/p50": [1.0]})
    from rlmetrics.messages import SubmissionError

    with pytest.raises(SubmissionError, match="not a state"):
        engine.submit("r", 0, 0, 1, Packed(base.schema, base.stats, {0: object()}))
