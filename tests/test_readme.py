"""README.md and docs/: what they show runs, what they link to exists, the tests they cite exist.

- README.md stays a page for users: at most 300 lines.
- Every relative link of README.md and docs/*.md points to an existing file (and, with ``#anchor``,
  to a heading of it).
- Every ``tests/<file>.py::<test>`` they cite (docs/reliability.md: each guarantee → its test) names
  a test function of that file (read with ast, nothing imported).
- Their python blocks that are complete programs run, in a temporary directory. A block that uses a
  name it never defines (``trainer``, ``dp_size``) is a fragment of the user's own program and is
  left out; ``>>>`` blocks are doctests, run by the test of their page (docs/health.md:
  tests/test_health.py). A block is marked ``torch`` / ``ray`` by what it imports, Ray ones ``slow``.
- Every script of examples/ is run by some test.
- docs/benchmarks.md holds one generated report per benchmark script (``benchmarks/report.py``).
- The quick start (siiRL's loop) prints the lines README shows.
"""

import ast
import builtins
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {page: page.read_text(encoding="utf-8") for page in PAGES}
QUICK_START = re.search(r"## Quick start.*?```python\n(.*?)```.*?```\n(.*?)```", TEXTS[README], re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def free_names(code: str) -> set[str]:
    """Names ``code`` reads but never binds (builtins aside): a fragment when not empty.

    >>> sorted(free_names("import numpy as np\\nx = np.ones(3)\\nprint(trainer.step(x))"))
    ['trainer']
    """
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def marks_of(code: str) -> list[pytest.MarkDecorator]:
    """``torch`` / ``ray`` by what the block imports; Ray blocks start Ray: ``slow`` too."""
    imports = re.findall(r"^\s*(?:import|from)\s+([\w.]+)", code, re.M)
    uses = {name.split(".")[0] for name in imports}
    torch = "torch" in uses or "tests" in uses  # tests.syncs imports torch
    ray = "ray" in uses
    return [
        *([pytest.mark.torch] if torch else []),
        *([pytest.mark.ray, pytest.mark.slow] if ray else []),
    ]


def program_blocks() -> list:
    """The complete python programs of README.md and docs/*.md (the quick start has its own test)."""
    out = []
    for page, text in TEXTS.items():
        for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)):
            if code == QUICK_START[1] or ">>>" in code or free_names(code):
                continue
            name = f"{page.relative_to(ROOT)}#{i}"
            out.append(pytest.param(page, code, marks=marks_of(code), id=name))
    return out


BLOCKS = program_blocks()


@pytest.fixture(autouse=True)
def _a_new_ray_instance(monkeypatch):
    """A block's ``ray.init()`` starts its own Ray instance, as on a user's machine with none running,
    never joining the one another pytest worker runs here (``make test`` runs two)."""
    monkeypatch.setenv("RAY_ADDRESS", "local")


def test_readme_is_a_page_for_users():
    lines = TEXTS[README].count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move details to docs/"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading.

    >>> slug("Derived metrics: ratios are computed from merged sums"), slug("`torch_compile=True`")
    ('derived-metrics-ratios-are-computed-from-merged-sums', 'torch_compiletrue')
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def links(text: str) -> list[str]:
    """The link targets of markdown ``text``, outside code blocks and inline code."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    return re.findall(r"\]\(([^)\s]+)\)", prose)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_to_an_existing_file(page):
    broken = []
    for target in links(TEXTS[page]):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert broken == []


def test_docs_link_from_readme():
    """Every page of docs/ is reachable from README (directly or through another page)."""
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in links(TEXTS[page]):
            path = target.partition("#")[0]
            file = (page.parent / path).resolve() if path else page
            if file.suffix == ".md" and file.exists() and file not in reached:
                reached.add(file)
                todo.append(file)
    assert sorted(str(p.relative_to(ROOT)) for p in set(PAGES) - reached) == []


def test_every_cited_test_exists():
    cited = set()
    for text in TEXTS.values():
        cited |= set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", text))
    assert len(cited) > 50  # docs/reliability.md cites its tests
    missing = []
    for path, name in sorted(cited):
        file = ROOT / path
        tree = ast.parse(file.read_text(encoding="utf-8")) if file.exists() else ast.Module(body=[])
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if name not in defined:
            missing.append(f"{path}::{name}")
    assert missing == []


def test_every_example_is_run_by_a_test():
    tests = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("test_*.py"))
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert examples
    assert [e.name for e in examples if f'"{e.name}"' not in tests] == []


def test_some_blocks_run():
    """The fragment rule leaves the runnable pages in (a rule that drops everything fails here)."""
    pages = {param.values[0].name for param in BLOCKS}
    assert {"backends.md", "steps.md", "trackers.md", "metrics.md", "torch-distributed.md"} <= pages


@pytest.mark.parametrize("page,code", BLOCKS)
def test_python_block_runs(page, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks may write runs/...
    monkeypatch.syspath_prepend(str(ROOT))  # tests.syncs
    exec(compile(code, str(page), "exec"), {"__name__": "__main__"})


@pytest.mark.torch
@pytest.mark.ray
@pytest.mark.slow
def test_quick_start_prints_what_readme_shows(capsys):
    """The seed loop of the quick start: each step's line as README shows it."""
    code, shown = QUICK_START.groups()
    exec(compile(code, str(README), "exec"), {})
    printed = [line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert printed == shown.strip().splitlines()


def test_architecture_lists_every_module():
    """docs/architecture.md's module map names every module of the package, and no other."""
    package = ROOT / "src" / "rlmetrics"
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.M))
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    assert (sorted(modules - listed), sorted(listed - modules)) == ([], [])


def test_benchmarks_page_holds_one_generated_report_per_script():
    """Each block of docs/benchmarks.md is a script's ``--markdown`` report (its header line and the
    command that ran), spliced in by benchmarks/report.py; every script has its block."""
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    doc = TEXTS[ROOT / "docs" / "benchmarks.md"]
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "report")
    blocks = dict(re.findall(r"^<!-- (\w+) -->\n(.*?)^<!-- /\1 -->$", doc, re.S | re.M))
    assert sorted(blocks) == scripts
    for name, body in blocks.items():
        assert body.startswith("rlmetrics ") and " benchmark — " in body.splitlines()[0], name
        assert f"`python benchmarks/{name}.py" in body, name
    spliced = report.splice(doc, scripts[0], "new report\n")
    assert f"<!-- {scripts[0]} -->\nnew report\n<!-- /{scripts[0]} -->" in spliced
    assert spliced.replace("new report\n", blocks[scripts[0]]) == doc
    with pytest.raises(ValueError):
        report.splice(doc, "bench_nothing", "x")


def test_a_report_shown_on_another_page_is_the_same_run():
    """A page that shows a benchmark's report (torch-distributed.md) holds a copy of
    docs/benchmarks.md's block, spliced by report.py from the same run: the two cannot diverge."""
    blocks = {}
    for page in PAGES:
        for name, body in re.findall(r"^<!-- (\w+) -->\n(.*?)^<!-- /\1 -->$", TEXTS[page], re.S | re.M):
            blocks.setdefault(name, []).append((page.name, body))
    main = dict(
        re.findall(
            r"^<!-- (\w+) -->\n(.*?)^<!-- /\1 -->$", TEXTS[ROOT / "docs" / "benchmarks.md"], re.S | re.M
        )
    )
    copies = [(name, page) for name, shown in blocks.items() for page, _ in shown if page != "benchmarks.md"]
    assert ("bench_torch", "torch-distributed.md") in copies
    for name, shown in blocks.items():
        for page, body in shown:
            assert body == main[name], f"{page}: the {name} report differs from docs/benchmarks.md's"
