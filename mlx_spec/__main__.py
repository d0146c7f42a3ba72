"""``python -m mlx_spec``: the ``mlx-spec`` command."""

import sys

from .cli import main

sys.exit(main())
