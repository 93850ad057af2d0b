"""The wire format is lossless bit for bit, whatever the values, and refuses malformed data; what it
decodes is checked value by value: a contribution no data gives is refused alone, named, and never
touches another rank's numbers."""

import math
import pickle
import re
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import Stat
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.engine.server import Server
from rlmetrics.messages import Message, SubmissionError
from rlmetrics.metrics.validation import encode_samples, process_validation_metrics
from rlmetrics.metrics.validation.samples import VALIDATION_SAMPLES, Samples
from rlmetrics.packing import Packed, pack
from rlmetrics.wire import SchemaTable, _float_bytes, _floats, decode, encode

doubles = hnp.arrays(np.float64, st.integers(0, 700), elements=st.floats(width=64))
float32s = hnp.arrays(np.float32, st.integers(0, 700), elements=st.floats(width=32)).map(
    lambda a: a.astype(np.float64)
)


@given(st.one_of(doubles, float32s))
def test_round_trip_is_bit_exact(values):
    back = _floats(_float_bytes(values), max(len(values), 1))
    assert back.tobytes() == values.tobytes()  # NaN payloads, -0.0 and inf included


@pytest.mark.parametrize("data", [b"\0" * 12, b"\0" * 8008, (0, b"\0" * 8), bytearray(8), None])
def test_malformed_stats_are_refused(data):
    with pytest.raises(SubmissionError, match="at most 1000 float64s"):
        _floats(data, 1000)


def test_huge_stats_are_refused_without_a_copy():
    data = bytes(8 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(SubmissionError, match="got 8388608 bytes"):
            _floats(data, 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # the refusal names the size; a repr of the bytes would take 32 MiB


# ------------------------------------------------------------------------------- decoded values
# A hostile (or broken) sender's message goes through decode and the engine as on the Ray actor
# (``_MetricWorker.send``), in the step an honest rank submits to. The honest step must equal numpy
# on the honest data, whatever the other message holds.

H = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 3.0])  # the honest rank's observations
E = [5.0, 6.0]  # the other sender's
NAMES = ("x/mean", "x/std", "x/min", "x/max", "x/p50")
SAMPLES = (["gsm8k"] * 4, ["p", "p", "q", "q"], {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["4", "5", "7", "7"]})
WANT = {
    "x/mean": H.mean(), "x/std": H.std(), "x/min": H.min(), "x/max": H.max(), "x/p50": np.quantile(H, 0.5),
    **process_validation_metrics(*SAMPLES),
}  # fmt: skip
STEP = 2


def samples_packed(record, key=(0, 0, 1, "digest")):
    packed = pack({VALIDATION_SAMPLES: float(record.n_samples)})
    packed.states[0] = Samples([(key, record)])
    return packed


def honest_items():
    return [(STEP, 0, 1, pack({n: H for n in NAMES})), (STEP, 1, 1, samples_packed(encode_samples(*SAMPLES)))]


def send(server, table, client_id, msg):
    """What ``_MetricWorker.send`` does with a message: its reply's errors."""
    try:
        items, close, unknown = decode(msg, table)
    except SubmissionError as exc:
        return {client_id: str(exc)}
    assert not unknown
    return server.handle([Message(client_id, items, close)])[0].errors


def run_step(msg, hostile_first):
    """The other message and the honest rank's in either order (the honest rank closes the step
    last: a complete step is finalized at once); the errors of the other message, and the step."""
    server, table = Server(), SchemaTable()
    honest = encode(honest_items(), [], send_names=True)
    if not hostile_first:
        assert send(server, table, "good", honest) == {}
    errors = send(server, table, "evil", msg)
    if hostile_first:
        assert send(server, table, "good", honest) == {}
    assert send(server, table, "good", encode([], [STEP], send_names=False)) == {}
    return errors, server, server.read(STEP).end()


def check_honest_step(res):
    assert res.meta.complete and res.meta.contributors == ["good"], res.meta
    assert dict(res) == pytest.approx(WANT, rel=1e-12, abs=1e-15)


def evil(mutate):
    """The other sender's contribution of ``E`` under the honest names, changed by ``mutate`` (built
    by hand, as pack's output is not changed afterwards)."""
    packed = pack({n: E for n in NAMES})
    mutate(packed)
    return Packed(packed.schema, packed.stats, packed.states)


def setting(*index_value):
    def mutate(packed):
        for index, value in zip(index_value[::2], index_value[1::2]):
            packed.stats[index] = value

    return mutate


def sketch(change, weights=(1.0, 2.0), values=E):
    """A p50 sketch of ``values`` (bucket mode with weights, else exact) whose array ``change`` edits."""

    def mutate(packed):
        arr = Sketch.of(values, weights=weights).to_array()
        change(arr)
        packed.states[4] = Sketch.from_array(arr)

    return mutate


def at(*index_value):
    def change(arr):
        for index, value in zip(index_value[::2], index_value[1::2]):
            arr[index] = value

    return change


def evil_record(change, key=(0, 1, 0, "digest")):
    record = encode_samples(["gsm8k"] * 2, ["r", "r"], {"acc": [0.0, 1.0], "pred": ["1", "1"]})
    change(record)
    return samples_packed(record, key)


def record_set(**fields):
    def change(record):
        for name, value in fields.items():
            setattr(record, name, value)

    return change


def prompt_stats(count):
    from rlmetrics.metrics.difficulty import CORRECT, PROMPT_STATS, REWARDS, PromptStats

    stats = np.stack([Stat.of([1.0]).to_array(), Stat.of([10.0]).to_array()], 1)[:, None, :]
    stats[0, 0, 0] = count
    packed = pack({PROMPT_STATS: 1.0})
    packed.states[0] = PromptStats(
        [("evil", {"uids": ["u"], "groups": [(REWARDS,), (CORRECT,)], "stats": stats})]
    )
    return packed


INF, NAN = math.inf, math.nan
BAD_CONTRIBUTIONS = {  # what the other sender's step-2 contribution is, and what its refusal says
    "count -1e9": (evil(setting((0, 0), -1e9)), "metric 'x/mean': count -1000000000.0 < 0"),
    "count NaN": (evil(setting((0, 0), NAN)), "metric 'x/mean': count nan is not a number"),
    "count inf": (evil(setting((0, 2), INF)), "metric 'x/min': count inf is not finite"),
    "M2 < 0": (evil(setting((2, 1), -5.0)), "metric 'x/std': M2 -5.0 < 0"),
    "min > max": (evil(setting((3, 2), 7.0)), "metric 'x/min': min 7.0 > max 6.0"),
    "a NaN min alone": (evil(setting((3, 3), NAN)), "metric 'x/max': min nan and max 6.0: one of them NaN"),
    "NaN M2 of finite values": (evil(setting((2, 1), NAN)), "metric 'x/std': M2 nan with a finite sum 11.0"),
    "an empty column with a sum": (
        evil(setting((0, 0), 0.0, (2, 0), 0.0, (3, 0), INF, (4, 0), -INF)),
        r"metric 'x/mean': count 0 with sum 11.0, M2 0.0, min inf, max -inf \(a column without",
    ),
    "an empty column with a min": (
        evil(setting((0, 2), 0.0, (1, 2), 0.0, (2, 2), 0.0, (3, 2), -1e9, (4, 2), -INF)),
        "metric 'x/min': count 0 with sum 0.0, M2 0.0, min -1000000000.0",
    ),
    "sketch offset 1e7": (
        evil(sketch(at(13, 1e7))),
        "metric 'x/p50': sketch: 20 positive buckets from 10000000 outside",
    ),
    "sketch offset -1e15": (
        evil(sketch(at(11, -1e15))),
        "sketch: 0 negative buckets from -1000000000000000 outside",
    ),
    "sketch negative weight": (evil(sketch(at(15, -1.0))), "sketch: a weight is negative or not finite"),
    "sketch NaN weight": (evil(sketch(at(6, NAN))), "sketch: a weight is negative or not finite"),
    "sketch more buckets than max_buckets": (
        evil(sketch(at(5, 4.0))),
        "positive buckets, more than max_buckets=4",
    ),
    "sketch too wide to merge": (
        evil(sketch(at(3, 1e-6, 5, 2.0**20))),
        "stores up to 1048576 buckets, more than 65536",
    ),
    "sketch unsorted exact values": (evil(sketch(at(15, 6.0, 16, 5.0), None)), "sorted, without NaN"),
    "sketch NaN exact value": (evil(sketch(at(15, NAN), None)), "sorted, without NaN"),
    "sketch beyond exact_limit": (evil(sketch(at(4, 1.0), None)), "2 exact values, more than 1"),
    "sketch exact with buckets": (evil(sketch(at(9, 1.0), None)), "an exact sketch has buckets"),
    "samples on a sketch's column": (
        evil(lambda p: p.states.update({4: evil_record(lambda r: None).states[0]})),
        "metric 'x/p50': a samples state on a column that carries sketch",
    ),
    "a sketch on a mean's column": (
        evil(lambda p: p.states.update({0: Sketch.of(E)})),
        "metric 'x/mean': a sketch state on a column that carries none",
    ),
    "record group index 5": (
        evil_record(record_set(group=np.array([0, 5]))),
        "group index 5 outside \\[0, 1\\)",
    ),
    "record group index -1": (evil_record(record_set(group=np.array([0, -1]))), "group index -1 outside"),
    "record group index 1e15": (
        evil_record(record_set(group=np.array([0, 10**15]))),
        "group index 1000000000000000 outside",
    ),
    "record data source index": (evil_record(record_set(group_source=np.array([3]))), "data source index 3"),
    "record pred index": (evil_record(record_set(pred=np.array([0, 9]))), "pred index 9 outside \\[0, 1\\)"),
    "record values of another length": (
        evil_record(lambda r: r.values.update(acc=np.zeros(3))),
        "values of 'acc' must be a 1-D float64 array of 2 entries",
    ),
    "record flags without values": (
        evil_record(lambda r: r.numeric.update(zzz=np.ones(2, bool))),
        "flags for variable 'zzz' without values",
    ),
    "record seed": (evil_record(record_set(seed=2**40)), r"seed 1099511627776 outside \[0, 2\*\*32\)"),
    "record style": (evil_record(record_set(style="nope")), "style 'nope' is not one of"),
    "record expected count": (
        evil_record(record_set(expected=[("gsm8k", "r", 10**15)])),
        r"expected \('gsm8k', 'r', 1000000000000000\): not \(source, prompt, count\) with a count in \[0, ",
    ),
    "record unhashable source": (
        evil_record(record_set(sources=[["gsm8k"]])),
        "sources entry .* not hashable",
    ),
    "record rank key": (evil_record(lambda r: None, key=("evil",)), "rank key \\('evil',\\) is not"),
    "prompt record count -1": (
        prompt_stats(-1.0),
        r"prompt record: prompt 'u', \('critic/rewards/mean',\): count -1.0 < 0",
    ),
}


@pytest.mark.parametrize("hostile_first", [True, False], ids=["hostile-first", "honest-first"])
@pytest.mark.parametrize("case", list(BAD_CONTRIBUTIONS))
def test_a_bad_value_is_refused_alone_named_and_the_honest_step_equals_numpy(case, hostile_first):
    """The other sender's message holds the bad contribution for step 2 and a good one for step 3:
    only the bad one is refused, named in the reply (client/step/seq) and in step 2's
    ``meta.refused``; step 2 equals numpy on the honest rank's data, step 3 on the sender's."""
    bad, problem = BAD_CONTRIBUTIONS[case]
    msg = encode(
        [(STEP, 0, 1, bad), (STEP + 1, 1, 1, pack({"y/mean": E}))], [STEP, STEP + 1], send_names=True
    )
    errors, server, res = run_step(msg, hostile_first)
    assert list(errors) == ["evil/2/0"] and errors["evil/2/0"].startswith("step 2: metric '"), errors
    assert re.search(problem, errors["evil/2/0"]), errors
    check_honest_step(res)
    assert list(res.meta.refused) == ["evil/2/0"] and res.meta.refused["evil/2/0"] == errors["evil/2/0"][8:]
    assert server.read(STEP + 1).end() == {"y/mean": 5.5}


NOT_MERGING = {  # valid alone, but not with the honest rank's state of that column
    "a sketch of other parameters": (
        evil(lambda p: p.states.update({4: Sketch.of(E, rel_err=0.01)})),
        "metric 'x/p50': cannot merge sketches with different parameters",
    ),
    "records of other variables": (
        samples_packed(encode_samples(["gsm8k"], ["r"], {"reward": [1.0]}), (0, 1, 0, "digest")),
        r"metric '_aux/validation/samples/total': records have different variables: \['acc', 'pred'\] vs",
    ),
}


@pytest.mark.parametrize("case", list(NOT_MERGING))
def test_a_state_that_does_not_merge_with_the_steps_is_refused_before_anything_of_it_merges(case):
    """After the honest rank's: refused whole, named (a sketch of other parameters raised after the
    contribution's stats were merged; records of other variables failed the step's finalize)."""
    bad, problem = NOT_MERGING[case]
    msg = encode(
        [(STEP, 0, 1, bad), (STEP + 1, 1, 1, pack({"y/mean": E}))], [STEP, STEP + 1], send_names=True
    )
    errors, server, res = run_step(msg, hostile_first=False)
    assert list(errors) == ["evil/2/0"] and re.match(f"step 2: {problem}", errors["evil/2/0"]), errors
    check_honest_step(res)
    assert server.read(STEP + 1).end() == {"y/mean": 5.5}


def test_a_refused_merged_contribution_is_listed_under_each_of_its_senders():
    """A node's forward of several ranks' merged contribution refused: every rank's key names it."""
    engine = Aggregator()
    with pytest.raises(SubmissionError, match="metric 'x/mean': count -1000000000.0 < 0"):
        engine.submit_merged((("a", 0), ("b", 3)), STEP, 2, evil(setting((0, 0), -1e9)))
    assert engine.finalize(STEP).meta.refused == dict.fromkeys(
        ["a/2/0", "b/2/3"],
        "metric 'x/mean': count -1000000000.0 < 0 (refused whole: this contribution's 5 metric(s) were not "
        "merged, the rest of the message was)",
    )


def _far_sketch():
    arr = Sketch.of(E, weights=[1.0, 2.0]).to_array()
    arr[13] = 1e7
    return Sketch.from_array(arr)


@pytest.mark.parametrize(
    "name, stat, problem",
    [
        ("x/mean", Stat(-1.0, 5.0, 0.0, 5.0, 5.0), "metric 'x/mean': the Stat has count -1.0 < 0"),
        (
            "x/p50",
            Stat(3.0, 16.0, 0.5, 5.0, 6.0, sketch=_far_sketch()),
            "metric 'x/p50': sketch: 20 positive",
        ),
    ],
    ids=["count", "sketch"],
)
def test_a_stat_built_by_hand_that_no_data_gives_is_refused_at_the_client_naming_the_metric(
    name, stat, problem
):
    """pack's output is trusted by the engine (its values come from data): a hand-built Stat is
    checked there, and refused alone."""
    from rlmetrics import MetricClient, MetricValueError
    from rlmetrics.backends.local import LocalMetricWorker

    client = MetricClient(LocalMetricWorker(), world_size=1)
    with pytest.raises(MetricValueError, match=re.escape(problem)):
        client.submit_metric({name: stat, "ok/mean": [1.0, 3.0]})
    client.wait_submit()
    assert client.result(0, timeout=5) == {"ok/mean": 2.0}


def message(change):
    """The other sender's message (its E data for step 2, and for step 3) with ``change`` applied to
    the parts of the tuple: ``[version, items, close, schemas, resync]``, items as lists."""
    msg = encode(
        [(STEP, 0, 1, evil(lambda p: None)), (STEP + 1, 1, 1, pack({"y/mean": E}))], [STEP, STEP + 1], True
    )
    parts = [msg[0], [list(item) for item in msg[1]], msg[2], msg[3], msg[4]]
    change(parts)
    parts[1] = [tuple(item) for item in parts[1]] if isinstance(parts[1], list) else parts[1]
    return tuple(parts)


def schema_entry(names, reductions):
    """The schemas of a message: the honest names' entry replaced by ``(names, reductions)``."""

    def change(parts):
        sid = parts[1][0][3]
        parts[3] = {sid: (names, reductions)}

    return change


def item_field(index, value):
    def change(parts):
        parts[1][0][index] = value

    return change


def sketch_header(index, value):
    def change(parts):
        kind, arr = parts[1][0][5][4]
        arr = arr.copy()
        arr[index] = value
        parts[1][0][5] = {4: (kind, arr)}

    return change


MALFORMED = {  # a message decode refuses whole (it raised AttributeError, ValueError, ... or merged)
    "schemas not a dict": (
        lambda parts: parts.__setitem__(3, list(parts[3].items())),
        "schemas must be a dict",
    ),
    "a name not a str": (schema_entry((3,) * 5, ("mean",) * 5), "metric name must be a non-empty str, got 3"),
    "an empty name": (schema_entry(("",) * 5, ("mean",) * 5), "metric name must be a non-empty str, got ''"),
    "an unknown reduction": (schema_entry(NAMES, ("p101",) * 5), "metric 'x/mean': unknown reduction 'p101'"),
    "a reduction not a str": (schema_entry(NAMES, (None,) * 5), "metric 'x/mean': unknown reduction None"),
    "a schema not a pair": (schema_entry("junk", None), "not a \\(names, reductions\\) pair"),
    "a version array": (lambda parts: parts.__setitem__(0, np.array([3, 3])), "wire version"),
    "closes not ints": (
        lambda parts: parts.__setitem__(2, ["x"]),
        "a closed step must be an int in",
    ),
    "closes not a list": (lambda parts: parts.__setitem__(2, None), "closed steps must be a list"),
    "a list as seq": (item_field(1, [0]), "seq must be an int or a node's"),
    "a str as seq": (item_field(1, "0"), "seq must be an int or a node's"),
    "an unhashable key": (item_field(1, (("a", 0), [0])), "malformed item: TypeError: unhashable type"),
    "a state column not an int": (
        lambda parts: parts[1][0].__setitem__(5, {"4": parts[1][0][5][4]}),
        "state columns must be ints",
    ),
    "an infinite state column": (
        lambda parts: parts[1][0].__setitem__(5, {INF: parts[1][0][5][4]}),
        "state columns must be ints",
    ),
    "stats not bytes": (item_field(4, ()), "stats must be the bytes of at most 25 float64s"),
    "stats too long": (item_field(4, bytes(8 * 26)), "stats must be the bytes of at most 25 float64s"),
    "a sketch offset inf": (sketch_header(13, INF), "a parameter, size or offset is not finite"),
    "a sketch exact_limit inf": (sketch_header(4, INF), "a parameter, size or offset is not finite"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_message_is_refused_whole_with_a_submission_error_and_the_honest_step_equals_numpy(case):
    change, problem = MALFORMED[case]
    errors, server, res = run_step(message(change), hostile_first=True)
    assert list(errors) == ["evil"] and re.search(problem, errors["evil"]), errors
    check_honest_step(res)
    assert server.read(STEP + 1).end() == {}  # nothing of the message merged


# ------------------------------------------------------------------------------------ the fuzz
# Messages with at least one value no data gives, anywhere (a stat column, a sketch, a validation
# record, a schema, the message's form), among values drawn from whole ranges (valid or not). Each
# must be refused with a SubmissionError (in the reply), allocate at most a few MiB beyond its size,
# and leave the honest rank's step equal to numpy.

ANY = st.floats()  # NaN, ±inf, ±0.0, subnormals, ±1e308
NEGATIVE = st.floats(max_value=-5e-324)
NOT_A_WEIGHT = st.one_of(NEGATIVE, st.just(NAN), st.just(INF))
POSITIVE = st.floats(min_value=5e-324, max_value=1e300)
OUTSIDE = st.one_of(st.integers(1, 10**15), st.integers(-(10**15), -1))  # an index of a table of one
_LOG_GAMMA = math.log(1.005 / 0.995)  # the default sketch's bucket indices of finite magnitudes:
K_LO, K_HI = math.ceil(math.log(1e-300) / _LOG_GAMMA), math.ceil(math.log(sys.float_info.max) / _LOG_GAMMA)
UNHASHABLE = st.one_of(
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers())
)


@st.composite
def bad_sketch_arrays(draw):
    """A p50 sketch's travelling array (exact or bucket mode) with a value no data gives."""
    exact = draw(st.booleans())
    arr = Sketch.of(E, weights=None if exact else [1.0, 2.0]).to_array()
    free = [6, 7, 8, 9, *range(15, arr.size)]  # weights (and exact values): anything
    for _ in range(draw(st.integers(0, 3))):
        arr[draw(st.sampled_from(free))] = draw(ANY)
    what = draw(st.sampled_from(["offset", "size", "weight", "params", "exact" if exact else "buckets"]))
    if what == "offset":
        arr[draw(st.sampled_from([11, 13]))] = draw(
            st.one_of(st.integers(K_HI + 3, 10**15), st.integers(-(10**15), K_LO - 3))
        )
    elif what == "size":  # the header disagrees with the body
        i = draw(st.sampled_from([10, 12, 14]))
        arr[i] = draw(st.one_of(st.integers(0, 10**15), st.floats()).filter(lambda n, was=arr[i]: n != was))
    elif what == "weight":
        arr[draw(st.sampled_from([6, 7, 8, 9] if exact else free))] = draw(NOT_A_WEIGHT)
    elif what == "params":
        i, value = draw(
            st.one_of(
                st.tuples(
                    st.just(3), st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0))
                ),  # rel_err
                st.tuples(st.just(4), st.one_of(st.integers(max_value=-1), st.integers(2**53 + 1, 10**18))),
                st.tuples(st.just(5), st.one_of(st.integers(max_value=0), st.just(0.5), st.just(NAN))),
            )
        )
        arr[i] = value
        if draw(st.booleans()):  # or fine alone, but a merge might hold too many buckets
            arr[3], arr[5] = draw(st.floats(1e-12, 1e-5)), draw(st.integers(2**17, 2**53))
    elif what == "exact":  # unsorted, a NaN, or more than exact_limit
        arr[15:17], arr[4] = draw(st.sampled_from([((6.0, 5.0), 4096), ((NAN, 6.0), 4096), (tuple(E), 1)]))
    else:  # more buckets than max_buckets
        arr[5] = draw(st.integers(1, int(arr[14]) - 1))
    return arr


@st.composite
def bad_records(draw):
    """The other sender's validation samples, with an index, a length, a table, a seed, an expected
    count or a rank key no client makes."""
    record = encode_samples(["gsm8k"] * 2, ["r", "r"], {"acc": [0.0, 1.0], "pred": ["1", "1"]})
    key = (0, 1, 0, "digest")
    what = draw(
        st.sampled_from(["group", "group_source", "pred", "seed", "length", "expected", "key", "table"])
    )
    if what in ("group", "pred"):
        setattr(record, what, np.array([0, draw(OUTSIDE)], dtype=np.int64))
    elif what == "group_source":
        record.group_source = np.array([draw(OUTSIDE)], dtype=np.int64)
    elif what == "seed":
        record.seed = draw(
            st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32), st.floats(), st.text())
        )
    elif what == "length":
        record.values["acc"] = np.zeros(draw(st.integers(0, 50).filter(lambda n: n != 2)))
    elif what == "expected":
        count = draw(
            st.one_of(st.integers(max_value=-1), st.integers(2**20 + 1, 10**15), st.floats(), st.none())
        )
        record.expected = [("gsm8k", "r", count)]
    elif what == "key":
        key = draw(st.one_of(st.none(), st.text(), st.tuples(st.integers()), st.tuples(*[st.integers()] * 4)))
    else:
        record.sources = [draw(UNHASHABLE)]
    return samples_packed(record, key)


@st.composite
def bad_contributions(draw, kinds):
    """A message whose contribution to step 2 has a value no data gives (one of ``kinds``: in a
    stat column, its sketch, or validation samples), among any others."""
    packed = pack({n: E for n in NAMES})
    stats = packed.stats
    what = draw(st.sampled_from(kinds))
    for _ in range(draw(st.integers(0, 4)) if what != "sketch" else 0):  # (the sketch's are its own)
        stats[draw(st.integers(0, 4)), draw(st.integers(0, 4))] = draw(ANY)
    col = draw(st.integers(0, 4))
    if what == "count":
        stats[0, col] = draw(NOT_A_WEIGHT)
    elif what == "m2":
        stats[2, col] = draw(NEGATIVE)
    elif what == "m2nan":  # a NaN M2 beside a finite sum
        stats[1, col], stats[2, col] = draw(st.floats(allow_nan=False, allow_infinity=False)), NAN
    elif what == "order":  # min > max (neither of them the identity: a summary without it)
        a, b = draw(st.tuples(ANY, ANY).filter(lambda ab: -INF < min(ab) < max(ab) < INF))
        stats[0, col], stats[3, col], stats[4, col] = draw(POSITIVE), max(a, b), min(a, b)
    elif what == "empty":  # no observation, but a sum, an M2, a min or a max
        stats[0, col] = draw(st.sampled_from([0.0, -0.0]))
        field, identity = draw(st.sampled_from([(1, 0.0), (2, 0.0), (3, INF), (4, -INF)]))
        stats[field, col] = draw(ANY.filter(lambda v, identity=identity: v != identity))
    elif what == "nan":  # a NaN min without a NaN max, or the reverse
        nan_at = draw(st.integers(3, 4))
        other = draw(st.floats(allow_nan=False).filter(lambda v, at=nan_at: v != (INF if at == 4 else -INF)))
        stats[0, col], stats[7 - nan_at, col], stats[nan_at, col] = draw(POSITIVE), other, NAN
    elif what == "record":
        return encode([(STEP, 0, 1, draw(bad_records()))], [STEP], send_names=True)
    msg = encode([(STEP, 0, 1, packed)], [STEP], send_names=True)
    if what == "sketch":
        msg[1][0][5][4] = ("sketch", draw(bad_sketch_arrays()))
    return msg


BAD_NAME = st.one_of(st.integers(), st.none(), st.binary(), st.floats(), st.just(""), st.tuples(st.text()))
BAD_REDUCTION = st.one_of(
    st.sampled_from(["p101", "avg", "p-1", "", "quantile", "mean ", "p50.5.1"]),
    st.none(),
    st.integers(),
    st.binary(),
)


NEW_SID = bytes(range(16))


@st.composite
def bad_messages(draw, kinds):
    """A message whose form is wrong (one of ``kinds``): its schemas, its closes, an item's fields,
    or the whole."""
    msg = list(encode([(STEP, 0, 1, evil(lambda p: None))], [STEP], send_names=True))
    item = list(msg[1][0])
    sid = item[3]
    names, reductions = list(NAMES), list(pack({n: E for n in NAMES}).schema.reductions)
    what = draw(st.sampled_from(kinds))
    if what == "schemas":
        msg[3] = draw(st.one_of(st.none(), st.lists(st.integers()), st.text(), st.tuples(st.binary())))
    elif what in ("name", "reduction"):
        (names if what == "name" else reductions)[draw(st.integers(0, 4))] = draw(
            BAD_NAME if what == "name" else BAD_REDUCTION
        )
        msg[3] = {NEW_SID: (tuple(names), tuple(reductions))}
        msg[1] = [(*item[:3], NEW_SID, *item[4:])]  # a schema the receiver learns from this message
    elif what == "lengths":
        msg[3] = {NEW_SID: (tuple(names), tuple(reductions[: draw(st.integers(0, 4))]))}
        msg[1] = [(*item[:3], NEW_SID, *item[4:])]
    elif what == "sid":
        msg[3] = {draw(st.one_of(st.text(), st.integers(), st.none(), st.tuples(st.integers()))): msg[3][sid]}
    elif what == "version":
        msg[0] = draw(st.one_of(st.integers().filter(lambda v: v != 3), st.just(3.0), st.text(), st.none()))
    elif what == "close":
        msg[2] = draw(
            st.one_of(
                st.none(),
                st.lists(st.one_of(st.integers(max_value=-1), st.text(), st.none(), ANY), min_size=1),
            )
        )
    elif what == "items":
        msg[1] = draw(st.one_of(st.none(), st.integers(), st.lists(st.tuples(st.integers()), min_size=1)))
    elif what == "item":
        field, value = draw(
            st.one_of(
                st.tuples(
                    st.just(0), st.one_of(st.integers(max_value=-1), st.floats(), st.text(), st.none())
                ),  # step
                st.tuples(st.just(1), UNHASHABLE),  # seq
                st.tuples(
                    st.just(2), st.one_of(st.integers(max_value=0), st.integers(2**32 + 1), ANY, st.none())
                ),
                st.tuples(
                    st.just(4),
                    st.one_of(
                        st.none(), st.text(max_size=3), st.tuples(st.integers()), st.binary(max_size=300)
                    ),
                ),
                st.tuples(
                    st.just(5),
                    st.one_of(
                        st.none(),
                        st.dictionaries(
                            st.sampled_from(["x", 9, 4.0, -1]),
                            st.tuples(st.text(max_size=3), st.none()),
                            min_size=1,
                        ),
                    ),
                ),
                st.tuples(
                    st.just(6),
                    st.one_of(st.integers(max_value=0), st.integers(2**32 + 1), st.floats(), st.none()),
                ),
            )
        )
        item[field] = value
        msg[1] = [tuple(item)]
    else:
        return draw(
            st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers(), max_size=6).map(tuple))
        )
    return tuple(msg)


FUZZ = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


FAMILIES = {  # 30 examples each
    "stats": bad_contributions(["count", "m2", "m2nan", "order", "empty", "nan"]),
    "sketch": bad_contributions(["sketch"]),
    "record": bad_contributions(["record"]),
    "schema": bad_messages(["schemas", "name", "reduction", "lengths", "sid"]),
    "form": bad_messages(["version", "close", "items", "item", "whole"]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@FUZZ
@given(data=st.data(), hostile_first=st.booleans())
def test_no_message_loses_the_honest_step_raises_but_a_refusal_or_allocates_beyond_its_size(
    family, data, hostile_first
):
    """Only refusals (SubmissionError, in the reply), at most 4 MiB allocated beyond the message's
    size while it is decoded and merged, and the honest step equal to numpy."""
    msg = data.draw(FAMILIES[family], label="message")
    server, table = Server(), SchemaTable()
    honest = encode(honest_items(), [], send_names=True)
    if not hostile_first:
        assert send(server, table, "good", honest) == {}
    size = len(pickle.dumps(msg))
    tracemalloc.start()
    try:
        errors = send(server, table, "evil", msg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert errors and set(errors) <= {"evil", "evil/2/0"}, errors
    assert peak <= size + 4 * 2**20, (peak, size, errors)
    if hostile_first:
        assert send(server, table, "good", honest) == {}
    assert send(server, table, "good", encode([], [STEP], send_names=False)) == {}
    check_honest_step(server.read(STEP).end())


def test_a_nodes_closes_on_behalf_of_its_ranks_travel_as_sent():
    """A node sub-aggregator closes a step for the ranks it speaks for: ``(step, client ids)``."""
    p = pack({"a/mean": 1.0})
    msg = encode([(4, (("rank0", 0), ("rank1", 0)), 2, p)], [(4, ("rank0", "rank1")), 5], send_names=True)
    items, close, unknown = decode(msg, SchemaTable())
    assert (
        close == [(4, ("rank0", "rank1")), 5]
        and unknown == []
        and items[0][1] == (("rank0", 0), ("rank1", 0))
    )
    for bad in [(4, ("rank0", 7)), (-1, ("rank0",)), ("4", ())]:
        with pytest.raises(SubmissionError):
            decode(encode([], [bad], True), SchemaTable())
