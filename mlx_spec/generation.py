"""Speculative generation for mlx-lm with lossless acceptance at any temperature.

:func:`speculative_generate_step` has the signature and the yields of
``mlx_lm.generate.speculative_generate_step``, and also drafts without a second model
(``drafter="prompt-lookup"``). Each round:

1. the drafter (:mod:`mlx_spec.drafters`) proposes up to ``N`` tokens, with the distributions
   they were drawn from when the generation samples;
2. the target scores the tokens it still lacks and the ``N`` drafts in one call;
3. the generation's rule (:mod:`mlx_spec.rules`) decides on the device how many draft tokens to
   keep and the token after them (:func:`mlx_spec.accept_greedy` or
   :func:`mlx_spec.accept_sampled`);
4. one host read brings back that ``[3]`` result together with the draft tokens;
5. every cache is taken back to what was kept (:mod:`mlx_spec.caches`): trimmed where that is
   exact, else restored from a checkpoint, the kept tokens then going into the next round's call.

``N`` is ``num_draft_tokens``, or with ``adaptive=True`` the number that pays most each round
(:mod:`mlx_spec.draft_length`). :func:`stream_generate` and :func:`generate` mirror mlx-lm's
functions.
"""

from __future__ import annotations

import importlib
import math
import numbers
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream, wired_limit
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import kernels
from ._checks import check_key, describe
from .acceptance import check_next
from .caches import ModelCache, check_caches, decode_masks
from .distributed import agree_key, model_group
from .draft_length import MAX_DRAFT_TOKENS, DraftLength
from .drafters import Drafter, DraftSetup, ModelDrafter, PromptLookupDrafter, Text
from .rules import Rule, make_rule

# The module, not the function ``mlx_lm.generate`` that the package exports under that name.
_lm_generate = importlib.import_module("mlx_lm.generate")

__all__ = [
    "MAX_DRAFT_TOKENS",
    "SpeculativeResponse",
    "SpeculativeStats",
    "generate",
    "speculative_generate_step",
    "stream_generate",
]

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
StreamLike = mx.Stream | mx.ThreadLocalStream | mx.Device

# mlx-lm's function, as it was when this module was imported (before any patch).
_LM_STREAM_GENERATE = _lm_generate.stream_generate


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation, updated as it runs.

    Attributes:
        rounds (int): verification calls of the target.
        drafted (int): draft tokens verified, over all rounds.
        accepted (int): draft tokens the target accepted, over all rounds.
        generated (int): tokens yielded to the caller.
        replayed (int): tokens fed to the target again because its caches were restored from a
            checkpoint (models with recurrent layers), over all rounds.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    replayed: int = 0

    @property
    def acceptance_rate(self) -> float:
        """float: ``accepted / drafted`` (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """float: ``generated / rounds``, the mean tokens a target call yields (0 before any)."""
        return self.generated / self.rounds if self.rounds else 0.0


@dataclass
class SpeculativeResponse(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` with the generation's :class:`SpeculativeStats` so far.

    Attributes:
        stats (SpeculativeStats): a snapshot taken when the response was made; the final
            response's counts cover the whole generation.
    """

    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


def _vocab_size(model: nn.Module) -> int | None:
    """The ids ``model`` can embed: its first embedding's rows (``None`` if it has none)."""
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedEmbedding):
            return module.num_embeddings
        if isinstance(module, nn.Embedding):
            return module.weight.shape[0]
    return None


class _Target:
    """The target model: its caches, its logits processors and the ids it can embed."""

    def __init__(
        self,
        model: nn.Module,
        cache: ModelCache,
        processors: Sequence[LogitsProcessor],
        quantize: Callable[[list[Any]], None],
        quantized_kv_start: int | None,
        vocab: int | None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.processors = list(processors)
        self.quantize = quantize
        self.quantized_kv_start = quantized_kv_start
        self.vocab = vocab

    def feed(self, tokens: mx.array) -> mx.array:
        """Runs the model on ``[k]`` tokens; returns its ``[k, V]`` logits (lazy)."""
        logits = self.model(tokens[None], cache=self.cache.layers)
        self.cache.fed(tokens.size)
        return logits[0]

    def prefill(self, text: Text, step: int) -> None:
        """Feeds all prompt tokens but the last, ``step`` at a time, quantizing as mlx-lm does."""
        while self.cache.length < len(text) - 1:
            self.feed(text.tokens(self.cache.length, min(self.cache.length + step, len(text) - 1)))
            self.quantize(self.cache.layers)
            mx.eval([c.state for c in self.cache.layers])

    def room(self) -> int:
        """How many tokens a call may feed before a cache still in full precision passes the
        length from which mlx-lm quantizes it: mlx-lm's one-token steps switch there, so a
        verification must not straddle it to give the same logits."""
        if self.quantized_kv_start is None:
            return MAX_DRAFT_TOKENS + 1
        offsets = [c.offset for c in self.cache.layers if type(c) is KVCache]
        if not offsets or max(offsets) >= self.quantized_kv_start:
            return MAX_DRAFT_TOKENS + 1
        return self.quantized_kv_start - max(offsets)

    def verify(self, text: Text, draft: mx.array) -> mx.array:
        """Scores the tokens the caches lack and ``[N]`` draft tokens in one call.

        Returns:
            array: the ``[N + 1, V]`` logits (after the processors) of the positions that decide
            the draft, lazy.
        """
        n = draft.size
        self.cache.checkpoint()
        # A draft id the target cannot embed is never accepted; feed a valid id in its place.
        fed = draft if self.vocab is None else mx.minimum(draft, self.vocab - 1)
        with decode_masks(self.cache.layers):
            logits = self.feed(mx.concatenate([text.tokens(self.cache.length), fed]))[-(n + 1) :]
        if not self.processors:
            return logits
        context = text.array()
        rows = []
        for i in range(n + 1):
            tokens = mx.concatenate([context, draft[:i]]) if i else context
            row = logits[i : i + 1]
            for processor in self.processors:
                row = processor(tokens, row)
            rows.append(row)
        return mx.concatenate(rows)

    def keep(self, length: int) -> int:
        """Keeps ``length`` tokens of the text, or fewer where a checkpoint had to be restored;
        then quantizes as mlx-lm would. Returns the tokens the caches hold."""
        held = self.cache.rewind(length)
        self.cache.forget()
        self.quantize(self.cache.layers)
        return held


class _Generation:
    """One speculative generation: the text, the target, the drafter and the rule."""

    def __init__(
        self,
        text: Text,
        target: _Target,
        drafter: Drafter,
        rule: Rule,
        lengths: DraftLength,
        eos: list[int],
        key: mx.array | None,
        stats: SpeculativeStats,
        prompt_cache: list[Any] | None = None,
        group: mx.distributed.Group | None = None,
    ) -> None:
        self.text = text
        self.target = target
        self.drafter = drafter
        self.rule = rule
        self.lengths = lengths
        self.eos_set = set(eos)
        self.eos_array = mx.array(eos, dtype=mx.uint32) if eos else None
        # The fused kernels where MLX runs on CUDA (the loop never vmaps).
        self.fused = kernels.available()
        self.key = key
        self.stats = stats
        self.prompt_cache = prompt_cache
        self.layers = [target.cache.layers]
        if isinstance(drafter, ModelDrafter):
            self.layers.append(drafter.cache.layers)
        # On a group, adaptive lengths are chosen from rank 0's times, which every rank reads a
        # round late: each rank then makes the same target calls.
        self.group = group if lengths.adaptive else None
        self._unrecorded: tuple[int, int, int, int] | None = None
        self._microseconds = 0

    def round(self, remaining: int) -> tuple[list[int], int, mx.array]:
        """One draft-verify round, with one host read.

        Args:
            remaining (int): the most tokens this round may emit, ``>= 1``.

        Returns:
            tuple: the tokens to emit (at most ``remaining``; none after an EOS), how many of
            them came from the draft, and the ``[N + 1, V]`` log-probabilities (lazy).
        """
        start = time.perf_counter()
        length = len(self.text)
        pending = length - self.target.cache.length
        cap = min(remaining - 1, self.target.room() - pending)
        n = self.lengths.choose(pending, max(cap, 0), self.target.cache.replays)
        draft_key = verify_key = None
        if self.rule.random:
            self.key, draft_key, verify_key = mx.random.split(self.key, 3)
        draft = self.drafter.propose(self.text, n, draft_key)
        # Nothing to verify: a free drafter is still asked, to measure its acceptance.
        shadow = (
            self.drafter.propose(self.text, 1, None)
            if draft.size == 0 and self.lengths.adaptive and self.drafter.free
            else None
        )
        logits = self.target.verify(self.text, draft.tokens)
        result, logprobs = self.rule.decide(
            logits, draft.tokens, draft.probs, self.eos_array, verify_key, fused=self.fused
        )
        parts = [result, draft.tokens] + ([shadow.tokens] if shadow is not None else [])
        if self.group is not None:
            mine = self._microseconds if self.group.rank() == 0 else 0
            parts.append(mx.distributed.all_sum(mx.array([mine], mx.uint32), group=self.group))
        values = mx.concatenate(parts).tolist()  # the round's one host read
        accepted, token = values[0], values[1]
        check_next("speculative_generate_step", token)
        tokens = values[3 : 3 + accepted]
        if not (tokens and tokens[-1] in self.eos_set):
            tokens.append(token)
        tokens = tokens[:remaining]
        kept = min(accepted, len(tokens))
        self.text.extend(tokens)
        self.target.keep(length + kept)
        self.drafter.update(self.text, kept)
        if shadow is not None and shadow.size:
            self.lengths.shadow(int(values[3 + draft.size] == token), 1)
        self.stats.rounds += 1
        self.stats.drafted += draft.size
        self.stats.accepted += accepted
        self.stats.replayed += pending - 1
        counts = (draft.size, accepted, pending + draft.size, draft.steps)
        seconds = time.perf_counter() - start
        if self.group is None:
            self.lengths.record(*counts, seconds)
        else:
            if self._unrecorded is not None:
                self.lengths.record(*self._unrecorded, values[-1] / 1e6)
            self._unrecorded, self._microseconds = counts, min(int(seconds * 1e6), 2**32 - 1)
        return tokens, kept, logprobs

    def finish(self, consumed: int, feed: bool) -> None:
        """Leaves every cache holding the prompt and the ``consumed`` tokens; feeding what a
        cache lacks only when ``feed``."""
        length = self.text.prompt.size + consumed
        held = self.target.cache.rewind(length)
        if feed and held < length:
            self.target.feed(self.text.tokens(held, length))
        self.target.cache.forget()
        self.drafter.finish(self.text, length, feed)
        if self.prompt_cache is not None:
            # Quantization replaced some caches in the lists the models use: hand them back.
            self.prompt_cache[:] = [c for layers in self.layers for c in layers]


def _opaque_warning() -> None:
    warnings.warn(
        "speculative_generate_step: the sampler does not expose its distribution (no `probs`), so "
        "draft tokens are accepted only when the target's own sample equals them (mlx-lm's rule): "
        "still lossless, but few drafts are kept at temperature > 0. Use "
        "mlx_spec.sampling.make_sampler for rejection sampling.",
        stacklevel=3,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(op: str, name: str, value: object, least: int, most: int | None = None) -> int:
    if not _is_int(value) or value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{op}: `{name}` must be an int {bound}, got {value!r}")
    return int(value)


def _check_callable(op: str, name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{op}: `{name}` must be callable or None, got {value!r}")


def _check_prompt(op: str, prompt: object, vocab: int | None) -> list[int]:
    """Checks the ``[L]`` integer prompt and reads its ids (one host read)."""
    if not isinstance(prompt, mx.array) or prompt.ndim != 1 or prompt.size == 0:
        shown = describe(prompt) if isinstance(prompt, mx.array) else type(prompt).__name__
        raise ValueError(f"{op}: `prompt` must be a non-empty [L] array of token ids, got {shown}")
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise ValueError(f"{op}: `prompt` must hold integer token ids, got dtype {prompt.dtype}")
    ids = prompt.tolist()
    low, high = min(ids), max(ids)
    limit = vocab if vocab is not None else 2**32
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        where = f"the target's vocabulary [0, {vocab})" if vocab is not None else "[0, 2**32)"
        raise ValueError(f"{op}: `prompt` holds token id {bad}, outside {where}")
    return ids


def _check_eos(op: str, eos_token_ids: object) -> list[int]:
    if eos_token_ids is None:
        return []
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Iterable):
        raise ValueError(
            f"{op}: `eos_token_ids` must be an iterable of int token ids, got {eos_token_ids!r}"
        )
    ids = list(eos_token_ids)
    for i in ids:
        if not _is_int(i) or not 0 <= i < 2**32:
            raise ValueError(f"{op}: `eos_token_ids` must hold int ids in [0, 2**32), got {i!r}")
    return [int(i) for i in ids]


def _check_processors(op: str, processors: object) -> list[LogitsProcessor]:
    if processors is None:
        return []
    if callable(processors) or not isinstance(processors, Sequence):
        raise ValueError(
            f"{op}: `logits_processors` must be a list of callables, got {processors!r}"
        )
    for processor in processors:
        if not callable(processor):
            raise ValueError(
                f"{op}: `logits_processors` must hold callables, got {processor!r} in it"
            )
    return list(processors)


def _check_kv_bits(op: str, kv_bits: object, kv_group_size: object, start: object) -> None:
    if kv_bits is not None and (not _is_int(kv_bits) or kv_bits not in (2, 3, 4, 5, 6, 8)):
        raise ValueError(
            f"{op}: `kv_bits` must be None or one of 2, 3, 4, 5, 6, 8, got {kv_bits!r}"
        )
    if not _is_int(kv_group_size) or kv_group_size not in (32, 64, 128):
        raise ValueError(f"{op}: `kv_group_size` must be 32, 64 or 128, got {kv_group_size!r}")
    _check_int(op, "quantized_kv_start", start, 0)


def _drafter(
    op: str, draft_model: object, drafter: object, prompt_cache: list[Any] | None, targets: int
) -> Drafter:
    """The generation's drafter, from ``draft_model`` or ``drafter``; checks the caches' split."""
    if draft_model is not None and drafter is not None:
        raise ValueError(
            f"{op}: give a `draft_model` or a `drafter`, not both (got {type(draft_model).__name__}"
            f" and {drafter!r})"
        )
    if draft_model is None and drafter is None:
        raise ValueError(f"{op}: needs a `draft_model`, or a `drafter` such as 'prompt-lookup'")
    if draft_model is not None:
        if not isinstance(draft_model, nn.Module):
            raise ValueError(
                f"{op}: `draft_model` must be an mlx.nn.Module, got {type(draft_model).__name__}"
            )
        drafts = len(make_prompt_cache(draft_model))
        if prompt_cache is None:
            return ModelDrafter(draft_model)
        if len(prompt_cache) != targets + drafts:
            raise ValueError(
                f"{op}: `prompt_cache` must hold the target's {targets} caches followed by the "
                f"draft model's {drafts}, got {len(prompt_cache)} caches"
            )
        return ModelDrafter(draft_model, prompt_cache[targets:])
    if prompt_cache is not None and len(prompt_cache) != targets:
        raise ValueError(
            f"{op}: `prompt_cache` must hold the target's {targets} caches (a drafter keeps its "
            f"own), got {len(prompt_cache)} caches"
        )
    if drafter == "prompt-lookup":
        return PromptLookupDrafter()
    if isinstance(drafter, Drafter):
        return drafter
    raise ValueError(
        f"{op}: `drafter` must be 'prompt-lookup' or an mlx_spec.drafters.Drafter, got {drafter!r}"
    )


def _check_prompt_cache(op: str, prompt_cache: object) -> list[Any] | None:
    if prompt_cache is not None and not isinstance(prompt_cache, list):
        raise ValueError(f"{op}: `prompt_cache` must be a list of caches, got {prompt_cache!r}")
    return prompt_cache


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: nn.Module | None = None,
    stream: StreamLike = generation_stream,
    *,
    num_draft_tokens: int = 3,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int = 512,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = _lm_generate.DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    key: mx.array | None = None,
    eos_token_ids: Iterable[int] | None = None,
    stats: SpeculativeStats | None = None,
    drafter: str | Drafter | None = None,
    adaptive: bool = False,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Speculative decoding whose output has the target's distribution at any temperature.

    A drop-in for ``mlx_lm.generate.speculative_generate_step``: same arguments (``stream``
    included, fourth and positional) and the same yields; ``drafter`` and ``adaptive`` add
    drafting without a second model and a draft length that adapts. The sampler decides the
    rule (:mod:`mlx_spec.rules`):

    - ``None``, a greedy sampler (``sampler.greedy``) or mlx-lm's greedy sampler: drafts are
      kept while they equal the target's argmax; the output equals the target's greedy decoding.
    - a sampler with ``probs`` (see :func:`mlx_spec.sampling.make_sampler`): draft tokens are
      kept by rejection sampling (:func:`mlx_spec.accept_sampled`); every emitted token has
      exactly the distribution of sampling the target with ``sampler``.
    - any other callable: mlx-lm's rule (a draft token is kept when the target's own sample
      equals it), with a warning; lossless but rarely accepting at temperature > 0.

    Each round costs one target call and one blocking host read (the acceptance result and the
    draft tokens, together). Tokens are yielded as soon as a round is read; ``max_tokens`` and
    the EOS ids end the generation exactly, also within a round. Every cache class that mlx-lm's
    models build is supported: appending KV caches are trimmed, rotating (sliding-window) ones
    trimmed exactly, and recurrent ones (``ArraysCache``, in hybrid models) restored from a
    checkpoint, the kept tokens then being fed again within the next round's target call. When
    the generator finishes, is closed or raises, the caches hold exactly the prompt and the
    tokens yielded (the last one included).

    Args:
        prompt (array): ``[L]`` integer prompt tokens, ``L >= 1``, each inside the target's
            vocabulary.
        model (nn.Module): the target model.
        draft_model (nn.Module, optional): the draft model; same tokenizer as the target (its
            vocabulary may be padded differently). Give it or ``drafter``.
        stream (Stream, optional): where the models run. Default: mlx-lm's generation stream.
        num_draft_tokens (int): the most draft tokens a round, in ``[0, MAX_DRAFT_TOKENS]``;
            never more than the tokens left to generate need. Default: ``3``.
        max_tokens (int): tokens to generate; ``-1`` for no limit. Default: ``256``.
        sampler (callable, optional): maps ``[..., V]`` log-probabilities to tokens. Default:
            greedy.
        logits_processors (list, optional): ``processor(tokens, logits) -> logits`` applied in
            order to ``[1, V]`` logits at every position, draft and target, ``tokens`` being the
            ``[L']`` prompt and tokens before that position (as mlx-lm applies them).
        prompt_cache (list, optional): the target's caches, followed by the draft model's when
            there is one (as mlx-lm's server builds it), updated in place. Default: new caches.
        prefill_step_size (int): prompt tokens per prefill call, ``>= 1``. Default: ``512``.
        kv_bits (int, optional): quantize the caches to this many bits (2, 3, 4, 5, 6 or 8).
            Default: ``None``.
        kv_group_size (int): group size of cache quantization: 32, 64 or 128. Default: ``64``.
        quantized_kv_start (int): cache length from which to quantize. Default: mlx-lm's.
        prompt_progress_callback (callable, optional): called with ``(processed, total)`` prompt
            tokens before and after the prefill.
        key (array, optional): ``[2]`` uint32 key from ``mx.random.key``; the same key, models,
            prompt and arguments (``max_tokens`` included) give the same tokens with
            ``adaptive=False``. Default: a key drawn from ``mx.random``'s global state
            (so ``mx.random.seed`` applies). Unused by greedy and by mlx-lm's rule (which draw
            as mlx-lm does).
        eos_token_ids (iterable of int, optional): end-of-sequence ids: generation ends after
            the first one emitted and acceptance never looks past it. Default: none (mlx-lm's
            ``stream_generate`` stops at them itself).
        stats (SpeculativeStats, optional): filled in as the generation runs.
        drafter (str or Drafter, optional): ``"prompt-lookup"`` (a
            :class:`mlx_spec.drafters.PromptLookupDrafter` with its defaults) or a
            :class:`mlx_spec.drafters.Drafter`, instead of ``draft_model``. Default: ``None``.
        adaptive (bool): choose each round's number of draft tokens, up to
            ``num_draft_tokens``, from the recent acceptance and the measured cost of a round
            (:mod:`mlx_spec.draft_length`); ``False`` always drafts ``num_draft_tokens`` (fewer
            when a drafter has fewer). Default: ``False``, as mlx-lm.

    Yields:
        tuple[int, array, bool]: a token, the target's ``[V]`` log-probabilities at its
        position (lazy: computed only if read) and whether the token came from the draft.

    Raises:
        ValueError: before any work, for a bad argument, a prompt id outside the target's
            vocabulary or a cache class that cannot be taken back (the message names it);
            during generation, when a NaN (or a distribution without mass) decided a round.
    """
    op = "speculative_generate_step"
    if not isinstance(model, nn.Module):
        raise ValueError(f"{op}: `model` must be an mlx.nn.Module, got {type(model).__name__}")
    if not isinstance(stream, (mx.Stream, mx.Device)) and type(stream) is not type(
        generation_stream
    ):
        raise ValueError(f"{op}: `stream` must be an mx.Stream or mx.Device, got {stream!r}")
    _check_int(op, "num_draft_tokens", num_draft_tokens, 0, MAX_DRAFT_TOKENS)
    _check_int(op, "max_tokens", max_tokens, -1)
    _check_callable(op, "sampler", sampler)
    processors = _check_processors(op, logits_processors)
    _check_int(op, "prefill_step_size", prefill_step_size, 1)
    _check_kv_bits(op, kv_bits, kv_group_size, quantized_kv_start)
    _check_callable(op, "prompt_progress_callback", prompt_progress_callback)
    eos = _check_eos(op, eos_token_ids)
    if stats is not None and not isinstance(stats, SpeculativeStats):
        raise ValueError(f"{op}: `stats` must be a SpeculativeStats or None, got {stats!r}")
    if not isinstance(adaptive, bool):
        raise ValueError(f"{op}: `adaptive` must be a bool, got {adaptive!r}")
    if key is not None:
        key = check_key(op, key)
    prompt_cache = _check_prompt_cache(op, prompt_cache)
    targets = len(make_prompt_cache(model))
    chosen = _drafter(op, draft_model, drafter, prompt_cache, targets)
    target_cache = make_prompt_cache(model) if prompt_cache is None else prompt_cache[:targets]
    check_caches(op, "the target's", target_cache)
    if isinstance(chosen, ModelDrafter):
        check_caches(op, "the draft model's", chosen.cache.layers)
        caches = target_cache + chosen.cache.layers
    else:
        caches = target_cache
    if kv_bits is not None and any(isinstance(c, RotatingKVCache) for c in caches):
        raise ValueError(
            f"{op}: `kv_bits` cannot quantize a RotatingKVCache (mlx-lm has no quantized "
            "rotating cache); use kv_bits=None with sliding-window models or max_kv_size"
        )
    vocab = _vocab_size(model)
    ids = _check_prompt(op, prompt, vocab)

    rule = make_rule(sampler)
    if rule.kind == "match":
        _opaque_warning()
    seed = None
    models = [model, chosen.model] if isinstance(chosen, ModelDrafter) else [model]
    group = model_group(*models)
    if rule.random:
        # Every rank of a group the models run on must draw the same tokens.
        key = agree_key(op, key, group, stream=stream)
        key, drafter_key = mx.random.split(key)
        high, low = drafter_key.tolist()
        seed = high << 32 | low
    quantize = partial(
        _lm_generate.maybe_quantize_kv_cache,
        quantized_kv_start=quantized_kv_start,
        kv_group_size=kv_group_size,
        kv_bits=kv_bits,
    )
    text = Text(prompt.astype(mx.uint32), ids)
    target = _Target(
        model,
        ModelCache(target_cache),
        processors,
        quantize,
        quantized_kv_start if kv_bits is not None else None,
        vocab,
    )
    setup = DraftSetup(rule, processors, quantize, prefill_step_size, seed)
    generation = _Generation(
        text,
        target,
        chosen,
        rule,
        DraftLength(num_draft_tokens, adaptive, chosen.free),
        eos,
        key,
        stats if stats is not None else SpeculativeStats(),
        prompt_cache,
        group,
    )
    progress = prompt_progress_callback or (lambda *_: None)
    return _run(generation, setup, stream, max_tokens, prefill_step_size, progress)


def _run(
    generation: _Generation,
    setup: DraftSetup,
    stream: StreamLike,
    max_tokens: int,
    prefill_step_size: int,
    progress: Callable[[int, int], None],
) -> Generator[tuple[int, mx.array, bool], None, None]:
    if max_tokens == 0:
        return
    consumed = 0
    total = generation.text.prompt.size
    try:
        with mx.stream(stream):
            progress(0, total)
            generation.drafter.start(generation.text, setup)
            generation.target.prefill(generation.text, prefill_step_size)
            progress(total, total)
        limit = max_tokens if max_tokens >= 0 else math.inf
        while True:
            with mx.stream(stream):
                tokens, from_draft, logprobs = generation.round(min(limit - consumed, 2**31))
            for i, token in enumerate(tokens):
                consumed += 1
                generation.stats.generated += 1
                yield token, logprobs[i], i < from_draft
            if consumed == max_tokens or (tokens and tokens[-1] in generation.eos_set):
                return
    finally:
        # Also after an error or a close: the caches then hold the prompt and what was yielded.
        with mx.stream(stream):
            try:
                generation.finish(consumed, feed=True)
            except Exception:
                generation.finish(consumed, feed=False)


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | mx.array | list[int],
    max_tokens: int = 256,
    draft_model: nn.Module | None = None,
    stream: StreamLike = generation_stream,
    **kwargs: Any,
) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's ``stream_generate``, speculative through :func:`speculative_generate_step`.

    Without ``draft_model`` or ``drafter`` this is mlx-lm's own ``stream_generate``. With one,
    it yields what mlx-lm's yields (text segments, tokens, lazy log-probabilities,
    ``from_draft``, timings, ``finish_reason``) as :class:`SpeculativeResponse`, whose ``stats``
    are the round counts so far; the last response's cover the whole generation. Every EOS id
    of ``tokenizer`` ends the generation, and acceptance never looks past one.

    Args:
        model (nn.Module): the target model.
        tokenizer (TokenizerWrapper or tokenizer): wrapped in mlx-lm's ``TokenizerWrapper`` if
            it is not one.
        prompt (str, array or list of int): text, or ``[L]`` token ids.
        max_tokens (int): tokens to generate, ``-1`` for no limit; not 0. Default: ``256``.
        draft_model (nn.Module, optional): the draft model. Default: none.
        stream (Stream, optional): where the models run. Default: mlx-lm's generation stream.
        kwargs: passed to :func:`speculative_generate_step` (``drafter``, ``sampler``,
            ``num_draft_tokens``, ``adaptive``, ``key``, ``stats``, ...); ``max_kv_size``, when
            no ``prompt_cache`` is given, makes rotating caches of that size as mlx-lm does.

    Yields:
        GenerationResponse: one per token; ``finish_reason`` is ``"stop"`` or ``"length"`` on
        the last one.

    Raises:
        ValueError: ``max_tokens`` is 0, ``input_embeddings`` are given with speculation, or
            :func:`speculative_generate_step` rejects an argument.
    """
    if draft_model is None and kwargs.get("drafter") is None:
        if kwargs.pop("key", None) is not None:
            raise ValueError(
                "stream_generate: `key` needs a draft model or a drafter (plain generation "
                "draws from mx.random's global state)"
            )
        for name in ("stats", "drafter", "adaptive"):
            kwargs.pop(name, None)
        yield from _LM_STREAM_GENERATE(model, tokenizer, prompt, max_tokens, None, stream, **kwargs)
        return
    if max_tokens == 0:
        raise ValueError("stream_generate: `max_tokens` must not be 0 (use -1 for no limit)")
    if kwargs.pop("input_embeddings", None) is not None:
        raise ValueError("stream_generate: speculative decoding does not take `input_embeddings`")
    max_kv_size = kwargs.pop("max_kv_size", None)
    if max_kv_size is not None and kwargs.get("prompt_cache") is None:
        _check_int("stream_generate", "max_kv_size", max_kv_size, 1)
        models = [model] if draft_model is None else [model, draft_model]
        kwargs["prompt_cache"] = [c for m in models for c in make_prompt_cache(m, max_kv_size)]
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    if not isinstance(prompt, mx.array):
        prompt = mx.array(prompt)
    stats = kwargs.pop("stats", None) or SpeculativeStats()
    eos = tokenizer.eos_token_ids
    tokens = speculative_generate_step(
        prompt,
        model,
        draft_model,
        stream,
        max_tokens=max_tokens,
        eos_token_ids=eos,
        stats=stats,
        **kwargs,
    )
    detokenizer = tokenizer.detokenizer

    def response(token: int, logprobs: mx.array, from_draft: bool, count: int, finish: str | None):
        return SpeculativeResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=count,
            generation_tps=count / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stats=replace(stats),
        )

    with wired_limit(model, [stream]):
        tic = time.perf_counter()
        try:
            for n, (token, logprobs, from_draft) in enumerate(tokens):
                if n == 0:
                    prompt_tps = prompt.size / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                if token in eos:
                    break
                detokenizer.add_token(token)
                if n + 1 == max_tokens:
                    break
                yield response(token, logprobs, from_draft, n + 1, None)
        finally:
            # Closing settles the caches on the prompt and the tokens yielded.
            tokens.close()
        detokenizer.finalize()
        finish = "stop" if token in eos else "length"
        yield response(token, logprobs, from_draft, n + 1, finish)


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | list[int],
    verbose: bool = False,
    **kwargs: Any,
) -> str:
    """mlx-lm's ``generate``, speculative when given ``draft_model`` or ``drafter``.

    Args:
        model (nn.Module): the target model.
        tokenizer (TokenizerWrapper or tokenizer): the tokenizer.
        prompt (str or list of int): text or token ids.
        verbose (bool): print the text as it comes, then timings and, when speculative, the
            round counts. Default: ``False``.
        kwargs: passed to :func:`stream_generate`; pass ``stats=SpeculativeStats()`` to get the
            round counts back.

    Returns:
        str: the generated text.
    """
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        if isinstance(response, SpeculativeResponse):
            s = response.stats
            print(
                f"Speculation: {s.rounds} rounds, {s.accepted}/{s.drafted} draft tokens accepted, "
                f"{s.tokens_per_round:.2f} tokens per round"
            )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
