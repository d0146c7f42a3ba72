"""The speculative batches of mlx-lm's server.

``mlx_lm.server`` batches concurrent requests with mlx-lm's ``BatchGenerator``, and serves them
one at a time as soon as a draft model is loaded. While :func:`mlx_spec.patch_mlx_lm` patches
it, a model whose requests speculate (with a draft model, or with ``prompt_lookup=True``), and
whose caches batch, has them batched by a :class:`ServerBatchGenerator` instead: the surface of
``BatchGenerator`` that the server drives, over a :class:`mlx_spec.batch.SpeculativeBatchGenerator`.

Each request joins the running batch with its own sampler, stop sequences and draft length (its
``num_draft_tokens``), from the caches the server's prompt cache gives it where they fit. It
leaves with its caches (the target's layers, then the draft model's), which the server files in
its prompt cache as it files mlx-lm's.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .batch import PromptResponse, SpeculativeBatchGenerator
from .batch_caches import cache_kinds, held_tokens
from .batch_length import BatchAdaptive
from .drafters import Drafter

__all__ = ["ServerBatchGenerator"]


class ServerBatchGenerator:
    """mlx-lm's ``BatchGenerator``, as ``mlx_lm.server`` drives it, with speculation.

    A request's prompt is the tokens its caches hold (``all_tokens``) and its segments. It is
    prefilled a chunk at a time between the batch's rounds, from its caches where they fit
    (:func:`held_tokens`; else from new caches), each chunk stopping at the end of a segment,
    where :meth:`extract_cache` gives its caches for the server's prompt cache (a system
    prompt's, say), as mlx-lm's ``BatchGenerator`` does.

    Args:
        model (nn.Module): the target model; its caches must batch
            (:func:`mlx_spec.batch_caches.check_batchable`).
        draft_model (nn.Module, optional): a draft model, run as a batch. Give it or ``drafter``.
        drafter (str or PromptLookupDrafter, optional): ``"prompt-lookup"``, or ``"mtp"`` (the
            model's MTP head).
        num_draft_tokens (int): the most draft tokens a round, the server's
            ``--num-draft-tokens``. Default: ``3``.
        policy (BatchAdaptive, optional): the adaptive draft-length policy, to keep what it
            measured across the generators the server makes for one model. Default: a new one.
        completion_batch_size (int): the most requests decoded at once. Default: ``32``.
        prefill_batch_size (int): the most requests prefilled together. Default: ``8``.
        prefill_step_size (int): prompt tokens per prefill call. Default: ``2048``.
        stream (mx.Stream, optional): the stream everything runs on. Default: mlx-lm's
            generation stream.

    Raises:
        ValueError: an argument is of the wrong type or out of range; the message names it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        draft_model: nn.Module | None = None,
        drafter: str | Drafter | None = None,
        num_draft_tokens: int = 3,
        policy: BatchAdaptive | None = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        stream: mx.Stream | None = None,
    ) -> None:
        self.generator = SpeculativeBatchGenerator(
            model,
            draft_model=draft_model,
            drafter=drafter,
            num_draft_tokens=num_draft_tokens,
            policy=policy,
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
            return_prompt_caches=True,
            stream=stream,
        )
        self.kinds = cache_kinds(model, draft_model)

    def __len__(self) -> int:
        return len(self.generator)

    def insert_segments(
        self,
        segments: list[list[list[int]]],
        max_tokens: list[int] | None = None,
        caches: list[list[Any] | None] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[list[Any]] | None = None,
        stop_sequences: list[Any] | None = None,
    ) -> list[int]:
        """Queues requests, as ``BatchGenerator.insert_segments`` does.

        Args:
            segments (list): each request's prompt after what its caches hold, as lists of
                token ids.
            max_tokens (list of int, optional): each one's tokens to generate.
            caches (list, optional): each one's caches from the server's prompt cache, or
                ``None``.
            all_tokens (list of list of int, optional): the tokens each one's caches hold.
            samplers (list, optional): each one's sampler.
            logits_processors (list, optional): each one's processors (a logit bias,
                penalties), each list carrying the request's ``num_draft_tokens``
                (:class:`mlx_spec._mlx_lm.DraftTokens`).
            stop_sequences (list, optional): each one's mlx-lm ``StopSequences``.

        Returns:
            list of int: each request's uid.

        Raises:
            ValueError: an argument is out of range.
        """
        count = len(segments)
        held = all_tokens or [[] for _ in segments]
        prompts = [
            [*before, *(t for part in parts for t in part)]
            for before, parts in zip(held, segments, strict=True)
        ]
        processors = logits_processors or [[] for _ in segments]
        started = [
            cache
            if cache is not None and held_tokens(cache, self.kinds, len(p)) == len(before)
            else None
            for cache, p, before in zip(caches or [None] * count, prompts, held, strict=True)
        ]
        lengths = [
            getattr(ps, "num_draft_tokens", self.generator.num_draft_tokens) for ps in processors
        ]
        # The end of each segment but the last, as a prompt length (empty segments end none).
        ends = [
            sorted(
                {
                    end
                    for end in accumulate(map(len, parts[:-1]), initial=len(before))
                    if len(before) < end < len(p)
                }
            )
            for before, parts, p in zip(held, segments, prompts, strict=True)
        ]
        return self.generator.insert(
            prompts,
            max_tokens,
            samplers,
            draft_lengths=lengths,
            prompt_caches=started,
            stop_sequences=stop_sequences,
            segment_ends=ends,
            logits_processors=[list(these) for these in processors],
        )

    def next(self) -> tuple[list[PromptResponse], list[Any]]:
        """Prefills, lets prefilled requests join, then runs one round or plain step
        (:meth:`SpeculativeBatchGenerator.next_with_prompts`).

        Returns:
            tuple: a ``PromptProcessingBatch.Response`` for each request prefilled (its
            progress, and where a segment or the prompt ends), and a
            ``GenerationBatch.Response`` for each token emitted.
        """
        prompted, generated = self.generator.next_with_prompts()
        if generated and not len(self.generator):
            # The batch drained: MLX's buffer cache holds buffers of every batch size and
            # length it met, which a later burst may not meet again.
            mx.clear_cache()
        return prompted, generated

    def extract_cache(self, uids: Sequence[int]) -> dict[int, Any]:
        """The caches of requests being prefilled: after ``end_of_segment``, the segment's
        (:meth:`SpeculativeBatchGenerator.extract_cache`)."""
        return self.generator.extract_cache(uids)

    def remove(self, uids: Sequence[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """Takes requests out, as :meth:`SpeculativeBatchGenerator.remove`."""
        return self.generator.remove(uids, return_prompt_caches)

    @property
    def prompt_cache_nbytes(self) -> int:
        """int: the bytes of the caches it holds, running or waiting."""
        return self.generator.prompt_cache_nbytes

    def close(self) -> None:
        """Drops every request."""
        generator = self.generator
        self.remove(generator.waiting + generator.prefilling + generator.running)
