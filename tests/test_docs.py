"""The docs: every ```python block in README.md, docs/*.md and the demo pair's README runs, in
order, one namespace per file; every script in examples/ runs; .ci/run runs exactly the test
command that README.md gives; docs/api.md is what scripts/api_docs.py writes from the docstrings
now; every relative link resolves; and no page quotes a date, a commit or a machine path (results
record theirs in their files under docs/results/)."""

import difflib
import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "mlx_spec" / "demo" / "README.md",
]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


@pytest.mark.parametrize("path", DOCS, ids=page_id)
def test_code_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(python_blocks(path)):
        code = compile(block, f"{path.name} block {i + 1}", "exec")
        exec(code, namespace)


def test_quickstart_runs_and_keeps_the_agreeing_prefix():
    # The example's greedy draft agrees with the target's argmax on its first two tokens only.
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"^greedy: .* -> keep 2, then \d+", run.stdout, re.MULTILINE), run.stdout
    assert len(re.findall(r"^batched: \(\d+, \d+, (True|False)\)$", run.stdout, re.MULTILINE)) == 4


def test_readme_has_python_examples():
    assert python_blocks(ROOT / "README.md")


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(python -m pip install .*pytest.*)$", readme, re.MULTILINE)
    assert len(commands) == 1, "README.md must give exactly one test command"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci


@functools.cache
def api_docs():
    """``scripts/api_docs.py``, imported as a module."""
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_generated_from_the_docstrings():
    # A fresh Sphinx build of the page (a few seconds), with the versions the test extra pins.
    written = (ROOT / "docs" / "api.md").read_text()
    generated = api_docs().render()
    diff = "".join(
        list(difflib.unified_diff(written.splitlines(True), generated.splitlines(True)))[:60]
    )
    assert written == generated, (
        f"docs/api.md is out of date: run python scripts/api_docs.py\n{diff}"
    )


def test_performance_page_is_generated_from_the_results():
    # Numbers live in docs/results/ (each with its command and commit) and this page alone.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "performance.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> set[str]:
    """The anchors of ``path``: those GitHub gives its headings, and its ``<a id="...">`` tags."""
    text = FENCE.sub("", path.read_text())
    titles = {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    return titles | set(re.findall(r'<a id="([^"]+)"></a>', text))


@pytest.mark.parametrize("path", DOCS, ids=page_id)
def test_relative_links_resolve(path):
    text = FENCE.sub("", path.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: {target} names no file"
        if anchor and linked.suffix == ".md":
            assert anchor in headings(linked), f"{path.name}: {target} names no heading"


@pytest.mark.parametrize("path", DOCS, ids=page_id)
def test_pages_quote_no_dates_commits_or_machine_paths(path):
    # Results record their commit and date in their files under docs/results/; history stays
    # in git.
    text = path.read_text()
    assert not re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b", text), "a date"
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w)]
    assert not [w for w in commits if re.search(r"\d", w)], f"a commit: {commits}"
    assert not re.findall(r"(?<![\w.])/(?:home|root|work|tmp|Users)/", text), "a machine path"
