"""mlx-spec: lossless, cheap speculative-decoding acceptance for MLX."""

from .acceptance import INVALID_ROW, accept_greedy, accept_sampled, read

__all__ = ["INVALID_ROW", "accept_greedy", "accept_sampled", "read"]
__version__ = "0.1.0"
