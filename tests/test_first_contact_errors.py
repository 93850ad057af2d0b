"""Mistakes a user makes at first contact, told at once and plainly: ranks that disagree on a
name's ``world_size`` (in-process, Ray, Ray below node sub-aggregators), a bad ``world_size`` given
to ``connect``, an option typo (its owner and close match), and a ``submit_metric`` call refused
in part (the message says what went through)."""

import re
import threading
import time
import uuid
import warnings

import pytest

import rlmetrics
from rlmetrics import MetricClient, MetricValueError
from rlmetrics.backends import local

SLOW_READ = 30.0  # a read that waits this long waited for the deadline (final_timeout=60), not the data


@pytest.fixture
def name():
    name = f"first-contact-{uuid.uuid4().hex[:8]}"
    yield name
    local.drop_worker(name)


def test_a_rank_with_another_world_size_is_told_at_once_and_the_reader_does_not_wait(name):
    """dp size vs world size: two ranks say 2, the third 3. The third's ``wait_submit`` raises naming
    the metric, both values and both ranks; the driver's ``wait_final_res`` returns at once with every
    rank's data and ``meta.conflicts`` naming the name, and warns once."""
    ranks = [
        rlmetrics.connect("local", world_size=3, name=name, label=f"rank{r}", final_timeout=60)
        for r in range(3)
    ]
    driver = rlmetrics.connect("local", name=name)
    for r, client in enumerate(ranks[:2]):
        client.submit_metric({"critic/score/mean": [float(r)], "response/length/mean": [10.0]}, 2)
        client.wait_submit()
    ranks[2].submit_metric({"critic/score/mean": [5.0], "response/length/mean": [10.0]}, 3)
    with pytest.raises(MetricValueError) as err:
        ranks[2].wait_submit()
    text = str(err.value)
    for part in ("'critic/score/mean'", "world_size 3 from rank2", "but 2 from rank0"):
        assert part in text, text
    assert "merged" in text and "data-parallel size" in text, text
    assert "@" not in text and len(text) < 400, text  # ranks by rank<N>, not by host and pid: a few lines
    start = time.monotonic()
    with pytest.warns(rlmetrics.WorldSizeWarning, match=r"'critic/score/mean'.*world_size 3") as caught:
        res = driver.wait_final_res()
        driver.result(0)  # the reader is told once per name
    assert time.monotonic() - start < SLOW_READ
    assert len([w for w in caught if w.category is rlmetrics.WorldSizeWarning]) == 1
    assert res.meta.complete and not res.meta.missing_metrics, res.meta
    assert res["critic/score/mean"] == pytest.approx(2.0)  # (0 + 1 + 5) / 3: nothing lost
    assert set(res.meta.conflicts) == {"critic/score/mean", "response/length/mean"}
    assert "from rank2," in res.meta.conflicts["critic/score/mean"]


def test_two_ranks_two_world_sizes_end_partial_at_the_deadline_saying_why(name):
    """The issue's case: 2 vs 3 for one name, two ranks. The rank is told at once; the name expects
    3 (a third rank may still come), so the step ends at the deadline, and the reader's warning says
    which names are short, by how much, and that their ranks disagree (before: 'missing ranks [],
    1 incomplete metric(s)')."""
    ranks = [rlmetrics.connect("local", name=name, label=f"rank{r}", final_timeout=1) for r in range(2)]
    ranks[0].submit_metric({"critic/score/mean": 1.0}, 2)
    ranks[0].wait_submit()
    ranks[1].submit_metric({"critic/score/mean": 3.0}, 3)
    with pytest.raises(
        MetricValueError, match=r"'critic/score/mean': world_size 3 from rank1, but 2 from rank0 "
    ):
        ranks[1].wait_submit()
    with pytest.warns(rlmetrics.PartialStepWarning) as caught:
        res = rlmetrics.connect("local", name=name).wait_final_res()
    assert dict(res) == {"critic/score/mean": 2.0} and "critic/score/mean" in res.meta.conflicts
    assert res.meta.missing_metrics == {"critic/score/mean": [2, 3]}
    (partial,) = [str(w.message) for w in caught if w.category is rlmetrics.PartialStepWarning]
    assert "every registered rank closed it" in partial and "(2 of 3 contributions)" in partial, partial
    assert "different world_size" in partial, partial


def test_a_conflict_still_waits_for_a_rank_that_registers_later(name):
    """siiRL's ``MetricClient`` registers with its first submission: ranks 2 and 3 (world_size 4, as
    rank 0) submit after ranks 0 and 1 closed step 0, rank 1 gave 2. The step waits for them (the
    name expects the largest world_size given) and merges all four; expecting only what had
    arrived completed the step at 2 contributions and dropped theirs as late."""
    ranks = [rlmetrics.connect("local", name=name, label=f"rank{r}", final_timeout=60) for r in range(4)]
    ranks[0].submit_metric({"reward/mean": [0.0]}, 4)
    ranks[0].wait_submit()
    ranks[1].submit_metric({"reward/mean": [1.0]}, 2)
    with pytest.raises(MetricValueError, match="world_size 2 from rank1, "):
        ranks[1].wait_submit()
    for r in (2, 3):
        ranks[r].submit_metric({"reward/mean": [float(r)]}, 4)
        ranks[r].wait_submit()
    with pytest.warns(rlmetrics.WorldSizeWarning):
        res = ranks[0].result(0, timeout=30, finalize=True)
    assert res.meta.complete and res.meta.late == 0, res.meta
    assert dict(res) == {"reward/mean": 1.5} and len(res.meta.contributors) == 4  # (0 + 1 + 2 + 3) / 4


def test_siirl_pattern_different_names_with_different_world_sizes_stays_valid(name):
    """siiRL submits data metrics with the dp size and rank 0's timings with 1: per name, no error."""
    ranks = [rlmetrics.connect("local", world_size=2, name=name, label=f"rank{r}") for r in range(2)]
    errors = []

    def rank_loop(r, client):
        try:
            for _ in range(3):
                client.submit_metric({"critic/score/mean": [1.0 + r], "actor/pg_loss": 0.5}, 2)
                if r == 0:
                    client.submit_metric({"timing_s/gen": 0.25}, 1)
                client.wait_submit()
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(r, c)) for r, c in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    driver = rlmetrics.connect("local", name=name)
    for step in range(3):
        res = driver.result(step, timeout=10)
        assert res.meta.complete and not res.meta.conflicts, res.meta
        assert dict(res) == {"critic/score/mean": 1.5, "actor/pg_loss": 0.5, "perf/delta_time/gen": 0.25}


@pytest.mark.parametrize("bad", [0, -1, "4", 2.5, True])
def test_connect_refuses_a_bad_world_size_naming_it(bad, name):
    with pytest.raises(ValueError, match=rf"world_size must be an int .*got {bad!r}"):
        rlmetrics.connect("local", world_size=bad, name=name)
    with pytest.raises(ValueError, match=rf"got {bad!r}"):
        MetricClient(local.get_worker(name), world_size=bad)
    client = MetricClient(local.get_worker(name))
    with pytest.raises(ValueError, match=rf"got {bad!r}"):
        client.set_world_size(bad)
    with pytest.raises(ValueError, match=rf"got {bad!r}"):
        client.submit_metric({"x": 1.0}, bad)


@pytest.mark.parametrize(
    ("backend", "option", "said"),
    [
        ("local", "nan_stratgy", "did you mean nan_strategy (a client option)?"),
        ("local", "final_timout", "did you mean final_timeout (an aggregator option)?"),
        ("local", "keep_result", "did you mean keep_results (an aggregator option)?"),
        ("local", "namespace", "it is an option of connect('ray'), not of the 'local' backend"),
        ("local", "result_on", "it is an option of connect('torch'), not of the 'local' backend"),
        ("torch", "blocking", "it is an option of connect('local'), not of the 'torch' backend"),
        ("torch", "nan_stratgy", "did you mean nan_strategy (a client option)?"),
        ("torch", "resul_on", "did you mean result_on (a torch transport option)?"),
    ],
)
def test_an_option_typo_names_its_owner_and_the_close_match(backend, option, said, name):
    """The option belongs to the client, the aggregator, Ray's actor or torch's transport: the error
    says which, before any aggregator or process group is touched (the local one was refused as
    ``Aggregator.__init__() got an unexpected keyword argument``)."""
    with pytest.raises(TypeError) as err:
        rlmetrics.connect(backend, name=name, **{option: 1})
    assert str(err.value) == f"connect({backend!r}): no option {option!r}; {said}"
    with pytest.raises(
        TypeError, match=r"LocalMetricWorker\(\): no option 'nan_strategy'; it is a client option"
    ):
        local.get_worker(name, nan_strategy="drop")
    client = rlmetrics.connect("local", name=name, nan_strategy="drop", final_timeout=5.0, world_size=1)
    assert client.nan_strategy == "drop" and local.get_worker(name).server.final_timeout == 5.0


def test_a_call_refused_in_part_says_what_was_submitted(name):
    """One bad value among 13: the message names it and says the other 12 went through, as they did."""
    client = rlmetrics.connect("local", world_size=1, name=name)
    metrics = {f"actor/loss_{i}/mean": float(i) for i in range(12)}
    metrics["actor/entropy/mean"] = "high"
    with pytest.raises(MetricValueError) as err:
        client.submit_metric(metrics)
    text = str(err.value)
    assert "'actor/entropy/mean'" in text and "12 metric(s) of this call were submitted" in text, text
    assert "for step 0" in text, text
    client.wait_submit()
    assert len(client.result(0)) == 12


def test_a_name_refused_by_the_aggregator_says_the_rest_was_merged(name):
    """``timing_s/gen`` is reported as ``perf/delta_time/gen``: the second is refused at the
    aggregator, the message from ``wait_submit`` says what of the submission was merged."""
    client = rlmetrics.connect("local", world_size=1, name=name)
    client.submit_metric({"timing_s/gen": 1.0, "perf/delta_time/gen": 2.0, "actor/pg_loss": 0.1})
    with pytest.raises(MetricValueError, match=r"'perf/delta_time/gen'.*other 2 metric\(s\) were merged"):
        client.wait_submit()
    assert dict(client.result(0)) == {"perf/delta_time/gen": 1.0, "actor/pg_loss": 0.1}


# ------------------------------------------------------------------------------------ Ray
class Rank:
    """A siiRL DAG worker: a ``MetricClient`` of the driver's ``MetricWorker`` (or, with
    ``hierarchy``, a ``connect``ed rank), ``submit_metric(dict, world_size)`` then ``wait_submit()``."""

    def __init__(self, rank, worker=None, name=None, hierarchy=None):
        if worker is not None:
            self.client = MetricClient(worker, label=f"rank{rank}")
        else:
            self.client = rlmetrics.connect(
                "ray", name=name, world_size=3, label=f"rank{rank}", hierarchy=hierarchy
            )
        self.rank = rank

    def client_id(self):
        return self.client.client_id

    def step(self, world_size):
        self.client.submit_metric({"critic/score/mean": [float(self.rank)], "actor/pg_loss": 0.5}, world_size)
        try:
            self.client.wait_submit()
        except MetricValueError as exc:
            return str(exc)
        return None


def _ranks(ray, n, **kwargs):
    actors = [ray.remote(num_cpus=0)(Rank).remote(r, **kwargs) for r in range(n)]
    return actors, ray.get([a.client_id.remote() for a in actors])


@pytest.mark.ray
@pytest.mark.slow
def test_ray_a_rank_with_another_world_size_is_told_at_once(ray_session):
    """The seed's loop on Ray: the driver's ``MetricWorker``, a ``MetricClient`` per rank actor.
    Step 0 is right (every rank registers), in step 1 rank 2 passes 3 instead of the dp size 2."""
    ray = ray_session
    worker = rlmetrics.get_metric_worker(f"fc-{uuid.uuid4().hex[:8]}", final_timeout=60)
    actors, ids = _ranks(ray, 3, worker=worker)
    driver = MetricClient(worker)
    try:
        assert ray.get([a.step.remote(3) for a in actors]) == [None] * 3
        assert driver.wait_final_res().meta.complete
        assert ray.get([a.step.remote(2) for a in actors[:2]]) == [None, None]
        error = ray.get(actors[2].step.remote(3))
        assert error is not None and "'critic/score/mean'" in error and "world_size 3" in error, error
        assert "from rank2, but 2 from rank" in error and "@" not in error, error
        start = time.monotonic()
        res = driver.wait_final_res()
        assert time.monotonic() - start < SLOW_READ
        assert (
            res.step == 1 and not res.meta.missing_metrics and res["critic/score/mean"] == pytest.approx(1.0)
        )
        assert "from rank2," in res.meta.conflicts["critic/score/mean"]
    finally:
        for a in actors:
            ray.kill(a)
        ray.kill(worker)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_node_hierarchy_the_root_names_the_ranks_too(ray_session):
    """Below a node sub-aggregator the rank is told by its node, and the root, which sees the node's
    merged forwards, still names the ranks on each side in ``meta.conflicts``, the one that came
    second as the odd one (a node forwarded its groups sorted by world_size: the root blamed the first)."""
    ray = ray_session
    name = f"fc-{uuid.uuid4().hex[:8]}"
    root = rlmetrics.get_metric_worker(name, final_timeout=60)
    actors, ids = _ranks(ray, 3, name=name, hierarchy="node")
    driver = rlmetrics.connect("ray", name=name)
    try:
        assert ray.get([a.step.remote(3) for a in actors[:2]]) == [None, None]
        error = ray.get(actors[2].step.remote(2))  # the odd one gives the smaller value
        assert error is not None and "'critic/score/mean'" in error and "from rank2," in error, error
        assert re.search("but 3 from rank[01] ", error) and "@" not in error, error
        start = time.monotonic()
        res = driver.wait_final_res()
        assert time.monotonic() - start < SLOW_READ
        assert not res.meta.missing_metrics and res["critic/score/mean"] == pytest.approx(1.0), res.meta
        why = res.meta.conflicts["critic/score/mean"]  # the root blames the rank that came second too
        assert re.search("world_size 2 from rank2, but 3 from rank[01] ", why), why
    finally:  # the node actor first: a rank owns it, so it may be gone once the ranks are
        node = ray.get_runtime_context().get_node_id()
        ray.kill(ray.get_actor(f"{name}/node/{node}"))
        for a in actors:
            ray.kill(a)
        ray.kill(root)


def _timing_batch(rank):
    import torch

    b = 2 + rank  # the ranks' batches differ in size
    mask = torch.ones(b, 6, dtype=torch.long)
    mask[:, -rank - 1 :] = 0
    return {"responses": torch.zeros(b, 2), "attention_mask": mask, "global_token_num": mask.sum(-1).tolist()}


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"timing": {"gen": "1.0"}}, "timing_raw['gen'] is '1.0' (str), not a number of seconds"),
        ({"timing": {"gen": None}}, "timing_raw['gen'] is None (NoneType), not a number of seconds"),
        ({"timing": {"gen": [1.0, 2.0]}}, "timing_raw['gen'] is [1.0, 2.0] (list), not a number of seconds"),
        ({"n_gpu": 0}, "the GPU count (n_gpu) is 0 (int)"),
        ({"n_gpu": -1}, "the GPU count (n_gpu) is -1 (int)"),
        ({"n_gpu": float("nan")}, "the GPU count (n_gpu) is nan (float)"),
        ({"n_gpu": "2"}, "the GPU count (n_gpu) is '2' (str)"),
    ],
)
def test_a_timing_value_or_gpu_count_that_is_no_number_is_refused_at_the_call(bad, said, name):
    """Rank 1 passes a bad timing value or ``n_gpu``: its call raises MetricValueError naming the
    stage or argument and the value (it was dropped with a DEBUG log and the step waited the whole
    deadline, or the rank was silently left out of perf/throughput); the call's other names went
    through, and the step ends at once. A stage resubmitted fixed gives every number of a run
    without the slip; a bad ``n_gpu`` leaves rank 1 out of that step's perf/throughput only."""
    pytest.importorskip("torch")
    good_timing, good_gpus = {"gen": 1.0, "update_actor": 2.0, "step": 4.0}, 2

    def run(label, slip):
        clients = [
            rlmetrics.connect("local", world_size=2, name=label, rank=r, final_timeout=60) for r in (0, 1)
        ]
        for rank, client in enumerate(clients):
            timing = {**good_timing, "gen": 1.0 + rank}
            batch = _timing_batch(rank)
            if slip and rank == 1 and "timing" in bad:
                with pytest.raises(MetricValueError) as err:
                    client.compute_local_timing_metrics(batch, {**timing, **bad["timing"]})
                assert said in str(err.value) and "the step does not wait for them" in str(err.value)
                client.compute_local_timing_metrics(batch, {"gen": timing["gen"]})  # the fixed value alone
            else:
                client.compute_local_timing_metrics(batch, timing)
            if slip and rank == 1 and "n_gpu" in bad:
                with pytest.raises(MetricValueError) as err:
                    client.compute_local_throughput_metrics(batch, timing, bad["n_gpu"])
                assert said in str(err.value) and "pass the GPUs its batch ran on" in str(err.value)
                assert "left out of this step's perf/throughput" in str(err.value)
            else:
                client.compute_local_throughput_metrics(batch, timing, good_gpus)
            client.wait_submit()
        start = time.monotonic()
        result = clients[0].result(0, timeout=60)
        assert time.monotonic() - start < SLOW_READ
        local.drop_worker(label)
        return result

    got, want = run(name, slip=True), run(f"{name}-reference", slip=False)
    if "n_gpu" in bad:  # rank 0's own tokens / (seconds x GPUs)
        tokens0 = sum(_timing_batch(0)["global_token_num"])
        want = {**want, "perf/throughput": tokens0 / (good_timing["step"] * good_gpus)}
    assert got.meta.complete and dict(got) == pytest.approx(dict(want))
    assert {"perf/throughput", "perf/delta_time/gen", "timing_per_token_ms/gen"} <= set(got)


def test_connect_names_the_client_options_in_its_signature():
    """``help(connect)`` and an editor show the client options by name; the backend's options go
    through ``**options`` (checked against the backend's table)."""
    import inspect

    from rlmetrics.backends.options import CLIENT

    params = inspect.signature(rlmetrics.connect).parameters
    assert set(CLIENT) <= set(params), sorted(params)
    assert all(params[o].kind is inspect.Parameter.KEYWORD_ONLY for o in CLIENT)


@pytest.mark.parametrize("bad", [{"nan_strategy": "bad"}, {"rank": -1}])
def test_a_refused_connect_leaves_no_aggregator_behind(bad, name):
    """A ``connect`` refused for a client option makes no aggregator: the next ``connect`` of the
    name creates it with its own options (before, the refused call's ``final_timeout=1`` stayed)."""
    with pytest.raises(ValueError):
        rlmetrics.connect("local", name=name, world_size=2, final_timeout=1.0, **bad)
    rlmetrics.connect("local", name=name, world_size=2, final_timeout=3.0)
    assert local.get_worker(name).server.final_timeout == 3.0


def test_result_of_no_step_says_to_pass_one(name):
    """``result(None)`` names the argument and the read that takes none (it read the newest step
    as ``wait_final_res`` would, and made the reader the logging one)."""
    client = rlmetrics.connect("local", name=name, world_size=1)
    with pytest.raises(TypeError, match=r"step must be an int, got None; wait_final_res\(\) reads"):
        client.result(None)


@pytest.mark.parametrize("step", [-5, 2**60])
def test_result_of_a_step_no_rank_can_submit_is_refused_naming_it(step, name):
    """``result(-5)`` read an evicted step: ``{}`` and a warning about the ranks' progress."""
    client = rlmetrics.connect("local", name=name, world_size=1)
    with pytest.raises(ValueError, match=rf"result\(step\): step must be an int in \[0, .*got {step}"):
        client.result(step, timeout=0.1)


@pytest.mark.parametrize("step", [2.5, -1, True])
def test_straggler_and_validation_calls_refuse_a_bad_step(step, name):
    """They took ``int(step)``: 2.5 went to step 2, -1 was accepted."""
    client = rlmetrics.connect("local", name=name, world_size=1)
    with pytest.raises(ValueError, match=r"step must be an int in \[0, "):
        client.compute_local_straggler_metrics({"gen": 1.0}, step=step)
    with pytest.raises(ValueError, match=r"step must be an int in \[0, "):
        client.process_local_validation_metrics(["ds"], ["p"], {"acc": [1.0]}, step=step)


def test_a_partial_step_missing_only_a_rank_says_so_without_an_empty_metric_list(name):
    """Every metric complete, one registered rank silent: the warning counted "0 incomplete
    metric(s): " and named none."""
    a, b = (rlmetrics.connect("local", name=name, world_size=1, label=f"rank{r}") for r in range(2))
    a.submit_metric({"loss": 1.0})
    a.wait_submit()
    with pytest.warns(rlmetrics.PartialStepWarning) as caught:
        a.result(0, timeout=0.1, finalize=True)
    text = str(caught[0].message)
    assert "rank1" in text and "incomplete metric" not in text and "all its contributions" in text, text


def test_pack_refuses_an_unknown_nan_strategy():
    """A scalar went through with ``nan_strategy="bogus"``; a list was refused as a bad value."""
    from rlmetrics.packing import pack

    with pytest.raises(ValueError, match="nan_strategy must be one of .*got 'bogus'"):
        pack({"a/mean": 2.0}, nan_strategy="bogus")


@pytest.mark.ray
def test_get_metric_worker_refuses_a_bad_hierarchy_before_creating_anything(ray_session):
    """The root actor was created, then the ValueError raised: a second call found it."""
    name = f"fc-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match="hierarchy must be None or 'node', got 'bogus'"):
        rlmetrics.get_metric_worker(name, hierarchy="bogus")
    with pytest.raises(ValueError, match="hierarchy must be None or 'node', got 'bogus'"):
        rlmetrics.connect("ray", name=name, world_size=1, hierarchy="bogus")
    assert name not in {a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)}


def test_a_step_passed_to_wait_submit_but_not_to_submit_metric_is_told(name):
    """verl's 1-based loop with ``step=`` on ``wait_submit`` only: step 0's data stayed open and the
    reader's step 1 came back empty and complete, without a word."""
    client = rlmetrics.connect("local", name=name, world_size=1)
    client.submit_metric({"loss": 1.0})  # the client's counter: step 0
    with pytest.warns(rlmetrics.StepWarning, match=r"closes step 1, but .* step\(s\) \[0\], which stay open; "
                      r"submit_metric without step= .*submit_metric\(\.\.\., step=1\)"):  # fmt: skip
        client.wait_submit(step=1)
    client.submit_metric({"loss": 2.0})  # the counter followed: step 2, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.wait_submit(step=2)
    assert client.result(2, timeout=5)["loss"] == 2.0


def test_a_reduction_registered_after_a_names_first_submission_is_said_at_the_aggregator(name, caplog):
    """The client's cached schema kept the old reduction: the registration did nothing, silently."""
    a, b = (rlmetrics.connect("local", name=name, world_size=2, label=f"rank{r}") for r in range(2))
    reader = rlmetrics.connect("local", name=name)
    for step in range(2):
        if step == 1:
            rlmetrics.register_reduction("custom/latency", "max")
        for client, value in ((a, 1.0), (b, 5.0)):
            client.submit_metric({"custom/latency": value})
            client.wait_submit()
        with caplog.at_level("WARNING", logger="rlmetrics"):
            assert reader.result(step, timeout=10)["custom/latency"] == 3.0  # the run's first reduction
    said = [r.getMessage() for r in caplog.records if "requested, keeping" in r.getMessage()]
    assert len(said) == 1 and "'custom/latency'" in said[0], said
    assert "before a name's first submit_metric" in said[0], said


def test_wait_final_res_before_any_rank_closed_a_step_waits_and_ends_nothing(name):
    """A reader that reads before the ranks' first ``wait_submit`` (one rank flushed already): the
    read took the step for a direct round and ended it partial at once, and the other rank's data
    was dropped as late."""
    a, b = (rlmetrics.connect("local", name=name, world_size=2, label=f"rank{r}") for r in range(2))
    reader = rlmetrics.connect("local", name=name)
    a.submit_metric({"loss": 1.0})
    a.flush()
    start = time.monotonic()
    with pytest.warns(
        rlmetrics.StepWarning, match=r"no rank has closed a step within the timeout \(registered: "
    ):
        early = reader.wait_final_res(timeout=0.5)
    assert time.monotonic() - start >= 0.5 and early.step == -1 and not early, early
    b.submit_metric({"loss": 3.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a.wait_submit()
        b.wait_submit()
        res = reader.wait_final_res(timeout=10)
    assert res.step == 0 and res.meta.complete and res["loss"] == 2.0, res.meta


def test_straggler_and_validation_calls_check_their_arguments_first_naming_the_call(name):
    """A bad step was found after the samples were encoded (a value error hid it), and a missing
    world_size named an internal column (``_aux/validation/samples/total``)."""
    client = rlmetrics.connect("local", name=name, nan_strategy="error")
    with pytest.raises(ValueError, match="^process_local_validation_metrics needs world_size"):
        client.process_local_validation_metrics(["ds"], ["p"], {"acc": [1.0]})
    with pytest.raises(ValueError, match="^compute_local_straggler_metrics needs world_size"):
        client.compute_local_straggler_metrics({"gen": 1.0})
    with pytest.raises(ValueError, match=r"step must be an int in \[0, "):
        nan = {"acc": [float("nan")]}
        client.process_local_validation_metrics(["ds"], ["p"], nan, world_size=1, step=2.5)


@pytest.mark.parametrize(("step", "error"), [(-1, ValueError), (1.5, TypeError), (None, TypeError)])
def test_tracking_refuses_a_step_its_own_reader_would_refuse(step, error, tmp_path):
    """``log(m, -1)`` was written, then refused by ``read_jsonl``; 1.5 raised a TypeError not naming step."""
    from rlmetrics.sinks import make_sinks

    with make_sinks(["jsonl"], tmp_path) as tracking:
        with pytest.raises(error, match="^step must be an int"):
            tracking.log({"a": 1.0}, step)
