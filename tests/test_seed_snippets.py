"""The seed document's usage snippets run on rlmetrics with only their import lines changed.

The snippets below are the seed's "MetricClient Usage Pattern" and "Submit metrics" text; the
names they take from the surrounding training script (dataloader, world_size, step_time, ...) are
given in ``namespace``.
"""

import asyncio
import textwrap

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

pytestmark = [pytest.mark.torch, pytest.mark.ray]

USAGE_PATTERN = """
from rlmetrics import MetricClient, MetricWorker
from examples.seed_metrics import compute_advanced_metrics

# Initialize metric worker and client
metric_worker = MetricWorker.remote()
await metric_worker.start.remote()
metric_client = MetricClient(metric_worker)

# During training loop
for step, batch in enumerate(dataloader):
    # ... training logic ...

    # Submit standard metrics
    metric_client.compute_local_data_metric(batch, world_size)

    # Submit custom metrics
    custom_metrics = compute_advanced_metrics(batch)
    metric_client.submit_metric(custom_metrics, world_size)

    # Submit timing metrics
    timing_data = {"step": step_time, "forward": forward_time}
    metric_client.compute_local_timing_metrics(batch, timing_data, world_size)

    # Wait for metrics to be processed
    metric_client.wait_submit()

# Get final aggregated results
final_metrics = metric_client.wait_final_res()
"""

SUBMIT_METRICS = """
from rlmetrics import MetricClient
from examples.seed_metrics import compute_custom_data_metrics

# In your DAG worker or training script
custom_metrics = compute_custom_data_metrics(batch)
metric_client.submit_metric(custom_metrics, world_size)
"""


def make_batch(seed, batch=4, prompt=6, response=8):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response + 1, (batch,), generator=g)
    response_mask = (torch.arange(response)[None, :] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(batch, prompt, dtype=torch.long), response_mask], dim=1)
    scores = torch.zeros(batch, response)
    scores[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=g).float()
    return tensordict.TensorDict(
        {
            "responses": torch.randint(0, 50, (batch, response), generator=g),
            "prompts": torch.randint(0, 50, (batch, prompt), generator=g),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores,
            "advantages": torch.randn(batch, response, generator=g) * response_mask,
            "returns": torch.randn(batch, response, generator=g) * response_mask,
        },
        batch_size=[batch],
    )


@pytest.fixture(scope="module", autouse=True)
def ray_instance(ray_session):
    yield


def run_snippet(snippet, namespace):
    body = textwrap.indent(snippet, "    ")
    exec(f"async def _snippet():\n{body}\n    return locals()", namespace)
    return asyncio.run(namespace["_snippet"]())


def test_usage_pattern_runs_and_its_final_metrics_are_the_last_step():
    dataloader = [make_batch(s) for s in range(3)]
    scope = run_snippet(USAGE_PATTERN, {"dataloader": dataloader, "world_size": 1, "step_time": 1.5,
                                        "forward_time": 0.5})  # fmt: skip
    final = scope["final_metrics"]
    from rlmetrics.metrics.data import compute_data_metric

    expected = compute_data_metric(dataloader[-1])
    for name, value in expected.items():
        if name != "perf/process_cpu_mem_used_gb":
            assert final[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert final["perf/delta_time/step"] == 1.5  # timing_s/step, renamed as the seed's worker does
    assert "analysis/transition_diversity/mean" in final


def test_submit_metrics_snippet_runs():
    import rlmetrics

    worker = rlmetrics.MetricWorker.remote()
    client = rlmetrics.MetricClient(worker)
    batch = make_batch(7)
    run_snippet(SUBMIT_METRICS, {"batch": batch, "world_size": 1, "metric_client": client})
    client.wait_submit()
    final = client.wait_final_res()
    assert final["custom/response_quality/mean"] >= final["custom/response_quality/min"]
