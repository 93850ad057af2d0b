"""docs/verl.md "Where the calls go in verl 0.9.1" against the installed verl: every file, class and
function it names exists and makes the calls it says; its clip-fraction example's numbers from verl's
``Metric.aggregate_dp``, a per-token count, and rlmetrics' merged ``(value, tokens)``."""

import ast
import importlib.util
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl.utils.metric")

import verl.utils.metric as verl_metric  # noqa: E402

import rlmetrics  # noqa: E402
from rlmetrics.integrations import verl as ours  # noqa: E402
from rlmetrics.integrations.parallel import submitter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "verl.md").read_text(encoding="utf-8")
SECTION = GUIDE[
    GUIDE.index("## Where the calls go in verl 0.9.1") : GUIDE.index("## What changes in the numbers")
]
VERL = Path(importlib.util.find_spec("verl").origin).parent

# file -> {"Class.method" or "function": calls its source makes}; read with ast, nothing imported
# (the Megatron engine imports megatron, which is not installed)
NAMES = {
    "trainer/ppo/ray_trainer.py": {
        "RayPPOTrainer.fit": [
            "Tracking(",
            "compute_data_metrics(",
            "compute_timing_metrics(",
            "compute_throughout_metrics(",
            "compute_variance_proxy_metrics(",
            'reduce_metrics(actor_output.meta_info["metrics"])',
            "logger.log(data=metrics, step=self.global_steps)",
        ],
        "RayPPOTrainer._update_actor": [
            "left_right_2_no_padding(batch_td)",
            "self.actor_rollout_wg.update_actor(batch_td)",
        ],
        "RayPPOTrainer._validate": ["self._val_metrics_update("],
        "RayPPOTrainer._val_metrics_update": ["process_validation_metrics("],
    },
    "utils/tracking.py": {"Tracking.log": []},
    "workers/engine_workers.py": {
        "ActorRolloutRefWorker.update_actor": ["self.actor.train_mini_batch("],
        "TrainingWorker.train_mini_batch": [
            "self.train_batch(mini_batch_td)",
            "self.engine.is_mp_src_rank_with_outputs()",
            "Metric.aggregate_dp(",
        ],
    },
    "workers/utils/losses.py": {"ppo_loss": ["Metric(value=pg_loss", "AggregationType.SUM"]},
    "workers/engine/fsdp/transformer_impl.py": {
        "FSDPEngine.is_mp_src_rank_with_outputs": ['self.ulysses_device_mesh["sp"].get_local_rank() == 0'],
    },
    "workers/engine/megatron/transformer_impl.py": {
        "MegatronEngine.is_mp_src_rank_with_outputs": [
            "mpu.get_tensor_model_parallel_rank() == 0",
            "mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1",
            "mpu.get_context_parallel_rank() == 0",
        ],
    },
}


def definitions(path: Path) -> dict[str, str]:
    """{"Class.method" and "function": source} of a module's top-level functions and methods."""
    text = path.read_text(encoding="utf-8")
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ast.get_source_segment(text, node)
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = ast.get_source_segment(text, item)
    return out


@pytest.mark.parametrize("file", sorted(NAMES))
def test_named_verl_functions_exist_and_make_the_calls(file):
    defs = definitions(VERL / file)
    for name, calls in NAMES[file].items():
        assert name in defs, f"verl/{file} has no {name}"
        source = " ".join(defs[name].split())
        for call in calls:
            assert " ".join(call.split()) in source, f"verl/{file} {name} does not call {call}"


def test_the_section_names_what_the_test_checks():
    """Each file and each function asserted above is named in the section (and nothing is named
    under verl/ that is not checked)."""
    for file, names in NAMES.items():
        assert f"`verl/{file}`" in SECTION, file
        for name in names:
            short = name.split(".")[-1]
            assert re.search(rf"`[\w.]*{re.escape(short)}\b", SECTION), name
    assert set(re.findall(r"`verl/([\w/]+\.py)`", SECTION)) == set(NAMES)


def test_fsdp_mesh_has_the_dims_submitter_reads():
    """verl's FSDP engine builds its Ulysses mesh with dims ("dp", "sp"), which submitter reads."""
    source = (VERL / "workers/engine/fsdp/transformer_impl.py").read_text(encoding="utf-8")
    assert re.search(r"mesh_dim_names=\[\"dp\", \"sp\"\]|mesh_dim_names=\(\"dp\", \"sp\"\)", source)


def test_shown_submitters():
    assert [r for r in range(8) if submitter(rank=r, world_size=8, tp=2, pp=2).submits] == [4, 6]
    assert "# [4, 6]" in SECTION


MICRO = {0: [(0.30, 100), (0.10, 300)], 1: [(0.40, 50), (0.06, 550)]}


def test_clipfrac_example_numbers():
    """verl's aggregate_dp gives the equal-weight mean 0.215; counting clipped tokens one by one
    gives 0.113, which the merged (value, tokens) reproduces; the section shows both."""
    theirs = []
    for batches in MICRO.values():
        m = verl_metric.Metric(verl_metric.AggregationType.MEAN)
        m.extend([v for v, _ in batches])
        theirs.append(m)
    assert float(verl_metric.Metric.aggregate_dp(theirs)) == pytest.approx(0.215, abs=1e-12)
    # per token: a 0/1 flag per token, clip fraction * tokens of them set
    flags = np.concatenate(
        [
            np.r_[np.ones(round(v * t)), np.zeros(t - round(v * t))]
            for batches in MICRO.values()
            for v, t in batches
        ]
    )
    assert flags.size == 1000 and flags.sum() == 113 and flags.mean() == 0.113

    name = f"guide-{uuid.uuid4().hex}"
    clients = [ours.connect("local", world_size=2, name=name, label=f"rank{r}") for r in MICRO]
    try:
        for client, batches in zip(clients, MICRO.values()):
            for value, tokens in batches:
                client.submit_metric({"actor/pg_clipfrac": (value, tokens)})
            client.wait_submit()
        merged = clients[0].result(0, timeout=10)["actor/pg_clipfrac"]
    finally:
        rlmetrics.backends.local.drop_worker(name)
    assert merged == pytest.approx(0.113, rel=1e-12)
    for shown in ("= 0.215", "# 0.215", "# 0.113", "30, 30", "20, 33", "113 of the 1000"):
        assert shown in SECTION, shown
