"""mlx-spec: lossless, cheap speculative-decoding acceptance for MLX.

The acceptance ops and the samplers need only MLX. The generation loop and the mlx-lm patch
(``speculative_generate_step``, ``stream_generate``, ``generate``, ``patch_mlx_lm``, ...) need
mlx-lm (``pip install "mlx-spec[lm]"``) and are imported on first use.
"""

from importlib import import_module
from typing import Any

from .acceptance import INVALID_ROW, accept_greedy, accept_sampled, read
from .sampling import SpecSampler, make_sampler

_GENERATION = (
    "SpeculativeResponse",
    "SpeculativeStats",
    "generate",
    "patch_mlx_lm",
    "speculative_generate_step",
    "stream_generate",
    "unpatch_mlx_lm",
)

__all__ = [
    "INVALID_ROW",
    "SpecSampler",
    "accept_greedy",
    "accept_sampled",
    "make_sampler",
    "read",
    *_GENERATION,
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _GENERATION:
        try:
            module = import_module(".generation", __name__)
        except ImportError as error:
            raise ImportError(
                f"mlx_spec.{name} needs mlx-lm: pip install 'mlx-spec[lm]' ({error})"
            ) from error
        return getattr(module, name)
    raise AttributeError(f"module 'mlx_spec' has no attribute {name!r}")
