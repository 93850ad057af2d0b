"""The package imports without optional extras, and names the extra when one is missing."""

import subprocess
import sys
import textwrap

import pytest

from rlmetrics.extras import require

BLOCK_EXTRAS = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"torch", "ray", "tensordict", "matplotlib", "wandb", "mlflow"}:
                raise ImportError(f"blocked {name}")
    sys.meta_path.insert(0, Block())
    """
)


def test_import_and_core_work_without_extras():
    code = BLOCK_EXTRAS + textwrap.dedent(
        """
        import rlmetrics
        c = rlmetrics.connect("local", world_size=1)
        c.submit_metric({"a/mean": [1.0, 2.0], "a/p50": [1.0, 2.0, 3.0]})
        c.wait_submit()
        print(dict(c.result(0)))
        assert "torch" not in sys.modules and "ray" not in sys.modules
        try:
            rlmetrics.MetricWorker
        except ImportError as exc:
            assert "rlmetrics[ray]" in str(exc), exc
        else:
            raise AssertionError("MetricWorker without Ray")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "{'a/mean': 1.5, 'a/p50': 2.0}" in out.stdout


def test_missing_extra_is_named():
    with pytest.raises(ImportError, match=r"rlmetrics\[trackers\]"):
        require("surely_not_installed_xyz", "trackers")


def test_public_names():
    import rlmetrics

    for name in ("Stat", "Metric", "MetricFunc", "MeanMetric", "MaxMetric", "MinMetric", "SumMetric",
                 "MedianMetric", "PercentileMetric", "register_reduction", "connect", "MetricClient",
                 "SPECIAL_METRICS"):  # fmt: skip
        assert hasattr(rlmetrics, name), name


def rlmetrics_imports(path):
    """The rlmetrics modules a file imports at module level (what importing it runs)."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlmetrics"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("rlmetrics"))
    return names


def test_the_sinks_stand_on_the_messages_and_the_core_only():
    """A tracker needs a step's values and meta, not the client or the engine (issue 32: the
    sinks' import chain ran sinks -> sinks.wandb -> axes -> backends -> client -> server -> ...,
    18 modules, for one string constant)."""
    from pathlib import Path

    import rlmetrics

    allowed = {"rlmetrics.messages", "rlmetrics.health", "rlmetrics.core.histogram", "rlmetrics.core.stat",
               "rlmetrics.extras", "rlmetrics.globs"}  # fmt: skip
    sinks = Path(rlmetrics.__file__).parent / "sinks"
    for path in sorted(sinks.glob("*.py")):
        outside = {m for m in rlmetrics_imports(path) if not m.startswith("rlmetrics.sinks")} - allowed
        assert not outside, (path.name, sorted(outside))


ENGINE_AND_CORE = (
    "engine/aggregator", "client", "engine/columns", "engine/derived", "core/groups", "health",
    "core/histogram", "core/host", "messages", "packing", "core/reduce", "engine/server",
    "core/sketch", "core/stat", "core/states", "engine/steps", "core/summary", "core/values",
    "wire", "engine/store",
)  # fmt: skip


def test_the_engine_and_the_core_import_no_metric_family_tracker_backend_ray_or_torch():
    """The engine merges and reduces what the families declare (state kinds, derived metrics); it
    names none of them (issue 32: ``states`` imported the validation and difficulty families, the
    engine's import chain ran aggregator -> ... -> states -> metrics.difficulty -> metrics.assemble).
    torch is imported only inside functions a tensor reaches, so never loaded by them."""
    import ast
    from pathlib import Path

    import rlmetrics

    root = Path(rlmetrics.__file__).parent
    outside = ("rlmetrics.metrics", "rlmetrics.sinks", "rlmetrics.backends", "rlmetrics.integrations",
               "rlmetrics.cli", "rlmetrics.axes", "rlmetrics.compute_local", "ray")  # fmt: skip
    for module in ENGINE_AND_CORE:
        tree = ast.parse((root / f"{module}.py").read_text())
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not name.startswith(outside), (module, name)
                if node in tree.body:
                    assert name.split(".")[0] != "torch", (module, name)


def test_no_import_circle():
    """No module imports, at its top or inside a function, a module that imports it back (issue
    32: the node sub-aggregator subclassed the root's actor, which imported the node module to
    create nodes). Importing a module's own package and imports only for type checkers are no
    edges."""
    import ast
    from pathlib import Path

    import rlmetrics

    root = Path(rlmetrics.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = ["rlmetrics", *path.relative_to(root).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def typing_only(node):
        return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)

    def imported(path):
        names, todo = set(), list(ast.parse(path.read_text()).body)
        while todo:
            node = todo.pop()
            if typing_only(node):
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            todo.extend(ast.iter_child_nodes(node))
        return names

    graph = {m: {n for n in imported(p) if n in modules and not m.startswith(n + ".") and n != m}
             for m, p in modules.items()}  # fmt: skip
    done, path = set(), []

    def visit(module):
        assert module not in path, " -> ".join([*path[path.index(module) :], module])
        if module not in done:
            path.append(module)
            for other in sorted(graph[module]):
                visit(other)
            path.pop()
            done.add(module)

    for module in sorted(graph):
        visit(module)


def test_dir_of_the_package_is_what_a_user_needs():
    """``dir(rlmetrics)`` is its ``__all__`` (issue 47): no submodule nor the package itself
    (``rlmetrics.rlmetrics`` was the package, bound by its own ``import rlmetrics.metrics``); the
    subpackages the docs name stay importable by attribute."""
    import rlmetrics

    assert dir(rlmetrics) == sorted(rlmetrics.__all__)
    assert "rlmetrics" not in vars(rlmetrics)
    assert rlmetrics.sinks.make_sinks and rlmetrics.health.Monitor
