"""The shipped demo pair: where it lives and the prompts the demo and the benchmark give it.

A module beside ``mlx_spec/demo/`` rather than its ``__init__.py``: that folder is data, written
by ``scripts/convert_demo_models.py`` and shipped as package data. A module in it would make it a
package, put the weights under two packages, and read as the ``demo`` command, which is
``mlx_spec.cli.demo``. Nothing here imports MLX or mlx-lm, so the command can use it before its
arguments are checked.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"
"""Path: the shipped model pair, ``DEMO_DIR / "target"`` and ``DEMO_DIR / "draft"``."""

PROMPTS = (
    "def read_file(path):\n    with open(path) as f:\n",
    "The with statement is used to wrap the execution of a block",
    "class Queue:\n    def __init__(self, maxsize=0):\n",
    "A module is a file containing Python definitions and statements.",
)
"""The prompts of the demo and the generation benchmark: code and prose, alternating."""
