"""Sphinx's configuration of ``docs/api.md``, the API reference, which ``python
scripts/api_docs.py`` builds from ``api.rst`` beside this file: autodoc reads the docstrings,
napoleon their Google-style sections, and sphinx-markdown-builder writes Markdown.

Hooks fill in what those do not do on their own:

- a constant shows its value as written and the ``#:`` comment above it, also where re-exported;
- an entry that ``mlx_spec`` (or another public module) re-exports says so, and a reference to
  ``mlx_spec.name`` links to it;
- ``.. mlx-spec-command::`` lists the command's subcommands and their options, from the parsers;
- the build fails when a name in the ``__all__`` of a public module has no entry.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
from pathlib import Path

from sphinx.errors import ExtensionError
from sphinx.ext.autodoc import DataDocumenter, Options
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

project = "mlx-spec"
root_doc = "api"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx_markdown_builder"]
autodoc_member_order = "bysource"  # and in the order of ``__all__`` where a module has one
autodoc_typehints = "none"  # the docstrings give types, shapes and dtypes
autodoc_inherit_docstrings = False  # an override without a docstring has no entry
autodoc_preserve_defaults = True  # as written: a default stream is not this machine's device
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False
markdown_anchor_signatures = True  # <a id="mlx_spec.sampling.make_sampler">, for links
smartquotes = False  # keep --option, 'quotes' and ... as written

#: The modules whose every public name (``__all__``) must have an entry.
PUBLIC_MODULES = (
    "mlx_spec",
    "mlx_spec.sampling",
    "mlx_spec.generation",
    "mlx_spec.drafters",
    "mlx_spec.patch",
    "mlx_spec.distributed",
)

entries: dict[int, str] = {}  # id() of each object with an entry: the entry's name


def assignment(name: str, obj: object) -> tuple[str, list[str]]:
    """The value of constant ``name`` as written and the ``#:`` comment above it, in the mlx_spec
    module that assigns it."""
    for module_name, module in sorted(sys.modules.items()):
        if module_name.split(".")[0] != "mlx_spec" or getattr(module, name, None) is not obj:
            continue
        analyzer = ModuleAnalyzer.for_module(module_name)
        comment = analyzer.find_attr_docs().get(("", name))
        for node in ast.parse(analyzer.code).body if comment else ():
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", 0)]
            if [getattr(t, "id", None) for t in targets] == [name] and node.value is not None:
                return ast.get_source_segment(analyzer.code, node.value), list(comment)
    raise ExtensionError(f"{name} has no #: comment where it is assigned")


class Constant(DataDocumenter):
    """A module's constant, with its value as written: ``2.0**-126``, not
    ``1.1754943508222875e-38``."""

    def add_directive_header(self, sig: str) -> None:
        value, _ = assignment(self.objpath[-1], self.object)
        self.options = Options({**self.options, "annotation": f"= {value}"})
        super().add_directive_header(sig)


def process_docstring(app, what, name, obj, options, lines) -> None:
    entries.setdefault(id(obj), name)
    short = name.rsplit(".", 1)[-1]
    if what == "data":  # after napoleon: the comment is prose, not "type: description"
        lines[:] = assignment(short, obj)[1]
    also = [
        f"``{module_name}.{short}``"
        for module_name in PUBLIC_MODULES
        if name != f"{module_name}.{short}"
        and short in getattr(sys.modules.get(module_name), "__all__", ())
        and getattr(sys.modules[module_name], short) is obj
    ]
    if also:
        lines += ["", f"Also {' and '.join(also)}: the same object."]


def link_reexport(app, env, node, contnode):
    """Links ``mlx_spec.name``, for a name ``mlx_spec`` re-exports, to the name's entry."""
    mlx_spec = sys.modules["mlx_spec"]
    short = node.get("reftarget", "").removeprefix("mlx_spec.")
    if node.get("refdomain") != "py" or short not in mlx_spec.__all__:
        return None
    target = entries.get(id(getattr(mlx_spec, short)))
    if target is None:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], target, node, contnode
    )


def has_entry(module, name: str) -> bool:
    """Whether ``module.name`` has an entry: under its name, or where ``module`` took it from."""
    if f"{module.__name__}.{name}" in entries.values():
        return True
    return id(getattr(module, name)) in entries


def check_coverage(app, exception) -> None:
    if exception is not None:
        return
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        missing = [n for n in module.__all__ if not has_entry(module, n)]
        if missing:
            raise ExtensionError(
                f"{module_name}.__all__ names without an entry: {missing}; give each a "
                "docstring (a #: comment above a constant), or list it in docs/api/api.rst"
            )


def rst(text: str) -> str:
    """``text`` with reST's inline markup escaped."""
    return re.sub(r"([\\`*_|])", r"\\\1", text)


def options(parser: argparse.ArgumentParser) -> list[str]:
    """A list of ``parser``'s options: names, value, help (``%(default)s`` expanded)."""
    lines = [""]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        names = ", ".join(f"``{s}``" for s in action.option_strings)
        if action.choices is not None:
            names += " " + " | ".join(f"``{c}``" for c in action.choices)
        elif action.nargs != 0:
            names += f" ``{action.metavar or action.dest.upper()}``"
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        if action.required:
            text = f"(required) {text}"
        elif action.default is not None and action.default is not False and "default" not in text:
            text = f"{text} (default: {action.default})"
        lines.append(f"- {names}: {rst(text)}")
    for group in parser._mutually_exclusive_groups:
        either = " or ".join(f"``{a.option_strings[0]}``" for a in group._group_actions)
        lines += ["", f"Give {either}{' (one is required)' if group.required else ''}."]
    return lines


class Command(SphinxDirective):
    """``.. mlx-spec-command::``: the command, its subcommands and their options."""

    def run(self):
        from mlx_spec import cli

        top = cli.setup_arg_parser()
        lines = [f"``{top.prog}``", "~" * 80, "", rst(top.description or ""), ""]
        lines += [f"- ``{top.prog} {name}``: {rst(line)}" for name, line in cli.COMMANDS.items()]
        lines += ["", rst(top.epilog or "")]
        for name in cli.COMMANDS:
            module = name.replace("-", "_")  # a command's module, as the dispatcher finds it
            parser = importlib.import_module(f"mlx_spec.cli.{module}").setup_arg_parser()
            lines += ["", f"``{parser.prog}``", "~" * 80, "", rst(parser.description or "")]
            lines += options(parser)
        return self.parse_text_to_nodes("\n".join(lines), allow_section_headings=True)


def setup(app):
    app.add_autodocumenter(Constant, override=True)
    app.connect("autodoc-process-docstring", process_docstring, priority=600)
    app.connect("missing-reference", link_reexport)
    app.connect("build-finished", check_coverage)
    app.add_directive("mlx-spec-command", Command)
