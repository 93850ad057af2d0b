"""Property tests (hypothesis) of the whole submit path, on the local backend and on a real Ray actor.

Random names (unicode with lone surrogates, empty, very long, path-like, NUL bytes), values (Python,
numpy and torch numbers of every shape and dtype, bools, (value, weight) pairs, non-finite and extreme
floats, and things that are not numbers), world sizes, duplicate and out-of-order steps. Expected
results are computed here with numpy from the raw observations, with the reduction that
``rlmetrics.resolve`` picks for the name.

Decisions the tests pin: bools count as 0/1; complex values (Python, numpy or torch) are refused;
every refusal raises :class:`~rlmetrics.MetricValueError` (or ``ValueError`` for a bad step or
world size) at the submitting client, naming the metric (its repr) and the problem, while the other
metrics of the call go through; a number under a ``std`` name is one rank's std (averaged), so std
names get data here; sums beyond the float64 range overflow to inf as in numpy.
"""

import itertools
import math
import re
import uuid
import warnings
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import rlmetrics
from rlmetrics import MetricClient, MetricValueError, resolve
from rlmetrics.backends.local import LocalMetricWorker

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

LOCAL = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
RAY = settings(LOCAL, max_examples=40)

# ------------------------------------------------------------------------------------------- names
_TEXT = st.text(st.characters(exclude_categories=()), min_size=1, max_size=12)  # lone surrogates too
_WORDS = ["mean", "max", "min", "sum", "total", "std", "median", "p50", "p95", "p99.9", "p0", "p100",
          "count", "avg", "mean@4", "best@2/mean", "minerva_math", "minibatch_loss", "p100.5"]  # fmt: skip
_PATHS = ["../x", "./", "/", "//", "a/../../etc/passwd", "..\\..\\x", "~", "x/", "/x", " ", "\t\n",
          "x\x00mean\x00y", "graph_output_handling", "val/test_score/aime"]  # fmt: skip
NAMES = st.one_of(
    _TEXT,
    st.builds("{}/{}".format, _TEXT, st.sampled_from(_WORDS)),
    st.builds("timing_s/{}".format, _TEXT),
    st.sampled_from(_PATHS),
    st.builds(
        lambda c, n, w: c * n + "/" + w, st.characters(), st.integers(1000, 20_000), st.sampled_from(_WORDS)
    ),
).filter(lambda n: not n.startswith(("_aux/", "perf/delta_time/")))  # reserved prefix; renames into it


def out_name(name):
    """The result key: ``timing_s/`` is reported as ``perf/delta_time/`` (the default renames)."""
    return "perf/delta_time/" + name[len("timing_s/") :] if name.startswith("timing_s/") else name


# ------------------------------------------------------------------------------------------ values
_TORCH = {"bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
          "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}  # fmt: skip
_NUMPY = ["bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16",
          "float32", "float64"]  # fmt: skip
_SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def _elements(dtype):
    """Values every dtype holds exactly (so the expected observations are known without our code)."""
    if dtype == "bool":
        return st.booleans()
    if dtype.startswith("uint"):
        return st.integers(0, 255)
    if dtype in ("float32", "float64"):
        return st.floats(-1e6, 1e6, width=32 if dtype == "float32" else 64)
    return st.integers(-128, 127) if dtype == "int8" else st.integers(-256, 256)


@st.composite
def source_arrays(draw, dtypes):
    """(dtype name, float64 array of the observations) of any shape."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(_SHAPES)
    data = draw(hnp.arrays(np.float64, shape, elements=_elements(dtype).map(float)))
    return dtype, data


@st.composite
def valid_values(draw, reduction):
    """(value to submit, observations, weights): the value in one of the accepted forms."""
    scalar_ok = reduction.kind != "std"  # a number under a std name is a rank's std, not an observation
    forms = ["numpy", "torch", "list"] + (["python", "npscalar"] if scalar_ok else [])
    forms += [] if reduction.needs_sketch else ["weighted"]
    form = draw(st.sampled_from(forms))
    if form == "python":
        v = draw(st.one_of(st.floats(-1e6, 1e6), st.integers(-(2**40), 2**40), st.booleans()))
        return v, np.array([float(v)]), np.ones(1)
    if form == "npscalar":
        dtype, x = draw(source_arrays(_NUMPY).filter(lambda d: d[1].size > 0))
        v = np.dtype(dtype).type(x.flat[0])
        return v, np.array([float(x.flat[0])]), np.ones(1)
    if form == "torch":
        dtype, x = draw(source_arrays(list(_TORCH)))
        if not scalar_ok and x.ndim == 0:  # a 0-d tensor is a number too
            x = x.reshape(1)
        return torch.tensor(x).to(_TORCH[dtype]), x.ravel(), np.ones(x.size)
    dtype, x = draw(source_arrays(_NUMPY))
    if not scalar_ok and x.ndim == 0:
        x = x.reshape(1)
    arr = x.astype(dtype)
    if form == "numpy":
        return arr, x.ravel(), np.ones(x.size)
    if form == "list":
        return (arr.tolist() if x.ndim else [arr.tolist()]), x.ravel(), np.ones(x.size)
    w = draw(st.one_of(st.integers(0, 3), hnp.arrays(np.int64, x.shape, elements=st.integers(0, 3))))
    return (arr, w), x.ravel(), np.broadcast_to(np.asarray(w, np.float64), x.shape).ravel()


_SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308, 5e-324, 1.0, -2.5]


@st.composite
def special_values(draw, reduction):
    """Non-finite and extreme floats as a list, array or tensor (or a number for non-std names)."""
    x = np.array(draw(st.lists(st.sampled_from(_SPECIAL), min_size=1, max_size=6)))
    form = draw(st.sampled_from(["list", "numpy", "torch"] + (["python"] if reduction.kind != "std" else [])))
    value = {"list": x.tolist(), "numpy": x, "torch": torch.tensor(x)}.get(form, float(x[0]))
    x = x[:1] if form == "python" else x
    return value, x, np.ones(x.size)


class Opaque:
    pass


def _gen():
    yield 1.0


# (value, what the message must say); each value is refused whatever the name's reduction
INVALID = [
    (None, "got None"),
    ("1.5", "expected a number"),
    (b"1", "expected a number"),
    ({"a": 1.0}, "expected a number"),
    ({1.0}, "expected a number"),
    (1 + 2j, "not numbers.*complex"),
    (np.complex64(1), "not numbers.*complex"),
    (np.array([1 + 1j, 2]), "not numbers.*complex"),
    (torch.tensor([1 + 1j]), "not numbers.*complex"),
    ([[1.0, 2.0], [3.0]], "not numbers"),
    ([1.0, None], "not numbers"),
    ([1.0, "a"], "not numbers"),
    ([{"a": 1.0}], "not numbers"),
    (Opaque(), "not numbers"),
    (Decimal("1.5"), "not numbers"),
    (np.array(None), "not numbers"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "not numbers"),
    (10**400, "float64 range|too large"),
    ((1.0, 2.0, 3.0), "tuple must be \\(value, weight\\)"),
    (([1.0, 2.0], -1.0), "negative or non-finite weight"),
    (([1.0, 2.0], [1.0, 2.0, 3.0]), "broadcast"),
    (([1.0], torch.tensor([1j])), "not numbers.*complex"),
]
BAD_NAMES = [3, None, b"x", ("a",), 1.5, ""]


# ------------------------------------------------------------------------------------ expectations
def expected(name, xs, ws):
    """numpy's value of the name's reduction over all observations (None: no observation)."""
    x, w = np.concatenate(xs), np.concatenate(ws)
    keep = w > 0
    if not keep.any():
        return None
    x, w = x[keep], w[keep]
    red = resolve(name)
    with np.errstate(all="ignore"):
        if red.kind == "quantile":
            if red.name == "median":  # torch.median: the lower middle value
                return float(np.sort(x)[(x.size - 1) // 2])
            return float(np.quantile(x, red.q))
        mean = np.sum(w * x) / np.sum(w)
        return float(
            {
                "mean": lambda: mean,
                "sum": lambda: np.sum(w * x),
                "count": lambda: np.sum(w),
                "min": lambda: np.min(x),
                "max": lambda: np.max(x),
                "std": lambda: np.sqrt(np.sum(w * (x - mean) ** 2) / np.sum(w)),
            }[red.kind]()
        )


def check_value(name, got, xs, ws):
    """``got`` equals the numpy value up to rounding (exactly where no arithmetic is involved)."""
    want = expected(name, xs, ws)
    x = np.concatenate(xs)
    scale = max(1.0, float(np.abs(x).max()))
    red = resolve(name)
    if red.kind in ("min", "max") or red.name == "median":
        assert got == want, (name, got, want)
    elif red.kind == "std":
        assert math.isclose(got**2, want**2, rel_tol=1e-9, abs_tol=1e-12 * scale**2 * x.size), (
            name,
            got,
            want,
        )
    else:
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12 * scale * x.size), (name, got, want)


def check_special(name, got, xs):
    """Non-finite and extreme data: NaN propagates; min/max/median exact; other values exact where
    no intermediate result can leave the float64 range (else any float, as numpy's own overflow)."""
    x = np.concatenate(xs)
    red = resolve(name)
    with np.errstate(over="ignore"):
        finite_sum = np.abs(x[np.isfinite(x)]).sum()
    assert isinstance(got, float)
    if np.isnan(x).any():
        assert math.isnan(got), (name, got)
        return
    want = expected(name, xs, [np.ones(v.size) for v in xs])
    if red.kind in ("min", "max") or red.name == "median":
        assert got == want, (name, got, want)
    elif red.kind in ("mean", "sum") and len(set(x[np.isinf(x)])) == 1 and finite_sum < 1e308:
        assert got == x[np.isinf(x)][0], (name, got)  # one sign of infinity, no overflow: nothing cancels it
    elif np.isfinite(x).all() and np.abs(x).max() < 1e150:
        check_value(name, got, xs, [np.ones(v.size) for v in xs])


# ------------------------------------------------------------------------------------------ scenario
@st.composite
def scenarios(draw, values=valid_values, max_world=5, max_steps=3):
    """World size, names, per-rank step order and per (step, rank) the calls' dicts, a duplicate
    delivery flag, and maybe one refused metric to slip into one call."""
    world = draw(st.integers(1, max_world))
    names = draw(st.lists(NAMES, min_size=1, max_size=6, unique=True))
    steps = draw(st.integers(1, max_steps))
    orders = [draw(st.permutations(range(steps))) for _ in range(world)]
    data = {}  # (step, rank) -> list of call dicts
    obs = {(s, n): ([], []) for s in range(steps) for n in names}
    for s in range(steps):
        for r in range(world):
            split = draw(st.lists(st.integers(0, 1), min_size=len(names), max_size=len(names)))
            calls = [{}, {}]
            for n, c in zip(names, split):
                value, x, w = draw(values(resolve(n)))
                calls[c][n] = value
                obs[(s, n)][0].append(x)
                obs[(s, n)][1].append(w)
            data[(s, r)] = [c for c in calls if c]
    bad = None
    if draw(st.booleans()):
        bad_name = draw(st.one_of(NAMES, st.sampled_from(BAD_NAMES)))
        assume(bad_name not in names)
        value, problem = draw(st.sampled_from(INVALID))
        bad = (draw(st.integers(0, steps - 1)), draw(st.integers(0, world - 1)), bad_name, value, problem)
    return {"world": world, "names": names, "steps": steps, "orders": orders, "data": data, "obs": obs,
            "bad": bad, "dup": draw(st.booleans())}  # fmt: skip


def submit_all(sc, clients, base):
    """Every rank submits its steps in its own order, closing each explicitly; the refused metric
    raises at its client, naming it and the problem, and the rest of that call goes through."""
    for r, client in enumerate(clients):
        for s in sc["orders"][r]:
            for i, call in enumerate(sc["data"][(s, r)]):
                bad = sc["bad"]
                if bad and (bad[0], bad[1], i) == (s, r, 0):
                    _, _, name, value, problem = bad
                    if not isinstance(name, str) or not name:  # the name is the problem
                        problem = "metric name must be a non-empty str"
                    with pytest.raises(MetricValueError) as info:
                        client.submit_metric({**call, name: value}, step=base + s)
                    msg = str(info.value)
                    assert repr(name)[:200] in msg and re.search(problem, msg), (name, msg)
                else:
                    client.submit_metric(call, step=base + s)
            if sc["dup"] and client._buffer:  # a retried delivery: (client, step, seq) merges once
                client.transport.send(client.credential, [client._buffer[-1]], [])
            client.close_step(base + s)


def check_results(sc, reader, base, check=check_value):
    warned = set()
    for s in range(sc["steps"]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = reader.result(base + s, timeout=20)
        assert res.meta.complete, res.meta
        want = {out_name(n) for n in sc["names"] if expected(n, *sc["obs"][(s, n)]) is not None}
        assert set(res) == want
        assert set(res.meta.empty) == {out_name(n) for n in sc["names"]} - want
        for n in sc["names"]:
            if out_name(n) in res:
                check(n, res[out_name(n)], *sc["obs"][(s, n)][: 2 if check is check_value else 1])
        bad = [n for n, v in res.items() if not math.isfinite(v) and n not in warned]
        warned.update(bad)
        if bad:  # a diverging run is visible: a warning names the non-finite metric (once per name)
            assert any(repr(bad[0])[:100] in str(w.message) for w in caught), caught


def late_submission_is_dropped(sc, clients, reader, base):
    """A contribution to a finalized step does not change its kept result."""
    before = dict(reader.result(base, timeout=1, finalize=True))
    clients[0].submit_metric(sc["data"][(0, 0)][0], step=base)
    clients[0].close_step(base)
    clients[0].flush()
    after = dict(reader.result(base, timeout=1))
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] or (math.isnan(after[k]) and math.isnan(before[k])) for k in after)


# ------------------------------------------------------------------------------------------- local
def local_run(sc, check=check_value):
    worker = LocalMetricWorker()
    clients = [MetricClient(worker, world_size=sc["world"], label=f"rank{r}") for r in range(sc["world"])]
    for c in clients:
        c.register()
    reader = MetricClient(worker)
    submit_all(sc, clients, 0)
    check_results(sc, reader, 0, check)
    late_submission_is_dropped(sc, clients, reader, 0)
    assert worker.engine.late == 1
    assert not worker.engine.pending_steps()


@pytest.mark.slow
@LOCAL
@given(scenarios())
def test_local_valid_values_equal_numpy_and_refusals_name_the_metric(sc):
    local_run(sc)


@pytest.mark.slow
@LOCAL
@given(scenarios(values=special_values))
def test_local_nan_inf_and_extremes_propagate_with_a_warning(sc):
    local_run(sc, check_special)


@settings(LOCAL, max_examples=60)
@given(
    st.one_of(
        st.integers(-3, 0),
        st.integers(2**32 + 1, 2**80),
        st.sampled_from([True, 1.5, "2", None, np.float64(2.0), [2]]),
    )
)
def test_bad_world_size_is_refused_at_the_client(ws):
    client = MetricClient(LocalMetricWorker())
    with pytest.raises(ValueError, match="world_size"):
        client.submit_metric({"x": 1.0}, world_size=ws)


@settings(LOCAL, max_examples=30)
@given(st.one_of(st.integers(max_value=-1), st.sampled_from([True, 1.5, "2"])))
def test_bad_step_is_refused_at_the_client(step):
    client = MetricClient(LocalMetricWorker(), world_size=1)
    with pytest.raises(ValueError, match="step"):
        client.submit_metric({"x": 1.0}, step=step)


@pytest.mark.parametrize("name", ["x/mean", "x/p95", "x/std", "../é/\ud800"])
@pytest.mark.parametrize(("value", "problem"), INVALID, ids=[f"invalid{i}" for i in range(len(INVALID))])
def test_every_invalid_value_is_refused_naming_the_metric_and_the_rest_goes_through(name, value, problem):
    worker = LocalMetricWorker()
    client = MetricClient(worker, world_size=1)
    with pytest.raises(MetricValueError) as info:
        client.submit_metric({"ok/max": [1.0, 2.0], name: value, "ok/mean": 3.0})
    assert repr(name) in str(info.value) and re.search(problem, str(info.value)), str(info.value)
    client.wait_submit()
    assert client.result(0, timeout=5) == {"ok/max": 2.0, "ok/mean": 3.0}


def test_names_with_nul_bytes_do_not_share_a_schema_id():
    worker = LocalMetricWorker()
    a, b = MetricClient(worker, world_size=1), MetricClient(worker, world_size=1)
    a.register(), b.register()  # ranks: the step waits for both
    a.submit_metric({"a": [1.0], "b": [2.0]})
    b.submit_metric({"a\x00mean\x00b": [5.0]})  # hashed naively, the same bytes as the two names above
    for c in (a, b):
        c.wait_submit()
    assert a.result(0, timeout=5) == {"a": 1.0, "b": 2.0, "a\x00mean\x00b": 5.0}


def test_two_names_with_one_result_key_are_refused_not_overwritten():
    worker = LocalMetricWorker()
    client = MetricClient(worker, world_size=1)
    client.submit_metric({"timing_s/gen": 1.0, "perf/delta_time/gen": 2.0})
    with pytest.raises(MetricValueError, match="'perf/delta_time/gen' and metric 'timing_s/gen'"):
        client.wait_submit()
    res = client.result(0, timeout=5)
    assert res == {"perf/delta_time/gen": 1.0} and list(res.meta.refused) == ["perf/delta_time/gen"]
    client.submit_metric({"timing_s/gen": 3.0})
    client.wait_submit()
    assert client.result(1, timeout=5) == {"perf/delta_time/gen": 3.0}


def test_a_colliding_name_is_refused_alone_and_the_step_lists_it():
    """Rank 1 sends ``perf/delta_time/gen`` beside rank 0's ``timing_s/gen``: only that name is
    refused (raised by rank 1's wait_submit, listed in the step's meta); rank 1's other metrics merge."""
    worker = LocalMetricWorker()
    a, b = MetricClient(worker, world_size=2), MetricClient(worker, world_size=2)
    a.register(), b.register()
    a.submit_metric({"timing_s/gen": 1.0, "actor/pg_loss": 0.5, "critic/score/mean": [1.0, 2.0]})
    b.submit_metric({"perf/delta_time/gen": 2.0, "actor/pg_loss": 1.5, "critic/score/mean": [3.0]})
    a.wait_submit()
    with pytest.raises(MetricValueError, match=r"'perf/delta_time/gen'.*other 2 metric\(s\) were merged"):
        b.wait_submit()
    with pytest.warns(RuntimeWarning, match="step 0 is partial"):  # rank 1's gen time never came
        res = a.result(0, timeout=0.5, finalize=True)
    assert dict(res) == {"perf/delta_time/gen": 1.0, "actor/pg_loss": 1.0, "critic/score/mean": 2.0}
    assert res.meta.missing_metrics == {"timing_s/gen": [1, 2]}
    assert "would both be reported as 'perf/delta_time/gen'" in res.meta.refused["perf/delta_time/gen"]


def test_a_step_closed_without_data_finalizes_empty():
    client = MetricClient(LocalMetricWorker(), world_size=1)
    client.wait_submit()  # closed, nothing submitted (say, every metric of the step was refused)
    res = client.result(0, timeout=5)
    assert res == {} and res.meta.complete
    client.submit_metric({"x": 1.0})
    client.wait_submit()
    assert client.result(1, timeout=5) == {"x": 1.0}


def wide_metrics(n):
    """``n`` distinct names (unicode, path-like, every plain reduction) and their values."""
    rng = np.random.default_rng(7)
    suffixes = ["mean", "max", "min", "total", "loss", "ü/../x"]
    names = [f"wide/{i}/é\U0001f600/{suffixes[i % len(suffixes)]}" for i in range(n)]
    return dict(zip(names, rng.normal(size=n).tolist()))


def check_wide(metrics, res, world):
    assert res.meta.complete and len(res) == len(metrics)
    for name, v in metrics.items():
        want = v * world if resolve(name).kind == "sum" else v
        assert math.isclose(res[name], want, rel_tol=1e-12), (name, res[name], want)


def test_local_100k_names_in_one_submit_are_accepted():
    metrics = wide_metrics(100_000)
    worker = LocalMetricWorker()
    clients = [MetricClient(worker, world_size=2) for _ in range(2)]
    for c in clients:
        c.submit_metric(metrics)
        c.wait_submit()
    check_wide(metrics, clients[0].result(0, timeout=30), 2)


# --------------------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_worker(ray_session):
    ray = ray_session
    worker = rlmetrics.get_metric_worker(name=f"fuzz-{uuid.uuid4().hex[:8]}")  # the driver owns it
    incarnation = ray.get(worker.ping.remote())
    yield worker, incarnation
    ray.kill(worker)


_BASES = itertools.count(1)


def ray_run(ray_worker, sc, check=check_value):
    """One scenario on the module's actor, in fresh steps and with fresh clients (departed after)."""
    import ray

    worker, incarnation = ray_worker
    base = next(_BASES) * 100
    clients = [MetricClient(worker, world_size=sc["world"], label=f"rank{r}") for r in range(sc["world"])]
    try:
        for c in clients:
            c.register()
        reader = MetricClient(worker)
        submit_all(sc, clients, base)
        check_results(sc, reader, base, check)
        late_submission_is_dropped(sc, clients, reader, base)
    finally:
        ray.get([worker.depart.remote(c.credential) for c in clients])
    assert ray.get(worker.ping.remote()) == incarnation  # it never died (a restart gets a new id)


@pytest.mark.ray
@RAY
@given(scenarios(max_world=4, max_steps=2))
def test_ray_valid_values_equal_numpy_and_refusals_name_the_metric(ray_worker, sc):
    ray_run(ray_worker, sc)


@pytest.mark.ray
@settings(RAY, max_examples=20)
@given(scenarios(values=special_values, max_world=3, max_steps=2))
def test_ray_nan_inf_and_extremes_propagate_with_a_warning(ray_worker, sc):
    ray_run(ray_worker, sc, check_special)


@pytest.mark.ray
def test_ray_malformed_and_oversized_contributions_are_refused_and_others_complete(ray_worker):
    import ray

    from rlmetrics.packing import pack
    from rlmetrics.wire import VERSION, encode

    worker, incarnation = ray_worker
    base = next(_BASES) * 100
    packed = pack({"z/mean": 1.0})
    for msg, needle in [
        (encode([(base, 0, 10**30, packed)], [], True), "world_size must be an int"),
        (encode([(-1, 0, 1, packed)], [], True), "step must be a non-negative int"),
        (("not", "a", "message"), "malformed message"),
        ((VERSION, [("x",)], [], {}, False), "malformed item"),
    ]:
        reply = ray.get(worker.send.remote("evil", msg))
        assert needle in " ".join(reply.errors.values()), reply
    for keys in [(), (("evil", "x"),), "evil", ((1, 0), ("evil", 0)), (("good", 0),)]:  # a node's keys
        reply = ray.get(worker.send.remote("evil", encode([(base, keys, 2, packed)], [], True)))
        assert reply.errors, (keys, reply)
    good = MetricClient(worker, world_size=1, label="good")
    good.submit_metric({"z/mean": [2.0, 4.0]}, step=base)
    good.close_step(base)
    assert good.result(base, timeout=20) == {"z/mean": 3.0}
    good.stop()
    assert "evil" not in ray.get(worker.stats.remote())["clients"]
    assert ray.get(worker.ping.remote()) == incarnation


@pytest.mark.ray
def test_ray_a_count_of_minus_1e9_and_a_sketch_offset_of_1e15_are_refused_and_the_honest_step_is_numpy(
    ray_worker,
):
    """A raw message to the MetricWorker actor, in the step an honest rank has submitted to and not
    closed yet: a contribution with count -1e9 (it emptied the honest step) and one whose sketch
    has buckets at 1e15 (merged, numpy was asked for 7.1 PiB) are refused, named in the reply and
    in the step's ``meta.refused``; the honest step equals numpy and the actor keeps serving."""
    import ray

    from rlmetrics.core.sketch import Sketch
    from rlmetrics.packing import pack
    from rlmetrics.wire import encode

    worker, incarnation = ray_worker
    base = next(_BASES) * 100
    h = np.random.default_rng(28).normal(size=50)
    good = MetricClient(worker, world_size=1, label="good")
    good.submit_metric({"h/mean": h, "h/p50": h}, step=base)
    good.flush()
    count, offset = (pack({"h/mean": [5.0, 6.0], "h/p50": [5.0, 6.0]}) for _ in range(2))
    count.stats[0, 0] = -1e9
    arr = Sketch.of([5.0, 6.0], weights=[1.0, 2.0]).to_array()
    arr[13] = 1e15  # the positive store's first bucket
    offset.states[1] = Sketch.from_array(arr)
    reply = ray.get(
        worker.send.remote("evil", encode([(base, 0, 1, count), (base, 1, 1, offset)], [base], True))
    )
    whole = " (refused whole: this contribution's 2 metric(s) were not merged, the rest of the message was)"
    assert reply.errors == {
        f"evil/{base}/0": f"step {base}: metric 'h/mean': count -1000000000.0 < 0" + whole,
        f"evil/{base}/1": f"step {base}: metric 'h/p50': sketch: 20 positive buckets from 1000000000000000 "
        "outside [-69077, 70979] (rel_err=0.005)" + whole,
    }
    good.close_step(base)
    res = good.result(base, timeout=20)
    assert res.meta.complete and res.meta.contributors == [good.client_id], res.meta
    assert dict(res) == pytest.approx({"h/mean": h.mean(), "h/p50": np.quantile(h, 0.5)}, rel=1e-12)
    assert {k: f"step {base}: {v}" for k, v in res.meta.refused.items()} == reply.errors
    good.submit_metric({"h/mean": [1.0, 3.0]}, step=base + 1)
    good.close_step(base + 1)
    assert good.result(base + 1, timeout=20) == {"h/mean": 2.0}
    good.stop()
    assert ray.get(worker.ping.remote()) == incarnation


@pytest.mark.ray
def test_ray_100k_names_in_one_submit_are_accepted(ray_worker):
    import ray

    worker, incarnation = ray_worker
    base = next(_BASES) * 100
    metrics = wide_metrics(100_000)
    clients = [MetricClient(worker, world_size=2) for _ in range(2)]
    for c in clients:
        c.submit_metric(metrics, step=base)
        c.close_step(base)
    check_wide(metrics, clients[0].result(base, timeout=60), 2)
    for c in clients:
        c.stop()
    assert ray.get(worker.ping.remote()) == incarnation
