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
"""The prompts of the demo, and the benchmark's open-generation workload: code and prose,
alternating."""

_CODE = """def read_config(path):
    \"\"\"Read a configuration file into a dictionary.\"\"\"
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
"""

GROUNDED = (
    f"{_CODE}\n\n{_CODE}\n\ndef read_config(path):\n   ",
    "class Stack:\n    def push(self, item):\n        self._items.append(item)\n\n"
    "    def pop(self):\n        return self._items.pop()\n\n"
    "    def peek(self):\n        return self._items[-1]\n\n    def size(self):",
    "NAMES = {\n    'a': 'alpha',\n    'b': 'beta',\n    'g': 'gamma',\n    'd': 'delta',\n"
    "    'e': 'epsilon",
    "import os\nimport re\nimport sys\nimport json\nimport time\nimport shutil\nimport string\n"
    "import",
)
"""Input-grounded prompts of the benchmark: text that the target's output repeats. The demo
target is too small to copy text reliably, but it follows the pattern of such prompts (a function
shown twice and begun a third time, methods, a table, imports), and prompt lookup finds what it
repeats. Each ends where the tokenizer would cut it (``"\\n   "`` is one token), not at a line
end."""

WARM_UP = "x = 1\n"
"""The prompt the benchmark warms up on: none of the measured ones."""
