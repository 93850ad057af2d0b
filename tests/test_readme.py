"""README.md and docs/: what they show runs, what they link to exists, the tests they cite exist.

- README.md stays a page for users: at most 300 lines.
- Every relative link of README.md and docs/*.md points to an existing file (and, with ``#anchor``,
  to a heading of it).
- Every ``tests/<file>.py::<test>`` they cite (docs/reliability.md: each guarantee → its test) names
  a test function of that file (read with ast, nothing imported).
- Every python block runs as pasted into a fresh interpreter and prints what the page shows next to
  it (``test_page_runs_as_pasted`` says how a page shows it, and how a block says it is a fragment).
- Every script of examples/ is run by some test.
- docs/benchmarks.md holds one generated report per benchmark script (``benchmarks/report.py``).
"""

import ast
import builtins
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {page: page.read_text(encoding="utf-8") for page in PAGES}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FRAGMENT = "# fragment:"
CHECKOUT = "# from the root of a source checkout"


def free_names(code: str) -> set[str]:
    """Names ``code`` reads but never binds (builtins aside).

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
    """``torch`` / ``ray`` by what the code imports; Ray code starts Ray: ``slow`` too."""
    uses = {name.split(".")[0] for name in re.findall(r"^\s*(?:import|from)\s+([\w.]+)", code, re.M)}
    torch = "torch" in uses or "tests" in uses  # tests.syncs imports torch
    ray = "ray" in uses
    return [
        *([pytest.mark.torch] if torch else []),
        *([pytest.mark.ray, pytest.mark.slow] if ray else []),
    ]


def shown_output(code: str, after: tuple[str, str] | None) -> str:
    """What a page shows a block prints: the ``text`` block right after it, else the trailing comments
    of its ``print(`` lines, one line of output each.

    >>> shown_output("x = '#'\\nprint(x)  # #\\nprint(x, 2)  # # 2", None), shown_output("", ("text", "2\\n"))
    ('#\\n# 2\\n', '2\\n')
    """
    if after and after[0] == "text":
        return after[1]
    lines = code.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    said = [
        t.string.removeprefix("# ")
        for t in tokens
        if t.type == tokenize.COMMENT and lines[t.start[0] - 1].lstrip().startswith("print(")
    ]
    return "".join(line + "\n" for line in said)


def programs() -> list:
    """The python blocks of README.md and docs/*.md as a reader pastes them (see
    ``test_page_runs_as_pasted``): one ``pytest.param(code, shown, checkout)`` per fresh interpreter."""
    out = []
    for page, text in TEXTS.items():
        fences = FENCE.findall(text)
        groups: list[list[tuple[str, str]]] = []
        for i, (lang, code) in enumerate(fences):
            if lang != "python" or ">>>" in code or code.startswith(FRAGMENT):
                continue
            shown = shown_output(code, fences[i + 1] if i + 1 < len(fences) else None)
            if groups and free_names(code):
                groups[-1].append((code, shown))
            else:
                groups.append([(code, shown)])
        for n, blocks in enumerate(groups):
            code, shown = ("".join(parts) for parts in zip(*blocks))
            checkout = any(c.startswith(CHECKOUT) for c, _ in blocks)
            name = f"{page.relative_to(ROOT)}#{n}"
            out.append(pytest.param(code, shown, checkout, marks=marks_of(code), id=name))
    return out


PROGRAMS = programs()


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
    examples = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
    assert examples
    assert [e.name for e in examples if f'"{e.name}"' not in tests] == []


def test_some_blocks_run():
    """The fragment rule leaves the runnable pages in (a rule that drops everything fails here)."""
    pages = {p.id.partition("#")[0] for p in PROGRAMS}
    runs = {"README.md", "docs/backends.md", "docs/steps.md", "docs/trackers.md", "docs/torch-distributed.md"}
    assert runs <= pages


@pytest.mark.parametrize("code,shown,checkout", PROGRAMS)
def test_page_runs_as_pasted(code, shown, checkout, tmp_path):
    """A page's python blocks, pasted in order into a fresh interpreter, print what the page shows.

    Each block runs in a new ``python -`` (its code on stdin) in an empty directory (blocks may write
    ``runs/...``) with nothing on the path but the package (``src``). A block that builds on the
    page's previous one (reads names it does not bind) is pasted after it into the same interpreter.
    What the page shows a block prints, compared with its output:

    - the page's next code block if it is ```` ```text ```` (prose may come between), whole; else
    - the trailing comment of each of its lines that start with ``print(``: that line of output
      (``print(x)  # 2.5``). A block with neither prints nothing.

    So pages show deterministic output (seeded data, rounded floats). Two first lines a reader sees:

    - ``# fragment: <what your program supplies>``: a piece of the reader's own program (inside a
      trainer, where ``batch`` exists); not run. ``>>>`` blocks are doctests, run by their page's test
      (docs/health.md: tests/test_health.py).
    - ``# from the root of a source checkout ...``: it imports ``tests`` (not installed), so it runs
      with the checkout as working directory.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_ADDRESS": "local"}  # a Ray of its own
    cwd = ROOT if checkout else tmp_path
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=cwd, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.rstrip() for line in out.stdout.splitlines()] == shown.splitlines()


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
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("report", "run"))
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
