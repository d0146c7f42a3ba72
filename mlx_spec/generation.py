"""Speculative generation for mlx-lm with lossless acceptance at any temperature.

:func:`speculative_generate_step` has the signature and the yields of
``mlx_lm.generate.speculative_generate_step``. Each round:

1. the draft model proposes ``N`` tokens, drawn from the sampler's distribution of its logits
   (:meth:`mlx_spec.sampling.SpecSampler.probs`) with keys split from the round's key;
2. the target scores the ``N + 1`` positions in one call;
3. :func:`mlx_spec.accept_sampled` (or :func:`mlx_spec.accept_greedy` for a greedy sampler)
   decides, on the device, how many draft tokens to keep and the token after them;
4. one host read brings back that ``[3]`` result together with the draft tokens;
5. both caches are trimmed to what was kept.

At temperature > 0 the emitted tokens then have exactly the distribution of sampling the target
alone, where mlx-lm's own loop keeps a draft token only when the target's sample equals it.
:func:`stream_generate` and :func:`generate` mirror mlx-lm's functions; :func:`patch_mlx_lm`
routes mlx-lm's own ``stream_generate``, ``generate``, ``mlx_lm.generate`` command and server
through this loop.
"""

from __future__ import annotations

import importlib
import sys
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.sample_utils as _lm_sample_utils
from mlx_lm.generate import (
    GenerationResponse,
    generation_stream,
    maybe_quantize_kv_cache,
    wired_limit,
)
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import fused as fused_kernels
from ._checks import check_key, describe
from .acceptance import INVALID_ROW, accept_greedy, accept_sampled
from .sampling import make_sampler

# The module, not the function ``mlx_lm.generate`` that the package exports under that name.
_lm_generate = importlib.import_module("mlx_lm.generate")

__all__ = [
    "SpeculativeResponse",
    "SpeculativeStats",
    "generate",
    "patch_mlx_lm",
    "speculative_generate_step",
    "stream_generate",
    "unpatch_mlx_lm",
]

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
StreamLike = mx.Stream | mx.ThreadLocalStream | mx.Device

# mlx-lm's functions, as they were when this module was imported.
_LM_SPECULATIVE_STEP = _lm_generate.speculative_generate_step
_LM_STREAM_GENERATE = _lm_generate.stream_generate
_LM_MAKE_SAMPLER = _lm_sample_utils.make_sampler
_LM_GREEDY = _lm_sample_utils.greedy_sampler


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation, updated as it runs.

    Attributes:
        rounds (int): verification calls of the target.
        drafted (int): draft tokens proposed, over all rounds.
        accepted (int): draft tokens the target accepted, over all rounds.
        generated (int): tokens yielded to the caller.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0

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


def _opaque_warning() -> None:
    warnings.warn(
        "speculative_generate_step: the sampler does not expose its distribution (no `probs`), so "
        "draft tokens are accepted only when the target's own sample equals them (mlx-lm's rule): "
        "still lossless, but few drafts are kept at temperature > 0. Use "
        "mlx_spec.sampling.make_sampler for rejection sampling.",
        stacklevel=3,
    )


def _fit_vocab(rows: mx.array, vocab: int) -> mx.array:
    """The draft's ``[n, V_d]`` distributions as ``[n, V]``: zero-padded, or cut to ``V``.

    Mass a draft puts on ids the target lacks is rejected anyway (an id >= ``V`` is never
    accepted), and the residual over the target's ids stays exact, so cutting is lossless.
    """
    have = rows.shape[-1]
    if have == vocab:
        return rows
    if have > vocab:
        return rows[:, :vocab]
    return mx.pad(rows, [(0, 0), (0, vocab - have)])


class _Speculation:
    """One speculative generation: both models, their caches and how much of the text each saw.

    The text is ``prompt`` followed by ``emitted``; ``fed[m]`` counts its tokens held in model
    ``m``'s cache (0: target, 1: draft). Every cache holds a prefix of the text.
    """

    def __init__(
        self,
        prompt: mx.array,
        models: tuple[nn.Module, nn.Module],
        caches: tuple[list[Any], list[Any]],
        sampler: Any,
        mode: str,
        logits_processors: Sequence[LogitsProcessor],
        eos: list[int],
        key: mx.array | None,
        quantize: Callable[[list[Any]], None],
        stats: SpeculativeStats,
    ) -> None:
        self.prompt = prompt
        self.models = models
        self.caches = caches
        self.sampler = sampler
        self.mode = mode
        self.processors = list(logits_processors)
        self.eos_set = set(eos)
        self.eos_array = mx.array(eos, dtype=mx.uint32) if eos else None
        # The fused kernels where MLX runs on CUDA (the loop never vmaps).
        self.fused = fused_kernels.available()
        self.key = key
        self.quantize = quantize
        self.stats = stats
        self.emitted: list[int] = []
        self.fed = [0, 0]
        self.context = prompt if self.processors else None

    def text(self, start: int, stop: int) -> mx.array:
        """``[stop - start]`` uint32 tokens of the text."""
        p = self.prompt.size
        parts = []
        if start < p:
            parts.append(self.prompt[start : min(stop, p)])
        if stop > p:
            parts.append(mx.array(self.emitted[max(start - p, 0) : stop - p], dtype=mx.uint32))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def feed(self, m: int, tokens: mx.array) -> mx.array:
        """Runs model ``m`` on ``[k]`` tokens and returns its ``[k, V]`` logits (lazy)."""
        logits = self.models[m](tokens[None], cache=self.caches[m])
        self.quantize(self.caches[m])
        self.fed[m] += tokens.size
        return logits[0]

    def trim_to(self, m: int, length: int) -> None:
        if self.fed[m] > length:
            trim_prompt_cache(self.caches[m], self.fed[m] - length)
            self.fed[m] = length

    def prefill(self, step: int, progress: Callable[[int, int], None]) -> None:
        """Feeds all prompt tokens but the last to both models, ``step`` tokens at a time."""
        total = self.prompt.size
        progress(0, total)
        for m in (1, 0):
            while self.fed[m] < total - 1:
                stop = min(self.fed[m] + step, total - 1)
                self.feed(m, self.prompt[self.fed[m] : stop])
                mx.eval([c.state for c in self.caches[m]])
        progress(total, total)

    def process(self, logits: mx.array, drafts: list[mx.array]) -> mx.array:
        """Applies the logits processors to ``[1, V]`` logits following the text and ``drafts``."""
        if not self.processors:
            return logits
        tokens = mx.concatenate([self.context, *drafts]) if drafts else self.context
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def propose(self, n: int, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """The draft model's ``n`` tokens (``[n]`` uint32) and, when sampled, their ``[n, V_d]``
        distributions; all lazy."""
        keys = mx.random.split(key, n) if key is not None and n > 0 else None
        pending = self.text(self.fed[1], len(self.emitted) + self.prompt.size)
        drafts: list[mx.array] = []
        rows: list[mx.array] = []
        for i in range(n):
            logits = self.process(self.feed(1, pending)[-1:], drafts)
            if self.mode == "greedy":
                token = mx.argmax(logits, axis=-1).astype(mx.uint32)
            else:
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                if self.mode == "sampled":
                    q = self.sampler.probs(logprobs)
                    token = mx.random.categorical(mx.log(q), key=keys[i]).astype(mx.uint32)
                    rows.append(q)
                else:
                    token = self.sampler(logprobs).astype(mx.uint32)
            # Start computing while the next step's graph is built (not a host read).
            mx.async_eval(token)
            drafts.append(token)
            pending = token
        draft = mx.concatenate(drafts) if drafts else mx.array([], dtype=mx.uint32)
        return draft, (mx.concatenate(rows) if rows else None)

    def verify(
        self, draft: mx.array, q: mx.array | None, key: mx.array | None
    ) -> tuple[mx.array, mx.array]:
        """Scores ``[y, *draft]`` with the target: the lazy ``[3]`` acceptance result and the
        ``[N + 1, V]`` log-probabilities of each position (after the logits processors)."""
        n = draft.size
        length = len(self.emitted) + self.prompt.size
        logits = self.feed(0, mx.concatenate([self.text(self.fed[0], length), draft]))[-(n + 1) :]
        if self.processors:
            drafts = [draft[i : i + 1] for i in range(n)]
            logits = mx.concatenate(
                [self.process(logits[i : i + 1], drafts[:i]) for i in range(n + 1)]
            )
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.mode == "greedy":
            result = accept_greedy(logits, draft, self.eos_array, fused=self.fused)
        elif self.mode == "sampled":
            vocab = logits.shape[-1]
            q = _fit_vocab(q, vocab) if q is not None else None
            probs = self.sampler.probs(logprobs)
            result = accept_sampled(probs, draft, q, self.eos_array, key, fused=self.fused)
        else:
            # mlx-lm's rule: a draft token is kept when the target's own sample equals it, which
            # is greedy acceptance of the one-hot rows of those samples.
            picks = self.sampler(logprobs).astype(mx.uint32)
            one_hot = mx.arange(logits.shape[-1], dtype=mx.uint32)[None, :] == picks[:, None]
            result = accept_greedy(
                one_hot.astype(mx.float32), draft, self.eos_array, fused=self.fused
            )
        return result, logprobs

    def round(self, n: int, remaining: int) -> tuple[list[int], int, mx.array]:
        """One draft-verify round, with one host read.

        Returns:
            tuple: the tokens to emit (at most ``remaining``; none after an EOS), how many of
            them came from the draft, and the ``[N + 1, V]`` log-probabilities (lazy).
        """
        draft_key = verify_key = None
        if self.mode == "sampled":
            self.key, draft_key, verify_key = mx.random.split(self.key, 3)
        length = len(self.emitted) + self.prompt.size
        draft, q = self.propose(n, draft_key)
        result, logprobs = self.verify(draft, q, verify_key)
        values = mx.concatenate([result, draft]).tolist()  # the round's one host read
        accepted, token = values[0], values[1]
        if token >= INVALID_ROW:
            raise ValueError(
                "speculative_generate_step: the target's verification row at position "
                f"{token - INVALID_ROW} decided the result but is invalid: NaN in the logits, or "
                "NaN, infinite or no mass in the probabilities"
            )
        tokens = values[3 : 3 + accepted]
        if not (tokens and tokens[-1] in self.eos_set):
            tokens.append(token)
        tokens = tokens[:remaining]
        self.stats.rounds += 1
        self.stats.drafted += n
        self.stats.accepted += accepted
        # Keep in each cache only the accepted part of what it saw.
        new_length = length + len(tokens)
        self.trim_to(0, min(length + accepted, new_length))
        self.trim_to(1, min(length + accepted, new_length))
        self.emitted.extend(tokens)
        if self.processors:
            self.context = mx.concatenate([self.context, mx.array(tokens, dtype=mx.uint32)])
        return tokens, min(accepted, len(tokens)), logprobs

    def settle(self, consumed: int, feed: bool) -> None:
        """Leaves each cache holding the prompt and the ``consumed`` tokens; feeding what a cache
        lacks only when ``feed``."""
        length = self.prompt.size + consumed
        for m in (0, 1):
            self.trim_to(m, length)
            if feed and self.fed[m] < length:
                self.feed(m, self.text(self.fed[m], length))


def _acceptance_mode(sampler: Any) -> str:
    """``"greedy"``, ``"sampled"`` (rejection sampling) or ``"match"`` (mlx-lm's rule)."""
    if sampler is None or sampler is _LM_GREEDY or getattr(sampler, "greedy", False):
        return "greedy"
    if callable(getattr(sampler, "probs", None)):
        return "sampled"
    return "match"


def _split_cache(
    prompt_cache: list[Any] | None, model: nn.Module, draft_model: nn.Module
) -> tuple[list[Any], list[Any]]:
    if prompt_cache is None:
        return make_prompt_cache(model), make_prompt_cache(draft_model)
    n = len(make_prompt_cache(model))
    model_cache, draft_cache = list(prompt_cache[:n]), list(prompt_cache[n:])
    if not draft_cache:
        raise ValueError(
            "speculative_generate_step: `prompt_cache` must hold the target's caches followed by "
            f"the draft model's, got {len(prompt_cache)} caches for a target with {n}"
        )
    return model_cache, draft_cache


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: nn.Module,
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
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Speculative decoding whose output has the target's distribution at any temperature.

    A drop-in for ``mlx_lm.generate.speculative_generate_step``: same arguments (``stream``
    included, fourth and positional) and the same yields. The sampler decides the rule:

    - ``None``, a greedy sampler (``sampler.greedy``) or mlx-lm's greedy sampler: the draft
      takes its argmax and :func:`mlx_spec.accept_greedy` keeps what the target's argmax agrees
      with; the output equals the target's greedy decoding.
    - a sampler with ``probs`` (see :func:`mlx_spec.sampling.make_sampler`): draft tokens are
      drawn from ``sampler.probs`` of the draft's log-probabilities and kept by rejection
      sampling (:func:`mlx_spec.accept_sampled`); every emitted token has exactly the
      distribution of sampling the target with ``sampler``.
    - any other callable: mlx-lm's rule (a draft token is kept when the target's own sample
      equals it), with a warning; lossless but rarely accepting at temperature > 0.

    Each round costs one blocking host read (the acceptance result and the draft tokens,
    together). Tokens are yielded as soon as a round is read; ``max_tokens`` and the EOS ids end
    the generation exactly, also within a round. When the generator finishes or is closed, both
    caches hold exactly the prompt and the tokens yielded (the last one included).

    Args:
        prompt (array): ``[L]`` integer prompt tokens, ``L >= 1``.
        model (nn.Module): the target model.
        draft_model (nn.Module): the draft model; same tokenizer as the target (its vocabulary
            may be padded differently).
        stream (Stream, optional): where the models run. Default: mlx-lm's generation stream.
        num_draft_tokens (int): draft tokens per round, ``>= 0``. Default: ``3``.
        max_tokens (int): tokens to generate; ``-1`` for no limit. Default: ``256``.
        sampler (callable, optional): maps ``[..., V]`` log-probabilities to tokens. Default:
            greedy.
        logits_processors (list, optional): ``processor(tokens, logits) -> logits`` applied in
            order to ``[1, V]`` logits at every position, draft and target, ``tokens`` being the
            ``[L']`` prompt and tokens before that position (as mlx-lm applies them).
        prompt_cache (list, optional): the target's caches followed by the draft model's (as
            mlx-lm's server builds it), updated in place; every cache must be trimmable.
            Default: new caches.
        prefill_step_size (int): prompt tokens per prefill call. Default: ``512``.
        kv_bits (int, optional): quantize the caches to this many bits. Default: ``None``.
        kv_group_size (int): group size of cache quantization. Default: ``64``.
        quantized_kv_start (int): cache length from which to quantize. Default: mlx-lm's.
        prompt_progress_callback (callable, optional): called with ``(processed, total)`` prompt
            tokens before and after the prefill.
        key (array, optional): ``[2]`` uint32 key from ``mx.random.key``; the same key, models,
            prompt and arguments give the same tokens, and a longer ``max_tokens`` extends them.
            Default: a key drawn from ``mx.random``'s global state (so ``mx.random.seed``
            applies). Unused by greedy and by mlx-lm's rule (which draw as mlx-lm does).
        eos_token_ids (iterable of int, optional): end-of-sequence ids: generation ends after
            the first one emitted and acceptance never looks past it. Default: none (mlx-lm's
            ``stream_generate`` stops at them itself).
        stats (SpeculativeStats, optional): filled in as the generation runs.

    Yields:
        tuple[int, array, bool]: a token, the target's ``[V]`` log-probabilities at its
        position (lazy: computed only if read) and whether the token came from the draft.

    Raises:
        ValueError: before any work, for a bad argument or a cache that cannot be trimmed;
            during generation, when a NaN (or a distribution without mass) decided a round.
    """
    op = "speculative_generate_step"
    if not isinstance(prompt, mx.array) or prompt.ndim != 1 or prompt.size == 0:
        shown = describe(prompt) if isinstance(prompt, mx.array) else type(prompt).__name__
        raise ValueError(f"{op}: `prompt` must be a non-empty [L] array of token ids, got {shown}")
    if prompt.dtype not in (mx.uint32, mx.int32, mx.int64, mx.uint64, mx.int16, mx.uint16):
        raise ValueError(f"{op}: `prompt` must hold integer token ids, got {describe(prompt)}")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"{op}: `num_draft_tokens` must be an int >= 0, got {num_draft_tokens!r}")
    if not isinstance(max_tokens, int) or max_tokens < -1:
        raise ValueError(f"{op}: `max_tokens` must be an int >= -1, got {max_tokens!r}")
    if key is not None:
        key = check_key(op, key)
    caches = _split_cache(prompt_cache, model, draft_model)
    for name, cache in zip(("target", "draft model"), caches, strict=True):
        if not can_trim_prompt_cache(cache):
            kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
            raise ValueError(
                f"{op}: speculative decoding trims the {name}'s cache after each round, but "
                f"these caches cannot be trimmed: {', '.join(kinds)}"
            )
    mode = _acceptance_mode(sampler)
    if mode == "match":
        _opaque_warning()
    if mode == "sampled" and key is None:
        key = mx.random.randint(0, 2**31 - 1, shape=(2,), dtype=mx.uint32)
    spec = _Speculation(
        prompt.astype(mx.uint32),
        (model, draft_model),
        caches,
        sampler,
        mode,
        logits_processors or [],
        [int(t) for t in eos_token_ids] if eos_token_ids is not None else [],
        key,
        partial(
            maybe_quantize_kv_cache,
            quantized_kv_start=quantized_kv_start,
            kv_group_size=kv_group_size,
            kv_bits=kv_bits,
        ),
        stats if stats is not None else SpeculativeStats(),
    )
    progress = prompt_progress_callback or (lambda *_: None)
    return _run(spec, stream, num_draft_tokens, max_tokens, prefill_step_size, progress)


def _run(
    spec: _Speculation,
    stream: StreamLike,
    num_draft_tokens: int,
    max_tokens: int,
    prefill_step_size: int,
    progress: Callable[[int, int], None],
) -> Generator[tuple[int, mx.array, bool], None, None]:
    if max_tokens == 0:
        return
    consumed = 0
    finished = False
    try:
        with mx.stream(stream):
            spec.prefill(prefill_step_size, progress)
        while True:
            remaining = max_tokens - consumed if max_tokens >= 0 else sys.maxsize
            with mx.stream(stream):
                tokens, from_draft, logprobs = spec.round(num_draft_tokens, remaining)
            for i, token in enumerate(tokens):
                consumed += 1
                spec.stats.generated += 1
                yield token, logprobs[i], i < from_draft
            if consumed == max_tokens or (tokens and tokens[-1] in spec.eos_set):
                finished = True
                return
    except GeneratorExit:
        finished = True
        raise
    finally:
        with mx.stream(stream):
            spec.settle(consumed, feed=finished)


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

    Without ``draft_model`` this is mlx-lm's own ``stream_generate``. With one, it yields what
    mlx-lm's yields (text segments, tokens, lazy log-probabilities, ``from_draft``, timings,
    ``finish_reason``) as :class:`SpeculativeResponse`, whose ``stats`` are the round counts so
    far; the last response's cover the whole generation. Every EOS id of ``tokenizer`` ends the
    generation, and acceptance never looks past one.

    Args:
        model (nn.Module): the target model.
        tokenizer (TokenizerWrapper or tokenizer): wrapped in mlx-lm's ``TokenizerWrapper`` if
            it is not one.
        prompt (str, array or list of int): text, or ``[L]`` token ids.
        max_tokens (int): tokens to generate, ``-1`` for no limit; not 0. Default: ``256``.
        draft_model (nn.Module, optional): the draft model. Default: none (plain generation).
        stream (Stream, optional): where the models run. Default: mlx-lm's generation stream.
        kwargs: passed to :func:`speculative_generate_step` (``sampler``, ``num_draft_tokens``,
            ``key``, ``stats``, ...); ``max_kv_size`` is ignored, as by mlx-lm's speculative
            path.

    Yields:
        GenerationResponse: one per token; ``finish_reason`` is ``"stop"`` or ``"length"`` on
        the last one.

    Raises:
        ValueError: ``max_tokens`` is 0, ``input_embeddings`` are given with a draft model, or
            :func:`speculative_generate_step` rejects an argument.
    """
    if draft_model is None:
        if kwargs.pop("key", None) is not None:
            raise ValueError(
                "stream_generate: `key` needs a draft model (plain generation draws from "
                "mx.random's global state)"
            )
        kwargs.pop("stats", None)
        yield from _LM_STREAM_GENERATE(model, tokenizer, prompt, max_tokens, None, stream, **kwargs)
        return
    if max_tokens == 0:
        raise ValueError("stream_generate: `max_tokens` must not be 0 (use -1 for no limit)")
    if kwargs.pop("input_embeddings", None) is not None:
        raise ValueError("stream_generate: speculative decoding does not take `input_embeddings`")
    kwargs.pop("max_kv_size", None)
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
            # Closing settles both caches on the prompt and the tokens yielded.
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
    """mlx-lm's ``generate``, speculative when given ``draft_model``.

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


@dataclass(frozen=True)
class _MlxLmSampler:
    """mlx-lm's sampler, unchanged when called, with the distribution it draws from.

    Attributes:
        sample (callable): the sampler ``mlx_lm.sample_utils.make_sampler`` made.
        distribution (SpecSampler): mlx-spec's sampler with the same arguments.
    """

    sample: Sampler
    distribution: Any

    greedy = False

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.sample(logprobs)

    def probs(self, logprobs: mx.array) -> mx.array:
        return self.distribution.probs(logprobs)


def _make_mlx_lm_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: list[int] | None = None,
) -> Sampler:
    """``mlx_lm.sample_utils.make_sampler`` while patched: its sampler, plus ``probs``."""
    sample = _LM_MAKE_SAMPLER(
        temp,
        top_p,
        min_p,
        min_tokens_to_keep,
        top_k,
        xtc_probability,
        xtc_threshold,
        xtc_special_tokens,
    )
    if temp == 0 or xtc_probability > 0.0:
        # Greedy is recognised as such; XTC has no distribution here (mlx-lm's rule applies).
        return sample
    try:
        distribution = make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)
    except ValueError:
        return sample
    return _MlxLmSampler(sample, distribution)


_SAMPLER_MODULES = ("mlx_lm.sample_utils", "mlx_lm.generate", "mlx_lm.server")


def patch_mlx_lm() -> None:
    """Routes mlx-lm's speculative decoding through mlx-spec; idempotent.

    Replaces, in the loaded mlx-lm:

    - ``mlx_lm.generate.speculative_generate_step`` by :func:`speculative_generate_step`. mlx-lm's
      ``stream_generate`` (also ``mlx_lm.stream_generate``) looks it up when it gets a
      ``draft_model``, and ``generate``, the ``mlx_lm.generate`` command and the server
      (``mlx_lm.server``) all go through that ``stream_generate``.
    - ``make_sampler`` in ``mlx_lm.sample_utils``, ``mlx_lm.generate`` and, when imported,
      ``mlx_lm.server`` by a wrapper returning mlx-lm's own sampler (called exactly as before,
      so generation without a draft model is unchanged) that also carries ``probs``, its
      distribution from :func:`mlx_spec.sampling.make_sampler`. The command and the server
      build their samplers with it, so their drafts are kept by rejection sampling. Greedy and
      XTC samplers are returned as they are (XTC keeps mlx-lm's rule, with a warning).

    Undo with :func:`unpatch_mlx_lm`.
    """
    _lm_generate.speculative_generate_step = speculative_generate_step
    for name in _SAMPLER_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "make_sampler", None) is _LM_MAKE_SAMPLER:
            module.make_sampler = _make_mlx_lm_sampler


def unpatch_mlx_lm() -> None:
    """Restores what :func:`patch_mlx_lm` replaced, also in mlx-lm modules imported meanwhile
    (which took the patched ``make_sampler``); idempotent."""
    _lm_generate.speculative_generate_step = _LM_SPECULATIVE_STEP
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm")
            and getattr(module, "make_sampler", None) is _make_mlx_lm_sampler
        ):
            module.make_sampler = _LM_MAKE_SAMPLER
