"""Duck-typed batches, as verl's own tests build them: verl 0.9.1's batch functions and ours on the
same objects. Where verl computes, equal numbers; where verl raises, both raise (ours naming the
attribute and what it must be). verl reads ``.batch`` and ``.non_tensor_batch`` in
``compute_data_metrics``, ``.batch`` in ``compute_timing_metrics`` and
``compute_variance_proxy_metrics``, ``.meta_info`` in ``compute_throughout_metrics``, nothing else.
"""

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.metric_utils")
torch = pytest.importorskip("torch")

import verl.trainer.ppo.metric_utils as verl_metrics  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from rlmetrics.integrations import verl as ours  # noqa: E402
from rlmetrics.integrations.verl.batch import VERL_READS  # noqa: E402
from tests.peers.verl_batches import assert_same, verl_batch  # noqa: E402

pytestmark = pytest.mark.torch

REL = 1e-5
TIMING = {"gen": 1.5, "ref": 0.25, "update_actor": 2.5, "step": 6.0}
MISSING = object()


def call(fn, batch):
    """``fn``'s module function on ``batch`` (``ours`` or verl's), with this file's arguments."""

    def run(module):
        f = getattr(module, fn)
        if fn == "compute_data_metrics":
            return f(batch, use_critic=True)
        if fn == "compute_timing_metrics":
            return f(batch, TIMING)
        if fn == "compute_throughout_metrics":
            return f(batch, TIMING, 2)
        return f(batch, gradient_norm=0.5)

    return run


def duck(tensor_form="dict", non_tensor="dict", meta="dict", multi_turn=True, drop=()):
    """A SimpleNamespace batch: ``.batch`` a dict, a TensorDict, None or a list; ``.non_tensor_batch``
    and ``.meta_info`` a dict, None, a list, or missing (MISSING); ``drop``: tensor keys left out."""
    tensors, non_tensors = verl_batch(3, b=12, multi_turn=multi_turn)
    tokens = tensors["attention_mask"].sum(-1).tolist()
    for key in drop:
        del tensors[key]
    size = len(tensors["responses"])
    batch = {
        "dict": tensors,
        "tensordict": TensorDict(tensors, batch_size=[size]),
        "none": None,
        "list": list(tensors.values()),
    }[tensor_form]
    fields = {"batch": batch}
    forms = {
        "non_tensor_batch": (non_tensor, non_tensors),
        "meta_info": (meta, {"global_token_num": tokens}),
    }
    for attr, (form, value) in forms.items():
        if form == "missing":
            continue
        fields[attr] = {"dict": value, "none": None, "list": [], "array": np.zeros(3), "empty": {}}[form]
    return SimpleNamespace(**fields)


FUNCTIONS = [
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughout_metrics",
    "compute_variance_proxy_metrics",
]

# (batch, which functions verl refuses it in: {function: the attribute our message names})
CASES = {
    "dict-batch": (dict(), {}),
    "tensordict-batch": (dict(tensor_form="tensordict"), {}),
    "tensordict-single-turn": (dict(tensor_form="tensordict", multi_turn=False), {}),
    "non-tensor-none": (dict(non_tensor="none"), {"compute_data_metrics": ".non_tensor_batch"}),
    "non-tensor-list": (dict(non_tensor="list"), {}),
    "non-tensor-array": (dict(non_tensor="array"), {}),
    "non-tensor-empty": (dict(non_tensor="empty"), {}),
    "non-tensor-missing": (dict(non_tensor="missing"), {"compute_data_metrics": ".non_tensor_batch"}),
    "meta-missing": (dict(meta="missing"), {"compute_throughout_metrics": ".meta_info"}),
    "meta-none": (dict(meta="none"), {"compute_throughout_metrics": ".meta_info"}),
    "meta-list": (dict(meta="list"), {"compute_throughout_metrics": ".meta_info"}),
    "batch-none": (
        dict(tensor_form="none"),
        {f: ".batch" for f in FUNCTIONS if f != "compute_throughout_metrics"},
    ),
    "batch-list": (  # verl's variance proxy finds none of its keys in a list: no metrics
        dict(tensor_form="list"),
        {f: ".batch" for f in ("compute_data_metrics", "compute_timing_metrics")},
    ),
}


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_duck_typed_batches_as_verl(case, fn):
    """verl's numbers where verl computes; where verl raises, ours raises the same kind of error
    (``AttributeError`` for a missing attribute, ``TypeError`` for the wrong kind), naming it."""
    kwargs, refused = CASES[case]
    batch = duck(**kwargs)
    run = call(fn, batch)
    if fn in refused:
        with pytest.raises((TypeError, AttributeError)) as theirs:
            run(verl_metrics)
        with pytest.raises(type(theirs.value), match=f"{fn}: .*{refused[fn]}"):
            run(ours)
        return
    assert_same(run(ours), run(verl_metrics), REL)


def test_refusals_say_what_is_expected():
    """The message names the attribute, what verl reads in it, and what to give."""
    with pytest.raises(TypeError, match=r"\.batch must be a mapping or a TensorDict .* got NoneType"):
        ours.compute_data_metrics(duck(tensor_form="none"))
    with pytest.raises(AttributeError, match=r"no \.non_tensor_batch .*give a dict of numpy arrays"):
        ours.compute_data_metrics(duck(non_tensor="missing"))
    with pytest.raises(TypeError, match=r"\.non_tensor_batch must be a mapping .* got NoneType"):
        ours.compute_data_metrics(duck(non_tensor="none"))
    with pytest.raises(
        TypeError, match=r"\.meta_info must be a mapping holding 'global_token_num'.* got list"
    ):
        ours.compute_throughout_metrics(duck(meta="list"), TIMING, 2)


def test_non_tensor_list_holding_a_count_key_is_refused_as_verl():
    """A list that holds ``"__num_turns__"``: verl finds the key, then cannot index the list."""
    batch = duck()
    batch.non_tensor_batch = ["__num_turns__"]
    with pytest.raises(TypeError):
        verl_metrics.compute_data_metrics(batch)
    with pytest.raises(TypeError, match=r"compute_data_metrics: \.non_tensor_batch must be a mapping"):
        ours.compute_data_metrics(batch)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_only_the_attributes_verl_reads_are_read(fn):
    """An attribute verl never reads in ``fn`` may be anything (here: an int), as for verl."""
    reads = VERL_READS[fn]
    batch = duck()
    for attr in ("non_tensor_batch", "meta_info"):
        if attr not in reads:
            setattr(batch, attr, 7)
    if "batch" not in reads:
        batch.batch = 7  # ours then has no attention_mask to count a shard from: the list is this batch's
    run = call(fn, batch)
    assert_same(run(ours), run(verl_metrics), REL)


@pytest.mark.parametrize(
    ("fn", "drop"),
    [
        ("compute_data_metrics", "values"),
        ("compute_data_metrics", "token_level_scores"),
        ("compute_timing_metrics", "attention_mask"),
    ],
)
def test_missing_required_key_verl_raises_we_leave_its_metrics_out(fn, drop):
    """Intended difference (docs/verl.md): a key verl needs is missing: verl raises ``KeyError``, we
    leave out the metrics that need it and report the others with verl's numbers."""
    batch = duck(drop=(drop,))
    run = call(fn, batch)
    with pytest.raises(KeyError):
        run(verl_metrics)
    mine = run(ours)
    full = call(fn, duck())(verl_metrics)
    assert mine and set(mine) < set(full)
    assert_same(mine, full, REL, set(mine))


def test_group_by_function_gets_the_batch_object():
    """A ``group_by`` function is given the object passed in (not our view of it)."""
    batch = duck()
    seen = []

    def half(b):
        seen.append(b)
        return np.arange(len(b.batch["responses"])) % 2

    out = ours.compute_data_metrics(batch, group_by={"half": half})
    assert seen == [batch] and "group/half/0/critic/score/mean" in out
