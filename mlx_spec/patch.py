"""``patch_mlx_lm``: mlx-lm's own generation, command and server through mlx-spec's loop.

:func:`patch_mlx_lm` imports ``mlx_lm.server`` and replaces, in the loaded mlx-lm:

- ``mlx_lm.generate.speculative_generate_step`` by mlx-spec's. mlx-lm's ``stream_generate``
  looks it up when it gets a ``draft_model``.
- ``stream_generate`` in ``mlx_lm.generate``, ``mlx_lm`` and ``mlx_lm.server`` by a function
  that runs mlx-spec's :func:`mlx_spec.generation.stream_generate` when there is a draft model
  (so ``max_kv_size`` makes rotating caches there too) or, when there is none, with
  ``mtp=True`` for a model with an MTP head (``drafter="mtp"``) and with ``prompt_lookup=True``
  (``drafter="prompt-lookup"``); and mlx-lm's own otherwise. The server serves a request with
  a draft model through it; ``generate`` and the ``mlx_lm.generate`` command go through it.
- With ``mtp=True``, ``load`` in ``mlx_lm``, ``mlx_lm.utils``, ``mlx_lm.generate`` and
  ``mlx_lm.server`` (through :func:`mlx_spec._mlx_lm.replace_load`) by
  :func:`mlx_spec.mtp_convert.load`: mlx-lm's ``load``, the ``mlx_lm.generate`` command and the
  server then attach a model's MTP head where its folder has one (``mtp.safetensors``, written
  by ``mlx-spec convert-mtp``).
- ``batch_generate`` in ``mlx_lm.generate`` and ``mlx_lm`` by a function that runs mlx-spec's
  batches (:func:`mlx_spec.batch.batch_generate`) when given a ``draft_model`` (and
  ``num_draft_tokens``), or with ``prompt_lookup=True``; and mlx-lm's own otherwise, or where
  the call needs what mlx-spec's batches do not take yet (see :func:`_batch_generate`).
- ``generate`` in ``mlx_lm.generate`` and ``mlx_lm`` (the command calls it) by mlx-lm's own,
  which with ``verbose=True`` and speculation also prints the rounds, the draft tokens drafted
  and accepted, and the tokens per round.
- ``make_sampler`` in ``mlx_lm.sample_utils``, ``mlx_lm.generate`` and ``mlx_lm.server`` by a
  wrapper returning mlx-lm's own sampler (called exactly as before, so generation without
  speculation is unchanged) that also carries ``probs``, its distribution from
  :func:`mlx_spec.sampling.make_sampler`; drafts are then kept by rejection sampling. Greedy and
  XTC samplers are returned as they are (XTC keeps mlx-lm's rule, with a warning).
- In ``mlx_lm.server`` (through :func:`mlx_spec._mlx_lm.patch_server`): every error of a
  generation is answered (400 for an argument the loop refuses, such as ``num_draft_tokens``
  above :data:`~mlx_spec.draft_length.MAX_DRAFT_TOKENS`, else 500, with ``{"error": message}``;
  in a stream whose 200 status was sent, an error event and ``data: [DONE]``); a prompt that the
  prompt cache holds exactly is answered, its last token fed again; the generation thread ends
  with ``mx.clear_streams()``. The requests to a model with a draft model, or without one with
  its MTP head (``mtp=True``) or ``prompt_lookup=True``, are batched speculatively
  (:mod:`mlx_spec.serving`) where the models' caches and the head batch
  (:func:`mlx_spec.batch_caches.check_batchable`, :func:`mlx_spec.batch_mtp.check_head`); a
  model whose head does not batch (several layers) is served one request at a time through
  ``stream_generate``, which drafts with the head. A request with a seed or more draft tokens
  than the server's ``--num-draft-tokens`` is served one at a time.

:func:`unpatch_mlx_lm` undoes it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationResponse

from . import _mlx_lm, batch, batch_caches, batch_mtp, generation, mtp_convert, serving
from ._mlx_lm import lm
from .batch_length import BatchAdaptive
from .mtp import head_of
from .sampling import SamplerForm, make_sampler

__all__ = ["patch_mlx_lm", "unpatch_mlx_lm"]

Sampler = generation.Sampler

_LM_SAMPLER_SIGNATURE = inspect.signature(lm.make_sampler)
_LM_STREAM_SIGNATURE = inspect.signature(lm.stream_generate)
# mlx-lm's generate, as it was before any patch.
_lm_generate = importlib.import_module("mlx_lm.generate").generate
_LM_GENERATE_SIGNATURE = inspect.signature(_lm_generate)
# mlx-lm's batch_generate, as it was before any patch.
_lm_batch_generate = importlib.import_module("mlx_lm.generate").batch_generate
_LM_BATCH_SIGNATURE = inspect.signature(_lm_batch_generate)

_SAMPLER_MODULES = ("mlx_lm.sample_utils", "mlx_lm.generate", "mlx_lm.server")
_STREAM_MODULES = ("mlx_lm.generate", "mlx_lm", "mlx_lm.server")
_GENERATE_MODULES = ("mlx_lm.generate", "mlx_lm")
# BatchGenerator's options that mlx-spec's batches take as they are, and those they can ignore:
# how many prompts prefill together changes no token, and a batch of at most
# completion_batch_size prompts decodes together in mlx-lm too (more are refused).
_BATCH_OPTIONS = ("sampler", "prefill_step_size", "logits_processors", "completion_batch_size")
_BATCH_IGNORED = ("prefill_batch_size",)

# How the patched stream_generate drafts when it has no draft model: with the model's MTP head,
# by prompt lookup, or not at all (see _default_drafter).
_options = {"prompt_lookup": False, "mtp": False}


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

    def logits(self, logprobs: mx.array) -> mx.array:
        return self.distribution.logits(logprobs)

    def form(self, logprobs: mx.array) -> SamplerForm:
        return self.distribution.form(logprobs)

    def inputs(self, logprobs: mx.array) -> tuple[mx.array, ...]:
        return self.distribution.inputs(logprobs)

    def probs(self, logprobs: mx.array) -> mx.array:
        return self.distribution.probs(logprobs)


def _make_mlx_lm_sampler(*args: Any, **kwargs: Any) -> Sampler:
    """``mlx_lm.sample_utils.make_sampler`` while patched: its sampler, plus ``probs``."""
    sample = lm.make_sampler(*args, **kwargs)
    bound = _LM_SAMPLER_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    options = bound.arguments
    if options["temp"] == 0 or options["xtc_probability"] > 0.0:
        # Greedy is recognised as such; XTC has no distribution here (mlx-lm's rule applies).
        return sample
    try:
        distribution = make_sampler(
            **{
                name: options[name]
                for name in ("temp", "top_p", "min_p", "min_tokens_to_keep", "top_k")
            }
        )
    except ValueError:
        return sample
    return _MlxLmSampler(sample, distribution)


def _default_drafter(model: Any) -> str | None:
    """The drafter of a generation of ``model`` given neither a draft model nor a drafter, while
    patched: the model's MTP head with ``mtp=True`` where it has one, else prompt lookup with
    ``prompt_lookup=True``, else none (mlx-lm's own generation)."""
    if _options["mtp"] and head_of(model) is not None:
        return "mtp"
    return "prompt-lookup" if _options["prompt_lookup"] else None


def _serial(model: Any) -> bool:
    """Whether the patched server serves ``model``'s requests one at a time, each through
    :func:`_stream_generate`: where that drafts for it with its MTP head, and its batches cannot
    (a head of several layers, caches that do not batch)."""
    return _default_drafter(model) == "mtp" and _server_batches(model, None) is None


def _server_batches(model: Any, draft_model: Any) -> Callable[..., Any] | None:
    """The maker of the generator that batches the patched server's requests to ``model``
    speculatively (:class:`mlx_spec.serving.ServerBatchGenerator`): with its draft model, or
    without one with its MTP head (``mtp=True``) or ``prompt_lookup=True``; ``None`` where they
    do not speculate or do not batch (they are then served as mlx-lm serves them)."""
    drafter = None if draft_model is not None else _default_drafter(model)
    if draft_model is None and drafter is None:
        return None
    op = "mlx_lm.server (patched)"
    try:
        batch_caches.check_batchable(op, "model", model)
        if draft_model is not None:
            batch_caches.check_batchable(op, "draft_model", draft_model, draft=True)
        if drafter == "mtp":
            batch_mtp.check_head(op, model, drafter)
    except ValueError:
        return None
    # One draft-length policy per loaded model and --num-draft-tokens, kept by every generator
    # the server makes for it: the server makes a new one after each drain (a request that does
    # not batch, a seeded one), and the costs measured at each batch size still hold.
    policies: dict[int, BatchAdaptive] = {}

    def make(model: Any, *, num_draft_tokens: int = 3, **kwargs: Any) -> Any:
        policy = None
        if num_draft_tokens:
            policy = policies.setdefault(num_draft_tokens, BatchAdaptive(num_draft_tokens))
        return serving.ServerBatchGenerator(
            model,
            draft_model=draft_model,
            drafter=drafter,
            num_draft_tokens=num_draft_tokens,
            policy=policy,
            **kwargs,
        )

    return make


def _stream_generate(*args: Any, **kwargs: Any) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's ``stream_generate`` while patched (see the module's description)."""
    arguments = _LM_STREAM_SIGNATURE.bind(*args, **kwargs).arguments
    if arguments.get("draft_model") is None:
        default = _default_drafter(arguments["model"])
        if default is not None:
            kwargs.setdefault("drafter", default)
        if kwargs.get("drafter") is None:
            kwargs.pop("drafter", None)
            return lm.stream_generate(*args, **kwargs)
    if "cached_tokens" not in kwargs:
        # The server passes only what its prompt cache lacks: lookup copies the rest too.
        cached = _mlx_lm.server_cached_tokens(arguments.get("kwargs", {}).get("prompt_cache"))
        if cached:
            kwargs["cached_tokens"] = cached
    return generation.stream_generate(*args, **kwargs)


def _speculation_line(stats: generation.SpeculativeStats) -> str:
    """What a speculative generation did, as one line: ``Speculation: 12 rounds, 30/40 draft
    tokens accepted, 3.50 tokens per round`` (``nothing drafted`` when no round drafted)."""
    drafts = f"{stats.accepted}/{stats.drafted} draft tokens accepted" if stats.drafted else ""
    return (
        f"Speculation: {stats.rounds} rounds, {drafts or 'nothing drafted'}, "
        f"{stats.tokens_per_round:.2f} tokens per round"
    )


def _generate(*args: Any, **kwargs: Any) -> Any:
    """mlx-lm's ``generate`` while patched: its own, and with ``verbose`` and speculation a line
    of the speculation's counts after its output (see :func:`_speculation_line`)."""
    bound = _LM_GENERATE_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    options = bound.arguments.get("kwargs", {})
    speculates = options.get("draft_model") is not None or (
        options.get("drafter", _default_drafter(bound.arguments["model"])) is not None
    )  # as _stream_generate decides
    if bound.arguments["verbose"] is not True or not speculates:
        return _lm_generate(*args, **kwargs)
    stats = kwargs.setdefault("stats", generation.SpeculativeStats())
    text = _lm_generate(*args, **kwargs)
    print(_speculation_line(stats))
    return text


def _batch_generate(*args: Any, **kwargs: Any) -> Any:
    """mlx-lm's ``batch_generate`` while patched: it also takes ``draft_model`` and
    ``num_draft_tokens`` (mlx-spec's default: ``3``, adapted to the load).

    With a draft model, or without one with the model's MTP head (``mtp=True``) or
    ``prompt_lookup=True``, the prompts decode in mlx-spec's batches
    (:func:`mlx_spec.batch.batch_generate`). mlx-lm's own runs instead where
    the call needs what those do not take yet: ``prompt_caches``, ``max_kv_size``, a
    ``stream``, or a model whose caches do not batch (recurrent layers other than gated
    delta-nets, a draft model's sliding windows). Where
    a draft model was given, such a call raises instead, naming the option.
    """
    draft_model = kwargs.pop("draft_model", None)
    num_draft_tokens = kwargs.pop("num_draft_tokens", 3)
    bound = _LM_BATCH_SIGNATURE.bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    options = arguments.pop("kwargs", {})
    drafter = None if draft_model is not None else _default_drafter(arguments["model"])
    if draft_model is None and drafter is None:
        return _lm_batch_generate(*args, **kwargs)
    refused = [name for name in ("prompt_caches",) if arguments.get(name) is not None]
    refused += [
        name
        for name, value in options.items()
        if value is not None and name not in _BATCH_OPTIONS + _BATCH_IGNORED
    ]
    try:
        batch_caches.check_batchable("mlx_lm.batch_generate", "model", arguments["model"])
        if drafter == "mtp":
            batch_mtp.check_head("mlx_lm.batch_generate", arguments["model"], drafter)
    except ValueError:
        refused.append("model")
    if refused and draft_model is not None:
        raise ValueError(
            f"mlx_lm.batch_generate (patched): with `draft_model`, batched speculation does not "
            f"take {', '.join(f'`{name}`' for name in refused)} yet"
        )
    if refused:
        return _lm_batch_generate(*args, **kwargs)
    arguments.pop("prompt_caches", None)
    return batch.batch_generate(
        arguments.pop("model"),
        arguments.pop("tokenizer"),
        arguments.pop("prompts"),
        draft_model=draft_model,
        drafter=drafter,
        num_draft_tokens=num_draft_tokens,
        **arguments,
        **{name: options[name] for name in _BATCH_OPTIONS if name in options},
    )


def patch_mlx_lm(*, prompt_lookup: bool = False, mtp: bool = False) -> None:
    """Routes mlx-lm's speculative decoding through mlx-spec; idempotent (a later call sets the
    options anew).

    Args:
        prompt_lookup (bool): also make mlx-lm's single-sequence generation without a draft
            model (``stream_generate``, ``generate``, the ``mlx_lm.generate`` command) speculate
            by prompt lookup, with ``num_draft_tokens`` drafts a round, and
            ``mlx_lm.batch_generate`` and the server batch it (:func:`_batch_generate`,
            :mod:`mlx_spec.serving`). Default: ``False``.
        mtp (bool): also make mlx-lm's ``load``, the ``mlx_lm.generate`` command and the server
            load a model's MTP head where its folder has one (:func:`mlx_spec.mtp_convert.load`),
            and make mlx-lm's generation without a draft model (``stream_generate``,
            ``generate``, ``batch_generate``, the command, and the server's batches) draft with
            the head of a model that has one, with
            ``num_draft_tokens`` drafts a round. With ``prompt_lookup`` too, a model without a
            head drafts by prompt lookup. Default: ``False``.

    Raises:
        ValueError: ``prompt_lookup`` or ``mtp`` is not a bool.
    """
    for name, value in (("prompt_lookup", prompt_lookup), ("mtp", mtp)):
        if not isinstance(value, bool):
            raise ValueError(f"patch_mlx_lm: `{name}` must be a bool, got {value!r}")
    _options.update(prompt_lookup=prompt_lookup, mtp=mtp)
    # Imported first, so that the server's own names are replaced below.
    _mlx_lm.patch_server(serial=_serial, batches=_server_batches)
    if mtp:
        _mlx_lm.replace_load(mtp_convert.load)
    else:
        _mlx_lm.restore_everywhere({mtp_convert.load: lm.load}, ("load",))
    _mlx_lm.replace(
        ("mlx_lm.generate",),
        "speculative_generate_step",
        generation.speculative_generate_step,
        lm.speculative_generate_step,
    )
    _mlx_lm.replace(_STREAM_MODULES, "stream_generate", _stream_generate, lm.stream_generate)
    _mlx_lm.replace(_GENERATE_MODULES, "generate", _generate, _lm_generate)
    _mlx_lm.replace(_GENERATE_MODULES, "batch_generate", _batch_generate, _lm_batch_generate)
    _mlx_lm.replace(_SAMPLER_MODULES, "make_sampler", _make_mlx_lm_sampler, lm.make_sampler)


def unpatch_mlx_lm() -> None:
    """Restores what :func:`patch_mlx_lm` replaced, also in mlx-lm modules imported meanwhile
    (which took the patched functions); idempotent."""
    _options.update(prompt_lookup=False, mtp=False)
    _mlx_lm.unpatch_server()
    _mlx_lm.restore_everywhere(
        {
            _make_mlx_lm_sampler: lm.make_sampler,
            _stream_generate: lm.stream_generate,
            _generate: _lm_generate,
            _batch_generate: _lm_batch_generate,
            generation.speculative_generate_step: lm.speculative_generate_step,
            mtp_convert.load: lm.load,
        },
        (
            "make_sampler",
            "stream_generate",
            "generate",
            "batch_generate",
            "speculative_generate_step",
            "load",
        ),
    )
