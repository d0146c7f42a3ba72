"""A verification's attention in chunks of queries that MLX's CUDA vector kernel takes.

MLX's CUDA backend runs ``mx.fast.scaled_dot_product_attention`` over fewer than four queries in
one fused kernel (head sizes 64, 96 and 128). Over more queries, with cuDNN attention off (as
``mlx-spec`` runs it, see docs/guide.md), it falls back to separate operations (two matmuls, the
mask, the softmax), each launched on its own: a verification of ``N + 1 >= 4`` positions then
costs every attention layer more launches than a few vector calls do, and on a GPU a verification
costs launches more than passes over memory. With cuDNN attention on, MLX sends every call of
several queries to cuDNN, which builds a graph for each new shape: chunks would only make more
shapes, so :func:`chunks_pay` is false there.

Within :func:`chunking`, on the thread that entered it, a causal (or unmasked) attention over more
than :data:`QUERIES_PER_CALL` queries runs as consecutive chunks of at most that many queries, each
over the keys its last query may see (:func:`attention_in_chunks`). Every query attends to exactly
the keys it did before: the same attention, each row computed by the kernel that plain decoding's
one-query steps use. Elsewhere the function does what it did.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from . import kernels
from ._checks import StreamOrDevice

__all__ = ["QUERIES_PER_CALL", "attention_in_chunks", "chunking", "chunks_pay"]

#: MLX's switch for cuDNN's attention on its CUDA backend.
CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"
#: The most queries of one call of MLX's CUDA vector attention kernel.
QUERIES_PER_CALL = 3
#: The head sizes that kernel takes; with another, chunks would only add fallback calls.
HEAD_SIZES = (64, 96, 128)

_local = threading.local()


def chunks_pay(stream: StreamOrDevice = None) -> bool:
    """Whether verifications on ``stream`` run their attention in chunks: on MLX's CUDA backend
    with cuDNN attention off (``MLX_CUDA_USE_CUDNN_SDPA=0``, which MLX reads once)."""
    return kernels.on_cuda(stream) and os.environ.get(CUDNN_ATTENTION) == "0"


def attention_in_chunks(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: str | None = None,
    size: int = QUERIES_PER_CALL,
    attend: Callable[..., mx.array] = mx.fast.scaled_dot_product_attention,
    **options: Any,
) -> mx.array:
    """``attend(queries, keys, values, scale=scale, mask=mask)`` over chunks of ``size`` queries.

    Args:
        queries (array): ``[B, H, S, D]`` float queries, the last ``S`` positions of the keys.
        keys (array): ``[B, H_kv, L, D]`` keys, ``L >= S`` when ``mask`` is ``"causal"``.
        values (array): ``[B, H_kv, L, D_v]`` values.
        scale (float): the scale of the scores.
        mask (str, optional): ``"causal"`` (query ``i`` sees the first ``L - S + i + 1`` keys) or
            ``None`` (every query sees every key).
        size (int): the most queries a chunk holds, ``>= 1``.
        attend (callable): the attention each chunk runs (MLX's, by default).
        options: passed to ``attend`` (``sinks``, say).

    Returns:
        array: ``[B, H, S, D_v]``, what ``attend`` gives over all queries at once, up to rounding.
    """
    count, length = queries.shape[2], keys.shape[2]
    outputs = []
    for start in range(0, count, size):
        stop = min(start + size, count)
        # The chunk's last query sees the first `seen` keys; its others see fewer, by the mask.
        seen = length - count + stop if mask == "causal" else length
        outputs.append(
            attend(
                queries[:, :, start:stop],
                keys[:, :, :seen],
                values[:, :, :seen],
                scale=scale,
                mask=mask,
                **options,
            )
        )
    return mx.concatenate(outputs, axis=2)


def _chunks(queries: mx.array, keys: mx.array, mask: Any) -> bool:
    """Whether an attention of ``queries`` over ``keys`` under ``mask`` runs in chunks: more
    queries than one vector call takes, a head size it takes, and a causal or no mask."""
    return (
        queries.ndim == 4
        and queries.shape[2] > QUERIES_PER_CALL
        and queries.shape[-1] in HEAD_SIZES
        and (mask is None or (isinstance(mask, str) and mask == "causal"))
        and keys.shape[2] >= queries.shape[2]
    )


def _chunked(attend: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``attend`` (MLX's attention), run in chunks within :func:`chunking` where that helps."""

    def scaled_dot_product_attention(
        queries: mx.array, keys: mx.array, values: mx.array, **kwargs: Any
    ) -> mx.array:
        # Every attention call of every model passes here: the thread's switch is read first.
        if getattr(_local, "active", False) and _chunks(queries, keys, kwargs.get("mask")):
            return attention_in_chunks(queries, keys, values, attend=attend, **kwargs)
        return attend(queries, keys, values, **kwargs)

    scaled_dot_product_attention.chunks = True
    return scaled_dot_product_attention


@contextmanager
def chunking() -> Iterator[None]:
    """Within it, on this thread, ``mx.fast.scaled_dot_product_attention`` runs a causal or
    unmasked attention over more than :data:`QUERIES_PER_CALL` queries in chunks (see the module's
    description). MLX's function is replaced only while some thread is within it
    (:func:`mlx_spec._mlx_lm.scoped_attention`), and other threads' calls are left whole."""
    from . import _mlx_lm  # needs mlx-lm, which the command's early checks do not import

    previous = getattr(_local, "active", False)
    with _mlx_lm.scoped_attention(_chunked):
        _local.active = True
        try:
            yield
        finally:
            _local.active = previous
