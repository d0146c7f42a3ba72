"""A model's MTP head drafting for every row of a batch (:class:`BatchHead`).

The head (:mod:`mlx_spec.mtp`) takes, for text position ``t``, the target's hidden state ``h_t``
and the embedding of the token after it. Each row of a batch hands the head the positions the
target has verified since the head last saw that row: its prompt's (kept while it is prefilled,
:class:`Capturing`), a round's kept positions, a stretch of plain steps. A round's drafting
first feeds them in one call over the batch, right padded, each row then keeping its own count
(as a batched draft model catches up). A row's first draft token is drawn from the head's output
at its last position, and the next ones by chaining the head on its own output. The chain's
entries, the head's guesses, are taken back after the round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache

from . import _mlx_lm
from .mtp import MTPDrafter, MTPHead, head_of

__all__ = ["BatchHead", "Capturing", "check_head"]


def check_head(op: str, model: nn.Module, drafter: object) -> MTPHead:
    """The MTP head that drafts for ``model``'s batches: ``drafter``'s (an
    :class:`mlx_spec.MTPDrafter` given one), else the model's own (:func:`mlx_spec.mtp.head_of`).

    Raises:
        ValueError: there is none, ``model`` does not expose its hidden states, or the head has
            several layers (their chains do not batch yet).
    """
    head = drafter.head if isinstance(drafter, MTPDrafter) else None
    head = head if head is not None else head_of(model)
    if head is None:
        raise ValueError(
            f"{op}: `drafter` is 'mtp', but `model` has no MTP head (load it with "
            f"mlx_spec.load; add a head with `mlx-spec convert-mtp`)"
        )
    if _mlx_lm.split(model) is None:
        raise ValueError(f"{op}: `model` does not expose its hidden states, which MTP drafts read")
    if len(head.layers) != 1:
        raise ValueError(
            f"{op}: batched MTP drafts take a head of one layer, got {len(head.layers)}"
        )
    return head


class Capturing:
    """The target, called as ``model(tokens, cache=...)`` (as mlx-lm's ``PromptProcessingBatch``
    calls it while it prefills), keeping the hidden states of each call.

    Args:
        split (Split): the target as backbone and head (:func:`mlx_spec._mlx_lm.split`).
    """

    def __init__(self, split: _mlx_lm.Split) -> None:
        self.split = split
        self._states: list[mx.array] = []

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        states = self.split.backbone(tokens, cache=cache)
        self._states.append(states)
        return self.split.head(states)

    def rows(self, lengths: Sequence[int]) -> list[mx.array]:
        """The hidden states of the calls since the last :meth:`rows`, evaluated: for each row,
        ``[lengths[i], H]``, those of its first ``lengths[i]`` positions (rows are right padded)."""
        if not self._states:
            return [mx.zeros((0, 0)) for _ in lengths]
        states = mx.concatenate(self._states, axis=1)
        self._states = []
        mx.eval(states)
        return [states[i, :n] for i, n in enumerate(lengths)]


class BatchHead:
    """An MTP head's cache for a batch, and its drafts.

    Args:
        model (nn.Module): the target (it passed :func:`check_head`).
        head (MTPHead): its head, of one layer.
        rows (int): the batch's rows.

    Attributes:
        layers (list): the head's ``BatchKVCache``, one row per sequence.
    """

    def __init__(self, model: nn.Module, head: MTPHead, rows: int) -> None:
        self.split = _mlx_lm.split(model)
        self.head = head
        self.layers = [BatchKVCache([0] * rows)]

    def _step(self, hidden: mx.array, embedded: mx.array, depth: int) -> tuple[mx.array, mx.array]:
        """One head call over ``[B, W, H]`` positions: the states to chain on, and the input of
        the LM head (the logits are taken only where a draft is drawn)."""
        mask = create_attention_mask(hidden, self.layers[0], return_array=True)
        return self.head(hidden, embedded, depth, self.layers[0], mask)

    def draft(
        self,
        hidden: Sequence[Sequence[mx.array]],
        after: Sequence[Sequence[int]],
        first: Sequence[bool],
        n: int,
        draw: Callable[[mx.array, int], mx.array],
    ) -> mx.array:
        """The head's ``n`` draft tokens for every row, lazy.

        Args:
            hidden (list of list of array): for each row, ``[k, H]`` arrays in text order: the
                target's hidden states of the ``k_i`` positions the head has not seen,
                ``k_i >= 1`` for at least one row.
            after (list of list of int): for each row, the ``k_i`` tokens after those positions.
            first (list of bool): for each row, whether those positions start at the text's
                first (DeepSeek's head was trained without an embedding there).
            n (int): draft tokens, ``>= 1``.
            draw (callable): ``(logits [B, 1, V], j) -> [B]`` uint32: draft step ``j``'s tokens,
                each row drawn under its own rule.

        Returns:
            array: ``[B, n]`` uint32 tokens (a row with ``k_i = 0`` drafts from nothing: the
            caller does not use its tokens). The head's cache then holds every row's seen
            positions, the chain taken back.
        """
        counts = [len(ids) for ids in after]
        width = max(counts)
        some = next(pieces[0] for pieces in hidden if pieces)
        rows, tokens = [], []
        for pieces, k, ids in zip(hidden, counts, after, strict=True):
            pad = [mx.zeros((width - k, some.shape[1]), dtype=some.dtype)] if width > k else []
            rows.append(mx.concatenate([*pieces, *pad]))
            tokens.append(list(ids) + [0] * (width - k))
        states = mx.stack(rows)
        embedded = self.split.embed(mx.array(tokens, dtype=mx.uint32))
        if self.head.layout == "deepseek" and any(first):
            starts = mx.array(first)[:, None, None] & (mx.arange(width) == 0)[None, :, None]
            embedded = mx.where(starts, mx.zeros_like(embedded), embedded)
        chain, normed = self._step(states, embedded, 0)
        at = mx.array([max(k - 1, 0) for k in counts])[:, None, None]
        chain = mx.take_along_axis(chain, at, axis=1)
        drafted = [draw(self.split.head(mx.take_along_axis(normed, at, axis=1)), 0)]
        self.layers[:] = [_mlx_lm.keep_rows(self.layers[0], width, counts)]
        for j in range(1, n):
            chain, normed = self._step(chain, self.split.embed(drafted[-1][:, None]), j)
            drafted.append(draw(self.split.head(normed), j))
        if n > 1:
            self.layers[:] = [_mlx_lm.keep_rows(self.layers[0], n - 1, [0] * len(counts))]
        return mx.stack(drafted, axis=1).astype(mx.uint32)

    def extend(self, other: BatchHead) -> None:
        """Adds the rows of ``other`` after these."""
        self.layers[0].extend(other.layers[0])

    def filter(self, rows: list[int]) -> None:
        """Keeps rows ``rows`` (their indices, ascending; none: the batch is done with)."""
        if rows:
            self.layers[0].filter(rows)

    @property
    def nbytes(self) -> int:
        """int: the bytes the head's cache holds."""
        return self.layers[0].nbytes
