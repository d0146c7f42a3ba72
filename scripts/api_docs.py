"""Writes ``docs/api.md``, the API reference, with Sphinx: from the docstrings and the parsers.

Run: ``python scripts/api_docs.py`` (rewrites the file) or ``python scripts/api_docs.py --check``
(exit status 1, with a diff, when the file differs from what would be written).

As MLX builds its reference with Sphinx's autodoc, the docstrings are the single source:
``docs/api/api.rst`` gives the page's outline, ``docs/api/conf.py`` the configuration (autodoc,
napoleon for the Google-style sections, sphinx-markdown-builder for the Markdown), and
``tests/test_docs.py`` fails when ``docs/api.md`` differs from what this script writes now. The
versions of Sphinx and its builder are pinned in the ``test`` extra of ``pyproject.toml``: another
version may write other bytes.
"""

from __future__ import annotations

import argparse
import difflib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "api"
OUT = ROOT / "docs" / "api.md"


def render() -> str:
    """The page, from a fresh build; raises ``RuntimeError`` with Sphinx's warnings if any."""
    from sphinx.application import Sphinx
    from sphinx.util.console import strip_escape_sequences

    warnings = io.StringIO()
    with tempfile.TemporaryDirectory() as build:
        doctrees = Path(build, "doctrees")
        app = Sphinx(SOURCE, SOURCE, build, doctrees, "markdown", status=None, warning=warnings)
        app.build()
        if warnings.getvalue():
            text = strip_escape_sequences(warnings.getvalue())
            raise RuntimeError(f"Sphinx warned, fix the docstrings:\n{text}")
        return Path(build, "api.md").read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/api.md from the docstrings.")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if it differs")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        OUT.write_text(text)
        return 0
    current = OUT.read_text() if OUT.exists() else ""
    diff = difflib.unified_diff(
        current.splitlines(True), text.splitlines(True), "docs/api.md", "generated"
    )
    sys.stdout.writelines(diff)
    return int(current != text)


if __name__ == "__main__":
    sys.exit(main())
