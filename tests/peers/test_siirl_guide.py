"""docs/siirl.md's switching guide against siiRL 0.2.0's own source: every import line it says to
change, and every call it quotes, is there, in the file and function it names; no other file of
siiRL imports its metrics worker. The guide quotes each line verbatim, so a siiRL release that moves
or rewrites one fails here instead of leaving the guide wrong. Reads the files only (no siiRL import
beyond locating the package)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

SPEC = importlib.util.find_spec("siirl")
if SPEC is None or SPEC.origin is None:
    pytest.skip("siiRL is not installed (make install-peers)", allow_module_level=True)

SIIRL = Path(SPEC.origin).parent
GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "siirl.md").read_text()
OLD = "from siirl.execution.metric_worker.metric_worker import "

# file -> the import the guide changes, and its replacement
IMPORTS = {
    "dag_worker/dagworker.py": (OLD + "MetricClient", "from rlmetrics import MetricClient"),
    "main_dag.py": (OLD + "MetricWorker", "from rlmetrics import MetricWorker"),
}

D, V, M = "dag_worker/dagworker.py", "dag_worker/validator.py", "main_dag.py"
MW = "self.metric_worker."
# (file, function) -> lines of it the guide quotes
CALLS = {
    (D, "DAGWorker.__init__"): ["self.metric_worker = MetricClient(metric_worker=metric_worker)"],
    (M, "MainRunner.run"): ["metric_worker_handle = MetricWorker.remote()"],
    (V, "Validator.__init__"): ["self.metric_worker = metric_worker"],
    (D, "DAGWorker._init_validator"): ["metric_worker=self.metric_worker"],
    (D, "DAGWorker._run_training_step"): [
        MW + "submit_metric(node_output.metrics, cur_dp_size)",
        MW + "compute_local_data_metric(batch, cur_dp_size)",
        MW + "compute_local_throughout_metrics(batch, timing_raw, cur_pp_size * cur_tp_size , cur_dp_size)",
        MW + "compute_local_timing_metrics(batch, timing_raw, 1)",
        MW + "wait_submit()",
        "dist.barrier(self._gather_group)",
        "metrics = self.metric_worker.wait_final_res()",
    ],
    (V, "Validator._validate_text_generation"): [
        MW + "submit_metric(self._aggregate_and_log_validation_metrics(payloads_for_metrics), dp_size)"
    ],
    (V, "Validator._validate_embodied"): [
        MW + "submit_metric(self._aggregate_and_log_embodied_metrics(all_payloads, global_step), dp_size)"
    ],
    (D, "DAGWorker.execute_task_graph"): [MW + "wait_submit()", "val_metrics = " + MW + "wait_final_res()"],
    (D, "DAGWorker._run_training_loop"): [MW + "wait_submit()", "val_metric = " + MW + "wait_final_res()"],
}
QUOTED = [(path, function, line) for (path, function), quoted in CALLS.items() for line in quoted]


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def functions(path: str) -> dict[str, str]:
    """``Class.method`` (or ``function``) -> its source, of a siiRL file."""
    src = (SIIRL / path).read_text()
    out: dict[str, str] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    out[name] = ast.get_source_segment(src, child)
                walk(child, name + ".")

    walk(ast.parse(src), "")
    return out


def test_siirl_is_0_2_0():
    from importlib.metadata import version

    assert version("siirl") == "0.2.0", "the guide quotes siiRL 0.2.0; re-check it for this version"


@pytest.mark.parametrize("path", sorted(IMPORTS))
def test_each_import_line_the_guide_changes_is_in_that_file_once(path):
    old, new = IMPORTS[path]
    assert lines((SIIRL / path).read_text()).count(old) == 1, (path, old)
    assert f"`siirl/{path}`" in GUIDE and f"`{old}`" in GUIDE and f"`{new}`" in GUIDE
    sed = f"s/^{old}$/{new}/"  # the guide's command, applied here to the text
    assert sed in GUIDE, sed
    changed = "\n".join(
        re.sub(f"^{re.escape(old)}$", new, line) for line in (SIIRL / path).read_text().splitlines()
    )
    assert OLD not in changed and new in lines(changed)
    ast.parse(changed)


def test_no_other_siirl_file_imports_its_metric_worker():
    importers = {
        str(f.relative_to(SIIRL))
        for f in SIIRL.rglob("*.py")
        if "execution/metric_worker" not in f.as_posix() and "siirl.execution.metric_worker" in f.read_text()
    }
    assert importers == set(IMPORTS), importers
    assert "siirl.execution.metric_worker" not in (SIIRL / "dag_worker/validator.py").read_text()


@pytest.mark.parametrize(("path", "function", "line"), QUOTED, ids=[f"{f}:{c}" for _, f, c in QUOTED])
def test_each_call_the_guide_quotes_is_in_the_function_it_names(path, function, line):
    source = functions(path)
    assert function in source, (path, function)
    assert line in lines(source[function]), (path, function, line)
    assert line in GUIDE, line
    assert f"`{function}`" in GUIDE, function


def test_the_siirl_client_has_the_methods_the_guide_and_rlmetrics_share():
    import rlmetrics

    client = functions("execution/metric_worker/metric_worker.py")
    for name in ("submit_metric", "wait_submit", "wait_final_res", "compute_local_data_metric",
                 "compute_local_throughout_metrics", "compute_local_timing_metrics",
                 "process_local_validation_metrics"):  # fmt: skip
        assert f"MetricClient.{name}" in client, name
        assert callable(getattr(rlmetrics.MetricClient, name)), name
