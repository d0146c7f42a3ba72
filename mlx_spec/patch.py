"""``patch_mlx_lm``: mlx-lm's own generation, command and server through mlx-spec's loop.

:func:`patch_mlx_lm` replaces, in the loaded mlx-lm:

- ``mlx_lm.generate.speculative_generate_step`` by mlx-spec's. mlx-lm's ``stream_generate``
  looks it up when it gets a ``draft_model``, and its server calls that ``stream_generate``.
- ``stream_generate`` in ``mlx_lm.generate`` and ``mlx_lm`` by a function that runs mlx-spec's
  :func:`mlx_spec.generation.stream_generate` when there is a draft model (so ``max_kv_size``
  makes rotating caches there too) or, with ``prompt_lookup=True``, when there is none; and
  mlx-lm's own otherwise. ``generate`` and the ``mlx_lm.generate`` command go through it.
- ``make_sampler`` in ``mlx_lm.sample_utils``, ``mlx_lm.generate`` and, when imported,
  ``mlx_lm.server`` by a wrapper returning mlx-lm's own sampler (called exactly as before, so
  generation without speculation is unchanged) that also carries ``probs``, its distribution
  from :func:`mlx_spec.sampling.make_sampler`; drafts are then kept by rejection sampling.
  Greedy and XTC samplers are returned as they are (XTC keeps mlx-lm's rule, with a warning).

:func:`unpatch_mlx_lm` undoes it.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationResponse

from . import _mlx_lm, generation
from ._mlx_lm import lm
from .sampling import make_sampler

__all__ = ["patch_mlx_lm", "unpatch_mlx_lm"]

Sampler = generation.Sampler

_LM_SAMPLER_SIGNATURE = inspect.signature(lm.make_sampler)
_LM_STREAM_SIGNATURE = inspect.signature(lm.stream_generate)

_SAMPLER_MODULES = ("mlx_lm.sample_utils", "mlx_lm.generate", "mlx_lm.server")
_STREAM_MODULES = ("mlx_lm.generate", "mlx_lm")

# Whether the patched stream_generate drafts by prompt lookup when it has no draft model.
_options = {"prompt_lookup": False}


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


def _stream_generate(*args: Any, **kwargs: Any) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's ``stream_generate`` while patched (see the module's description)."""
    if _LM_STREAM_SIGNATURE.bind(*args, **kwargs).arguments.get("draft_model") is None:
        if _options["prompt_lookup"]:
            kwargs.setdefault("drafter", "prompt-lookup")
        if kwargs.get("drafter") is None:
            kwargs.pop("drafter", None)
            return lm.stream_generate(*args, **kwargs)
    return generation.stream_generate(*args, **kwargs)


def patch_mlx_lm(*, prompt_lookup: bool = False) -> None:
    """Routes mlx-lm's speculative decoding through mlx-spec; idempotent.

    Args:
        prompt_lookup (bool): also make mlx-lm's single-sequence generation without a draft
            model (``stream_generate``, ``generate``, the ``mlx_lm.generate`` command) speculate
            by prompt lookup, with ``num_draft_tokens`` drafts a round. The server's batched
            generation is not changed. Default: ``False``.

    Raises:
        ValueError: ``prompt_lookup`` is not a bool.
    """
    if not isinstance(prompt_lookup, bool):
        raise ValueError(f"patch_mlx_lm: `prompt_lookup` must be a bool, got {prompt_lookup!r}")
    _options["prompt_lookup"] = prompt_lookup
    _mlx_lm.replace(
        ("mlx_lm.generate",),
        "speculative_generate_step",
        generation.speculative_generate_step,
        lm.speculative_generate_step,
    )
    _mlx_lm.replace(_STREAM_MODULES, "stream_generate", _stream_generate, lm.stream_generate)
    _mlx_lm.replace(_SAMPLER_MODULES, "make_sampler", _make_mlx_lm_sampler, lm.make_sampler)


def unpatch_mlx_lm() -> None:
    """Restores what :func:`patch_mlx_lm` replaced, also in mlx-lm modules imported meanwhile
    (which took the patched functions); idempotent."""
    _options["prompt_lookup"] = False
    _mlx_lm.restore_everywhere(
        {
            _make_mlx_lm_sampler: lm.make_sampler,
            _stream_generate: lm.stream_generate,
            generation.speculative_generate_step: lm.speculative_generate_step,
        },
        ("make_sampler", "stream_generate", "speculative_generate_step"),
    )
