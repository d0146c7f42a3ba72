"""A batch's caches of one model, each row taken back to its own length after a round.

A round feeds every row of a batch the same number of positions, and each row keeps its own
number of them. Attention layers (``BatchKVCache``, and ``BatchRotatingKVCache`` for sliding
windows) drop each row's newest entries past what it keeps
(:func:`mlx_spec._mlx_lm.keep_rows`). A window's buffer is put in temporal order before each
call of several positions (:func:`mlx_spec._mlx_lm.windows_in_order`), so that the call's mask
follows each row's own window. The gated delta-net layers of hybrids (Qwen3-Next, Qwen3.5 /
3.6: an ``ArraysCache`` holding a convolution's last inputs and a recurrent state) cannot drop
positions. A call made to be taken back records each of their states after each position
(:func:`mlx_spec._mlx_lm.tracking`), and each row then takes the states after the positions it
keeps. Nothing is replayed, and the rows stay in one batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from . import _mlx_lm
from .caches import _tracks

__all__ = ["BatchCaches", "cache_kinds", "check_batchable", "held", "held_tokens"]


def _is_recurrent(layer: Any) -> bool:
    return isinstance(layer, ArraysCache)


def _window(layer: Any) -> bool:
    """Whether ``layer`` is a sliding window that batches (one that keeps no first tokens)."""
    return type(layer) is RotatingKVCache and layer.keep == 0


def check_batchable(op: str, name: str, model: object, *, draft: bool = False) -> None:
    """Raises ``ValueError`` unless ``model``'s caches batch with rows taken back each to its own
    length: ``KVCache`` layers (batched as ``BatchKVCache``), sliding windows keeping no first
    tokens (``RotatingKVCache``, batched as ``BatchRotatingKVCache``) where
    :func:`mlx_spec._mlx_lm.batch_windows_kept` holds, and gated delta-net layers whose states
    this mlx-lm lets :func:`mlx_spec._mlx_lm.track` keep, beside at least one attention layer.

    A ``draft`` model may not have sliding windows: it drafts one position a call, and a full
    window then drops its oldest entry at each, which taking a rejected draft back cannot
    restore (a verification feeds several positions a call, and keeps them)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{op}: `{name}` must be an mlx.nn.Module, got {type(model).__name__}")
    layers = make_prompt_cache(model)
    kinds = sorted({type(layer).__name__ for layer in layers})
    attention = [layer for layer in layers if type(layer) is KVCache or _window(layer)]
    recurrent = [layer for layer in layers if _is_recurrent(layer)]
    if not attention or len(attention) + len(recurrent) != len(layers):
        raise ValueError(
            f"{op}: `{name}` has caches of {kinds}; batched speculation takes KVCache layers, "
            f"sliding windows that keep no first tokens (RotatingKVCache) and the gated "
            f"delta-net layers of hybrids (ArraysCache), with at least one attention layer"
        )
    if draft and any(_window(layer) for layer in layers):
        raise ValueError(
            f"{op}: `{name}` has sliding windows (RotatingKVCache); a batched draft model may "
            f"not, yet (a target may)"
        )
    if any(_window(layer) for layer in layers) and not _mlx_lm.batch_windows_kept():
        raise ValueError(
            f"{op}: `{name}` has sliding windows, which this mlx-lm does not let mlx-spec take "
            f"back row by row (see `python -m mlx_spec._mlx_lm`)"
        )
    if recurrent and not _tracks(layers, _mlx_lm.track(model)):
        raise ValueError(
            f"{op}: `{name}` has recurrent layers whose states this mlx-lm does not let "
            f"mlx-spec keep after each position (see `python -m mlx_spec._mlx_lm`), so a batch "
            f"cannot take its rows back"
        )


def held(layers: list[Any]) -> int:
    """The tokens ``layers`` (one sequence's caches, or a batch's) hold: their first attention
    layer's ``offset`` (recurrent layers do not count them)."""
    return next(layer.offset for layer in layers if not _is_recurrent(layer))


def cache_kinds(*models: nn.Module | None) -> list[type]:
    """The class of each layer's cache of ``models`` in turn (``None`` ones skipped), as
    ``make_prompt_cache`` makes them."""
    return [type(layer) for m in models if m is not None for layer in make_prompt_cache(m)]


def held_tokens(caches: object, kinds: list[type], prompt_length: int) -> int | None:
    """The tokens ``caches`` hold, where a batch can start a prompt of ``prompt_length`` tokens
    from them: a list of caches of ``kinds`` (:func:`cache_kinds`), whose attention layers all
    hold the same number, less than the prompt's, and whose recurrent layers hold a state unless
    that number is 0; else ``None``."""
    if not isinstance(caches, list) or [type(c) for c in caches] != kinds:
        return None
    offsets = {c.offset for c in caches if not _is_recurrent(c)}
    count = offsets.pop() if len(offsets) == 1 else None
    if count is None or count >= prompt_length:
        return None
    if any(_is_recurrent(c) and c.empty() != (count == 0) for c in caches):
        return None
    return count


class BatchCaches:
    """One model's caches for a batch, whose rows are taken back each to its own length.

    Args:
        model (nn.Module): the model (it passed :func:`check_batchable`).
        layers (list): its batch caches, one per layer: ``BatchKVCache``,
            ``BatchRotatingKVCache`` and ``ArraysCache``.
        split (Split, optional): the model as backbone and head
            (:func:`mlx_spec._mlx_lm.split`), where a drafter reads its hidden states.
            Default: none.

    Attributes:
        model (nn.Module): the model.
        layers (list): the caches, updated in place (:meth:`keep` replaces some of them).
        hidden (array, optional): with ``split``, the ``[B, W, H]`` hidden states of the last
            call's positions.
    """

    def __init__(
        self, model: nn.Module, layers: list[Any], split: _mlx_lm.Split | None = None
    ) -> None:
        self.model = model
        self.layers = layers
        self.split = split
        self.hidden: mx.array | None = None
        # Which layers are recurrent: the model's cache kinds, which extend and filter keep.
        self._recurrent = [i for i, layer in enumerate(layers) if _is_recurrent(layer)]
        # Since the last keep: the recurrent layers' entries before the first call made to be
        # taken back, and after each position it and the calls after it fed.
        self._before: list[list[Any]] | None = None
        self._after: list[list[list[Any]]] = []

    def __call__(self, tokens: mx.array, *, undoable: bool = False) -> mx.array:
        """The model's logits over ``tokens``, the caches updated.

        Args:
            tokens (array): ``[B, W]`` uint32 or int32 token ids, a row per sequence.
            undoable (bool): whether :meth:`keep` may take some of these positions back.
                Default: ``False``.

        Returns:
            array: ``[B, W, V]`` logits, lazy.
        """
        if tokens.shape[1] > 1:
            _mlx_lm.windows_in_order(self.layers)
        recurrent = self._recurrent
        if not (undoable and recurrent):
            return self._forward(tokens)
        if self._before is None:
            self._before = [list(self.layers[i].cache) for i in recurrent]
        with _mlx_lm.tracking() as records:
            logits = self._forward(tokens)
        width = tokens.shape[1]
        if len(records) != len(recurrent) or any(len(r.states) != width for r in records):
            raise RuntimeError(
                f"BatchCaches: the call kept {[len(r.states) for r in records]} states, not "
                f"{width} for each of {len(recurrent)} recurrent layers"
            )
        self._after += [[r.after(j) for r in records] for j in range(1, width + 1)]
        return logits

    def _forward(self, tokens: mx.array) -> mx.array:
        if self.split is None:
            return self.model(tokens, cache=self.layers)
        self.hidden = self.split.backbone(tokens, cache=self.layers)
        return self.split.head(self.hidden)

    def keep(self, fed: int, kept: list[int]) -> None:
        """Takes each row back after calls that fed ``fed`` positions to every row, those that
        may be taken back made with ``undoable=True``: row ``i`` keeps the first ``kept[i]``.

        Args:
            fed (int): the positions fed every row since the caches last held what they keep.
            kept (list of int): for each row, how many of them it keeps, in ``[0, fed]``, and
                no fewer than the positions fed before the first undoable call.
        """
        self.layers[:] = [
            layer if _is_recurrent(layer) else _mlx_lm.keep_rows(layer, fed, kept)
            for layer in self.layers
        ]
        before, after = self._before, self._after
        self._before, self._after = None, []
        if not after:
            return
        # Column c: the recurrent entries after c undoable positions (0: before the first).
        column = [k - (fed - len(after)) for k in kept]
        if all(c == len(after) for c in column):
            return
        columns = ([before] if min(column) == 0 else []) + after
        at = mx.array([c - (len(after) + 1 - len(columns)) for c in column])
        rows = mx.arange(len(kept))
        for r, i in enumerate(self._recurrent):
            self.layers[i].cache = [
                mx.stack([entries[r][e] for entries in columns])[at, rows]
                for e in range(len(columns[0][r]))
            ]

    def extend(self, other: BatchCaches) -> None:
        """Adds the rows of ``other`` (the same model's caches) after these."""
        if not self.layers:
            self.layers[:] = other.layers
            return
        for layer, joining in zip(self.layers, other.layers, strict=True):
            layer.extend(joining)

    def filter(self, rows: list[int]) -> None:
        """Keeps rows ``rows`` (their indices, ascending)."""
        if not rows:
            self.layers.clear()
        for layer in self.layers:
            layer.filter(rows)

    def extract(self, row: int) -> list[Any]:
        """Row ``row``'s caches alone, as mlx-lm's single-sequence caches."""
        return [layer.extract(row) for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """int: the bytes the caches hold."""
        return sum(layer.nbytes for layer in self.layers)
