"""Speculative generation for mlx-lm with lossless acceptance at any temperature.

:func:`speculative_generate_step` has the signature and the yields of
``mlx_lm.generate.speculative_generate_step``, and also drafts without a second model
(``drafter="prompt-lookup"``); it checks its arguments, builds the parts of the generation and
hands them to the loop (:mod:`mlx_spec.loop`). ``N`` is ``num_draft_tokens``, or with
``adaptive=True`` the number that pays most each round (:mod:`mlx_spec.draft_length`).
:func:`stream_generate` and :func:`generate` mirror mlx-lm's functions of those names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import _mlx_lm
from ._checks import (
    check_callable,
    check_eos_ids,
    check_int,
    check_key,
    check_kv_bits,
    check_processors,
    check_prompt,
    check_prompt_cache,
    check_token_list,
    is_int,
)
from ._mlx_lm import lm
from .attention import chunks_pay
from .caches import ModelCache, check_caches
from .distributed import agree_key, model_group, round_arguments
from .draft_length import MAX_DRAFT_TOKENS, Adaptive, DraftPolicy, Fixed
from .drafters import Drafter, DraftSetup, ModelDrafter, PromptLookupDrafter
from .keys import KeyChain
from .loop import Generation, SpeculativeStats, Target, Text, vocab_size
from .mtp import MTPDrafter, head_of
from .rules import ACCEPTANCE, make_rule

generation_stream = lm.generation_stream

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


@dataclass
class SpeculativeResponse(GenerationResponse):
    """mlx-lm's ``GenerationResponse`` with the generation's :class:`SpeculativeStats` so far.

    Attributes:
        stats (SpeculativeStats): a snapshot taken when the response was made; the final
            response's counts cover the whole generation.
    """

    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


def _drafter(
    op: str,
    model: nn.Module,
    draft_model: object,
    drafter: object,
    prompt_cache: list[Any] | None,
    targets: int,
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
    if isinstance(drafter, str) and drafter == "prompt-lookup":
        return PromptLookupDrafter()
    if isinstance(drafter, str) and drafter == "mtp":
        return MTPDrafter(_mtp_head(op, model))
    if isinstance(drafter, Drafter):
        return drafter
    raise ValueError(
        f"{op}: `drafter` must be 'prompt-lookup', 'mtp' or an mlx_spec.drafters.Drafter, got "
        f"{drafter!r}"
    )


def _mtp_head(op: str, model: Any) -> Any:
    """The MTP head :func:`mlx_spec.load` gave ``model``; a ``ValueError`` says how to add one."""
    head = head_of(model) if isinstance(model, nn.Module) else None
    if head is None:
        raise ValueError(
            f"{op}: `drafter='mtp'` needs the model's MTP head: load the model with "
            "mlx_spec.load(path) from a folder that has one (`mlx-spec convert-mtp HF_DIR "
            "MLX_DIR` adds it from the original checkpoint)"
        )
    return head


def make_quantizer(
    prompt_cache: list[Any] | None,
    target_layers: list[Any],
    draft_layers: list[Any],
    *,
    kv_bits: int | None,
    kv_group_size: int,
    quantized_kv_start: int,
) -> Callable[[list[Any]], None]:
    """Makes the function that quantizes a model's caches after a call, as mlx-lm does.

    mlx-lm swaps the quantized caches into the caller's ``prompt_cache`` list. The models use
    their own lists here (the target's and the draft model's), so the quantizer copies them back
    into ``prompt_cache`` after each swap: the caller's list always holds the live caches.

    Args:
        prompt_cache (list, optional): the caller's list, the target's caches then the draft
            model's.
        target_layers (list): the list of caches the target uses.
        draft_layers (list): the list of caches the draft model uses (empty without one).
        kv_bits (int, optional): bits of the quantized caches; ``None`` quantizes nothing.
        kv_group_size (int): group size of the quantization.
        quantized_kv_start (int): cache length from which to quantize.

    Returns:
        callable: takes one model's list of caches and swaps in quantized ones in place.
    """
    quantize = partial(
        lm.maybe_quantize_kv_cache,
        quantized_kv_start=quantized_kv_start,
        kv_group_size=kv_group_size,
        kv_bits=kv_bits,
    )
    if kv_bits is None or prompt_cache is None:
        return quantize

    def quantize_in_place(layers: list[Any]) -> None:
        quantize(layers)
        prompt_cache[:] = target_layers + draft_layers

    return quantize_in_place


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
    quantized_kv_start: int = lm.quantized_kv_start,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    key: mx.array | None = None,
    eos_token_ids: Iterable[int] | None = None,
    stats: SpeculativeStats | None = None,
    drafter: str | Drafter | None = None,
    adaptive: bool = False,
    policy: DraftPolicy | None = None,
    acceptance: str = "coupled",
    cached_tokens: Sequence[int] | None = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Speculative decoding whose output is the target's own sampling, at any temperature.

    A drop-in for ``mlx_lm.generate.speculative_generate_step``: same arguments (``stream``
    included, fourth and positional) and the same yields; ``drafter``, ``adaptive``, ``policy``
    and ``acceptance`` add drafting without a second model, draft lengths that adapt, and the
    choice of rule. The sampler decides the rule (:mod:`mlx_spec.rules`):

    - ``None``, a greedy sampler (``sampler.greedy``) or mlx-lm's greedy sampler: drafts are
      kept while they equal the target's argmax; the output equals the target's greedy decoding.
    - any other sampler, with ``acceptance="coupled"`` (the default): the token at each text
      position is the sampler's draw with that position's random state (:mod:`mlx_spec.keys`),
      as mlx-lm's plain sampling draws it; drafts are kept while they equal it. The text is
      plain sampling's with the same key or seed, whatever the drafter, ``N``, timing or
      ``max_tokens``: the same as mlx-lm's ``generate`` gives under ``mx.random.seed``.
    - a sampler with ``probs`` (see :func:`mlx_spec.sampling.make_sampler`) and
      ``acceptance="residual"``: rejection sampling (:func:`mlx_spec.accept_sampled`); every
      token has exactly the target's distribution, and the same key gives the same text for the
      same draft lengths.

    Each round costs one target call and one blocking host read (the acceptance result and the
    draft tokens, together). Tokens are yielded as soon as a round is read; ``max_tokens`` and
    the EOS ids end the generation exactly, also within a round. Every cache class that mlx-lm's
    models build is supported: appending KV caches are trimmed, rotating (sliding-window) ones
    trimmed exactly, the gated delta-net layers of Qwen3-Next and Qwen3.5 models take the state
    kept after the last kept position, and other recurrent ones (``ArraysCache``, in hybrid
    models) are restored from a checkpoint, the kept tokens then being fed again within the next
    round's target call. When the generator finishes, is closed or raises (``KeyboardInterrupt``
    included), the caches hold exactly the prompt and the tokens yielded (the last one included).

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
        key (array, optional): ``[2]`` uint32 key from ``mx.random.key``: the random state
            before the first generated token, so ``key=mx.random.key(s)`` gives the text of
            ``mx.random.seed(s)``; ``mx.random``'s global state is left as it was. Default:
            ``mx.random``'s global state, which the generation then advances as mlx-lm's loop
            would. Unused by greedy.
        eos_token_ids (iterable of int, optional): end-of-sequence ids: generation ends after
            the first one emitted and acceptance never looks past it. Default: none (mlx-lm's
            ``stream_generate`` stops at them itself).
        stats (SpeculativeStats, optional): filled in as the generation runs.
        drafter (str or Drafter, optional): ``"prompt-lookup"`` (a
            :class:`mlx_spec.drafters.PromptLookupDrafter` with its defaults) or a
            :class:`mlx_spec.drafters.Drafter`, instead of ``draft_model``. Default: ``None``.
        adaptive (bool): choose each round's number of draft tokens, up to
            ``num_draft_tokens``, with :class:`mlx_spec.draft_length.Adaptive`; ``False`` always
            drafts ``num_draft_tokens`` (fewer when a drafter has fewer). Default: ``False``, as
            mlx-lm.
        policy (DraftPolicy, optional): the draft-length policy, instead of ``adaptive``
            (:mod:`mlx_spec.draft_length`; pass the same :class:`~mlx_spec.draft_length.Adaptive`
            to later generations to keep what it measured). Default: from ``adaptive``.
        acceptance (str): ``"coupled"`` or ``"residual"`` for a sampler that samples (see
            above). Default: ``"coupled"``.
        cached_tokens (sequence of int, optional): the tokens ``prompt_cache`` already holds,
            before ``prompt`` (an earlier turn): drafters that copy from the text (prompt
            lookup) draft from them too. Default: none.

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
    if isinstance(stream, mx.Device) and not mx.is_available(stream):
        raise ValueError(f"{op}: `stream` is {stream}, a device this MLX cannot run on")
    # A NumPy integer is taken as the int it holds, as mlx-lm takes it.
    num_draft_tokens = check_int(op, "num_draft_tokens", num_draft_tokens, 0, MAX_DRAFT_TOKENS)
    max_tokens = check_int(op, "max_tokens", max_tokens, -1)
    check_callable(op, "sampler", sampler)
    processors = check_processors(op, logits_processors)
    check_int(op, "prefill_step_size", prefill_step_size, 1)
    check_kv_bits(op, kv_bits, kv_group_size, quantized_kv_start)
    check_callable(op, "prompt_progress_callback", prompt_progress_callback)
    eos = check_eos_ids(op, eos_token_ids)
    if stats is not None and not isinstance(stats, SpeculativeStats):
        raise ValueError(f"{op}: `stats` must be a SpeculativeStats or None, got {stats!r}")
    if not isinstance(adaptive, bool):
        raise ValueError(f"{op}: `adaptive` must be a bool, got {adaptive!r}")
    if policy is not None and not isinstance(policy, DraftPolicy):
        raise ValueError(
            f"{op}: `policy` must be a DraftPolicy (with choose and observe), got {policy!r}"
        )
    if policy is not None and adaptive:
        raise ValueError(f"{op}: give `adaptive=True` or a `policy`, not both")
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"{op}: `acceptance` must be one of {ACCEPTANCE}, got {acceptance!r}")
    history = check_token_list(op, "cached_tokens", cached_tokens)
    if key is not None:
        key = check_key(op, key)
    prompt_cache = check_prompt_cache(op, prompt_cache)
    targets = len(make_prompt_cache(model))
    chosen = _drafter(op, model, draft_model, drafter, prompt_cache, targets)
    target_cache = make_prompt_cache(model) if prompt_cache is None else prompt_cache[:targets]
    given = None if prompt_cache is None else "prompt_cache"
    check_caches(op, "the target's", target_cache, given, model)
    if isinstance(chosen, ModelDrafter):
        check_caches(op, "the draft model's", chosen.cache.layers, given, chosen.model)
        caches = target_cache + chosen.cache.layers
    else:
        caches = target_cache
    if kv_bits is not None and any(isinstance(c, RotatingKVCache) for c in caches):
        raise ValueError(
            f"{op}: `kv_bits` cannot quantize a RotatingKVCache (mlx-lm has no quantized "
            "rotating cache); use kv_bits=None with sliding-window models or max_kv_size"
        )
    vocab = vocab_size(model)
    ids = check_prompt(op, prompt, vocab)
    rule = make_rule(sampler, acceptance, vocab)

    models = [model, chosen.model] if isinstance(chosen, ModelDrafter) else [model]
    group = model_group(*models)
    keys = restore = None
    # Every rank of a group the models run on must run the same rounds and draw the same tokens:
    # one collective checks what shapes a round and agrees the key, before any target call.
    shape = round_arguments(
        max_tokens=max_tokens, num_draft_tokens=num_draft_tokens, drafter=chosen, policy=policy,
        adaptive=adaptive, prompt=ids, acceptance=rule.kind,
    )  # fmt: skip
    agreed = agree_key(op, key if rule.random else None, group, stream=stream, arguments=shape)
    if rule.random:
        # A key leaves mx.random's state as it was (only a sampler called on it changes it).
        restore = mx.random.state[0] if key is not None and rule.seeds else None
        keys = KeyChain(agreed, rule.steps, key is None)
    if policy is None:
        policy = Adaptive(num_draft_tokens) if adaptive and num_draft_tokens else None
        policy = policy or Fixed(num_draft_tokens)
    quantize = make_quantizer(
        prompt_cache,
        target_cache,
        chosen.cache.layers if isinstance(chosen, ModelDrafter) else [],
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    device = stream if isinstance(stream, mx.Device) else stream.device
    split = None
    if chosen.reads_hidden:
        split = _mlx_lm.split(model)
        if split is None:
            raise ValueError(
                f"{op}: {type(chosen).__name__} reads the target's hidden states, which this "
                f"model ({type(model).__module__}) does not expose as the input of its LM head"
            )
    target = Target(
        model,
        ModelCache(target_cache, model=model),
        processors,
        quantize,
        quantized_kv_start if kv_bits is not None else None,
        vocab,
        chunked=chunks_pay(device),
        split=split,
    )
    generation = Generation(
        text=Text(prompt.astype(mx.uint32), ids, history),
        target=target,
        drafter=chosen,
        setup=DraftSetup(rule, processors, quantize, prefill_step_size, split),
        rule=rule,
        policy=policy,
        keys=keys,
        restore=restore,
        eos=eos,
        stats=stats if stats is not None else SpeculativeStats(),
        stream=stream,
        max_tokens=max_tokens,
        prefill_step_size=prefill_step_size,
        progress=prompt_progress_callback,
        group=group,
    )
    return iter(generation)


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
        ValueError: with speculation, ``max_tokens`` is 0, ``input_embeddings`` are given,
            ``tokenizer`` is no tokenizer, ``prompt`` no text or ids, or
            :func:`speculative_generate_step` rejects an argument.
    """
    if draft_model is None and kwargs.get("drafter") is None:
        if kwargs.pop("key", None) is not None:
            raise ValueError(
                "stream_generate: `key` needs a draft model or a drafter (plain generation "
                "draws from mx.random's global state)"
            )
        for name in ("stats", "drafter", "adaptive", "policy", "acceptance"):
            kwargs.pop(name, None)
        yield from lm.stream_generate(model, tokenizer, prompt, max_tokens, None, stream, **kwargs)
        return
    if is_int(max_tokens) and max_tokens == 0:
        raise ValueError("stream_generate: `max_tokens` must not be 0 (use -1 for no limit)")
    if kwargs.pop("input_embeddings", None) is not None:
        raise ValueError("stream_generate: speculative decoding does not take `input_embeddings`")
    max_kv_size = kwargs.pop("max_kv_size", None)
    if max_kv_size is not None and kwargs.get("prompt_cache") is None:
        check_int("stream_generate", "max_kv_size", max_kv_size, 1)
        models = [model] if draft_model is None else [model, draft_model]
        kwargs["prompt_cache"] = [c for m in models for c in make_prompt_cache(m, max_kv_size)]
    if not isinstance(tokenizer, TokenizerWrapper):
        try:
            tokenizer = TokenizerWrapper(tokenizer)
        except (AttributeError, TypeError) as error:
            raise ValueError(
                "stream_generate: `tokenizer` must be a tokenizer or mlx-lm's TokenizerWrapper, "
                f"got {type(tokenizer).__name__} ({error})"
            ) from None
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    if not isinstance(prompt, mx.array):
        try:
            prompt = mx.array(prompt)
        except (TypeError, ValueError, RuntimeError) as error:
            # RuntimeError: MLX's std::bad_cast for a Python int at or above 2**63.
            raise ValueError(
                "stream_generate: `prompt` must be text, an array or a list of token ids, got "
                f"{type(prompt).__name__} MLX cannot make an array of ({error})"
            ) from None
    stats = kwargs.pop("stats", None)
    if stats is None:
        stats = SpeculativeStats()
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

    with lm.wired_limit(model, [stream]):
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

    Raises:
        ValueError: ``verbose`` is not a bool, or :func:`stream_generate` rejects an argument.
    """
    if not isinstance(verbose, bool):
        raise ValueError(f"generate: `verbose` must be a bool, got {verbose!r}")
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
