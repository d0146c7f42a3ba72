"""mlx-spec: lossless, cheap speculative-decoding acceptance for MLX.

The acceptance ops, the samplers and the draft-length policies need only MLX (and NumPy). The
generation loop, the drafters, the mlx-lm patch and the loading of MTP heads
(``speculative_generate_step``, ``PromptLookupDrafter``, ``patch_mlx_lm``, ``load``, ...) need
mlx-lm (``pip install "mlx-spec[lm]"``) and are imported on first use.
"""

from importlib import import_module
from typing import Any

from .acceptance import INVALID_ROW, accept_greedy, accept_sampled, read
from .batch_length import BatchAdaptive
from .draft_length import Adaptive, Calibration, DraftPolicy, Fixed
from .sampling import SpecSampler, make_sampler

# Names that need mlx-lm, by the module that defines them (imported on first use).
_NEEDS_MLX_LM = {
    "Drafter": "drafters",
    "ModelDrafter": "drafters",
    "PromptLookupDrafter": "drafters",
    "SpeculativeResponse": "generation",
    "SpeculativeStats": "generation",
    "SpeculativeBatch": "batch",
    "SpeculativeBatchGenerator": "batch",
    "batch_generate": "batch",
    "generate": "generation",
    "speculative_generate_step": "generation",
    "stream_generate": "generation",
    "patch_mlx_lm": "patch",
    "unpatch_mlx_lm": "patch",
    "MTPDrafter": "mtp",
    "convert_mtp": "mtp_convert",
    "load": "mtp_convert",
}

__all__ = [
    "INVALID_ROW",
    "Adaptive",
    "BatchAdaptive",
    "Calibration",
    "DraftPolicy",
    "Fixed",
    "SpecSampler",
    "accept_greedy",
    "accept_sampled",
    "make_sampler",
    "read",
    *_NEEDS_MLX_LM,
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _NEEDS_MLX_LM:
        try:
            module = import_module(f".{_NEEDS_MLX_LM[name]}", __name__)
        except ImportError as error:
            raise ImportError(
                f"mlx_spec.{name} needs mlx-lm: pip install 'mlx-spec[lm]' ({error})"
            ) from error
        return getattr(module, name)
    raise AttributeError(f"module 'mlx_spec' has no attribute {name!r}")
