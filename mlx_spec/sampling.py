"""Samplers whose distribution is exposed, equal to mlx-lm's samplers.

:func:`make_sampler` takes the arguments of ``mlx_lm.sample_utils.make_sampler`` and returns a
:class:`SpecSampler`: a drop-in mlx-lm sampler (log-probabilities in, tokens out) that also gives
the exact distribution it draws from, :meth:`SpecSampler.probs`, which rejection sampling needs.

Each filter (:func:`top_p_mask`, :func:`min_p_mask`, :func:`top_k_mask`) is a pure function from
``[..., V]`` float32, float16 or bfloat16 log-probabilities (``-inf`` marks an impossible token) to
a lazy ``[..., V]`` bool mask, True for the tokens it keeps, with a keyword-only ``stream`` that
says where to run. A ``logprobs`` without a last axis or of another dtype, a parameter outside the
range its filter gives, or a ``stream`` that is not a stream or device raises ``ValueError`` naming
the argument. Filters run on the temperature-1 log-probabilities in mlx-lm's order (top-p,
min-p, top-k), each on the output of the previous one with filtered tokens at ``-inf``; the
temperature scales what is left. Every step is the same float arithmetic as mlx-lm's, so the kept
set, including its ties, is identical, and so is the distribution, except on the rows where
mlx-lm's has none: at a very low temperature (float16, below about ``1e-4``) the scaled
log-probabilities overflow to ``-inf`` or NaN, and there the temperature scales the row in float32
instead. Nothing here reads values on the host: all of it is lazy.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from ._checks import StreamOrDevice, check_stream

__all__ = ["SamplerForm", "SpecSampler", "make_sampler", "min_p_mask", "top_k_mask", "top_p_mask"]

_FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

#: The least positive temperature: ``1 / temp`` must be a finite float32 (and bfloat16).
MIN_TEMP = 2.0**-126
#: The highest temperature :func:`make_sampler` takes: above it ``1 / temp`` is no normal float32,
#: and a filtered token's ``-inf`` times that 0 would be NaN.
MAX_TEMP = 2.0**126


def _check_logprobs(fn: str, logprobs: mx.array) -> None:
    if (
        not isinstance(logprobs, mx.array)
        or logprobs.ndim < 1
        or logprobs.size == 0
        or logprobs.dtype not in _FLOAT_DTYPES
    ):
        shape = getattr(logprobs, "shape", None)
        dtype = getattr(logprobs, "dtype", type(logprobs).__name__)
        raise ValueError(
            f"{fn}: logprobs must be a non-empty [..., V] float32, float16 or bfloat16 array, "
            f"got shape {shape} and dtype {dtype}"
        )


def _check_fraction(fn: str, name: str, value: float) -> None:
    if not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{fn}: {name} must be a float in [0, 1], got {value!r}")


def _check_count(fn: str, name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{fn}: {name} must be an integer >= {least}, got {value!r}")


def top_p_mask(logprobs: mx.array, top_p: float, *, stream: StreamOrDevice = None) -> mx.array:
    """Tokens kept by nucleus (top-p) filtering, as mlx-lm's ``apply_top_p`` keeps them.

    A token is kept when the probability mass of the tokens ranked strictly above it is below
    ``top_p`` times the total mass, that mass being summed in float32 from the most likely token
    down (mlx-lm's order, so its rounding too). Tokens equal to the least likely kept token are
    kept as well. ``top_p`` of 0 or 1 turns the filter off, as in mlx-lm.

    Args:
        logprobs (array): ``[..., V]`` log-probabilities.
        top_p (float): the kept mass, in ``[0, 1]``.
        stream (Stream, Device or DeviceType, optional): where to run. Default: the default
            stream.

    Returns:
        array: the ``[..., V]`` bool mask.
    """
    _check_logprobs("top_p_mask", logprobs)
    _check_fraction("top_p_mask", "top_p", top_p)
    stream = check_stream("top_p_mask", stream)
    if top_p in (0.0, 1.0):
        return mx.ones(logprobs.shape, dtype=mx.bool_, stream=stream)
    return _top_p_keep(logprobs, top_p, stream)


def _top_p_keep(logprobs: mx.array, top_p: float | mx.array, stream: StreamOrDevice) -> mx.array:
    """:func:`top_p_mask`'s mask for ``top_p`` strictly between 0 and 1: a float, or a ``[]``
    float32 array (an input of a compiled graph), unchecked."""
    # Most likely first; negation is exact in every float dtype.
    ranked = mx.negative(mx.sort(mx.negative(logprobs, stream=stream), axis=-1, stream=stream))
    probs = mx.exp(ranked.astype(mx.float32, stream=stream), stream=stream)
    above = mx.cumsum(probs, axis=-1, inclusive=False, stream=stream)
    total = above[..., -1:] + probs[..., -1:]
    kept = mx.sum(above < top_p * total, axis=-1, keepdims=True, stream=stream)
    # kept is 0 only for a row without mass (all -inf); it then keeps everything.
    last = mx.maximum(kept.astype(mx.int32, stream=stream) - 1, 0, stream=stream)
    threshold = mx.take_along_axis(ranked, last, axis=-1, stream=stream)
    return mx.greater_equal(logprobs, threshold, stream=stream)


def min_p_mask(
    logprobs: mx.array,
    min_p: float,
    min_tokens_to_keep: int = 1,
    *,
    stream: StreamOrDevice = None,
) -> mx.array:
    """Tokens kept by min-p filtering, as mlx-lm's ``apply_min_p`` keeps them.

    A token is kept when its log-probability is at least ``max + log(min_p)``, computed in the
    dtype of ``logprobs``; the ``min_tokens_to_keep`` most likely tokens are always kept (ties
    broken as mlx-lm breaks them, by ``mx.argpartition``). ``min_p`` of 0 keeps every token.

    Args:
        logprobs (array): ``[..., V]`` log-probabilities.
        min_p (float): the kept probability relative to the most likely token, in ``[0, 1]``.
        min_tokens_to_keep (int): at least 1; values above ``V`` keep every token. Default: 1.
        stream (Stream, Device or DeviceType, optional): where to run. Default: the default
            stream.

    Returns:
        array: the ``[..., V]`` bool mask.
    """
    _check_logprobs("min_p_mask", logprobs)
    _check_fraction("min_p_mask", "min_p", min_p)
    _check_count("min_p_mask", "min_tokens_to_keep", min_tokens_to_keep, 1)
    stream = check_stream("min_p_mask", stream)
    vocab = logprobs.shape[-1]
    if min_p == 0.0 or min_tokens_to_keep >= vocab:
        return mx.ones(logprobs.shape, dtype=mx.bool_, stream=stream)
    return _min_p_keep(logprobs, math.log(min_p), min_tokens_to_keep, stream)


def _min_p_keep(
    logprobs: mx.array,
    log_min_p: float | mx.array,
    min_tokens_to_keep: int,
    stream: StreamOrDevice,
) -> mx.array:
    """:func:`min_p_mask`'s mask for ``min_p`` above 0, given as ``log(min_p)``: a float, or a
    ``[]`` array of the dtype of ``logprobs`` (an input of a compiled graph), unchecked; and
    ``min_tokens_to_keep`` below ``V``."""
    vocab = logprobs.shape[-1]
    top = mx.max(logprobs, axis=-1, keepdims=True, stream=stream)
    keep = mx.greater_equal(logprobs, top + log_min_p, stream=stream)
    if min_tokens_to_keep > 1:
        first = vocab - min_tokens_to_keep
        best = mx.argpartition(logprobs, kth=first, axis=-1, stream=stream)[..., first:]
        keep = mx.put_along_axis(keep, best, mx.array(True), axis=-1, stream=stream)
    return keep


def top_k_mask(logprobs: mx.array, top_k: int, *, stream: StreamOrDevice = None) -> mx.array:
    """Tokens kept by top-k filtering, as mlx-lm's ``apply_top_k`` keeps them.

    Exactly ``top_k`` tokens are kept per row; ties at the k-th value are broken as mlx-lm breaks
    them (by ``mx.argpartition`` on the negated log-probabilities). ``top_k`` of 0, or of at
    least ``V``, keeps every token (mlx-lm raises for ``top_k >= V``).

    Args:
        logprobs (array): ``[..., V]`` log-probabilities.
        top_k (int): how many tokens to keep, >= 0.
        stream (Stream, Device or DeviceType, optional): where to run. Default: the default
            stream.

    Returns:
        array: the ``[..., V]`` bool mask.
    """
    _check_logprobs("top_k_mask", logprobs)
    _check_count("top_k_mask", "top_k", top_k, 0)
    stream = check_stream("top_k_mask", stream)
    keep = mx.ones(logprobs.shape, dtype=mx.bool_, stream=stream)
    if top_k == 0 or top_k >= logprobs.shape[-1]:
        return keep
    order = mx.argpartition(
        mx.negative(logprobs, stream=stream), kth=top_k - 1, axis=-1, stream=stream
    )
    return mx.put_along_axis(keep, order[..., top_k:], mx.array(False), axis=-1, stream=stream)


def _check_params(
    fn: str, temp: float, top_p: float, min_p: float, min_tokens_to_keep: int, top_k: int
) -> None:
    if not isinstance(temp, numbers.Real) or not (temp == 0 or MIN_TEMP <= temp <= MAX_TEMP):
        raise ValueError(
            f"{fn}: temp must be 0 or a float in [2**-126, 2**126] (1 / temp a normal float32), "
            f"got {temp!r}"
        )
    _check_fraction(fn, "top_p", top_p)
    _check_fraction(fn, "min_p", min_p)
    _check_count(fn, "min_tokens_to_keep", min_tokens_to_keep, 1)
    _check_count(fn, "top_k", top_k, 0)


@dataclass(frozen=True)
class SamplerForm:
    """The shape of a :class:`SpecSampler`'s graph on rows of one width and dtype: which filters
    run, the integers they take, and whether the temperature can overflow a row.

    Samplers that differ only in ``temp``, ``top_p`` or ``min_p`` have one form. A graph compiled
    from :meth:`logits` with those parameters as its inputs (:meth:`SpecSampler.inputs`) serves
    them all, where written into it as constants each value would compile kernels of its own.

    Attributes:
        top_p (bool): whether top-p filters (``top_p`` strictly between 0 and 1).
        min_p (bool): whether min-p filters (``min_p`` above 0 and ``min_tokens_to_keep`` below
            ``V``).
        min_tokens_to_keep (int): tokens min-p always keeps.
        top_k (int): tokens top-k keeps; 0 is off.
        overflows (bool): whether the scaled log-probability of a row's most likely token can
            overflow the dtype (then such rows are scaled in float32, see
            :meth:`SpecSampler.probs`).
    """

    top_p: bool
    min_p: bool
    min_tokens_to_keep: int
    top_k: int
    overflows: bool

    def logits(
        self,
        logprobs: mx.array,
        scale: float | mx.array,
        top_p: float | mx.array,
        log_min_p: float | mx.array,
        scale32: float | mx.array,
    ) -> mx.array:
        """:meth:`SpecSampler.logits` of the sampler with these parameters, each a float or the
        ``[]`` array :meth:`SpecSampler.inputs` makes.

        Args:
            logprobs (array): ``[..., V]`` float32, float16 or bfloat16 log-probabilities, of the
                width and dtype this form was made for.
            scale (float or array): ``1 / temp``, in the dtype of ``logprobs``.
            top_p (float or array): top-p's mass, float32.
            log_min_p (float or array): ``log(min_p)``, in the dtype of ``logprobs``.
            scale32 (float or array): ``1 / temp`` in float32, for the rows that overflow.

        Returns:
            array: the lazy ``[..., V]`` scores.
        """
        minus_inf = mx.array(-math.inf, dtype=logprobs.dtype)
        if self.top_p:
            logprobs = mx.where(_top_p_keep(logprobs, top_p, None), logprobs, minus_inf)
        if self.min_p:
            keep = _min_p_keep(logprobs, log_min_p, self.min_tokens_to_keep, None)
            logprobs = mx.where(keep, logprobs, minus_inf)
        if self.top_k > 0:
            logprobs = mx.where(top_k_mask(logprobs, self.top_k), logprobs, minus_inf)
        # mlx-lm multiplies by the reciprocal, rounded to the logprobs dtype; so do we.
        scaled = logprobs * scale
        if not self.overflows:
            return scaled
        # Such rows are scaled in float32 after subtracting their maximum, which keeps the most
        # likely token finite (0); the rows where mlx-lm's are finite stay mlx-lm's.
        top = mx.max(logprobs, axis=-1, keepdims=True).astype(mx.float32)
        shifted = (logprobs.astype(mx.float32) - top) * scale32
        return mx.where(mx.isfinite(mx.max(scaled, axis=-1, keepdims=True)), scaled, shifted)


def _log_min_p(min_p: float) -> float:
    return math.log(min_p) if min_p > 0 else 0.0


@lru_cache(maxsize=64)
def _form(sampler: SpecSampler, vocab: int, dtype: mx.Dtype) -> SamplerForm:
    top_p = 0.0 < sampler.top_p < 1.0
    min_p = sampler.min_p != 0.0 and sampler.min_tokens_to_keep < vocab
    top_k = sampler.top_k if sampler.top_k < vocab else 0
    # The most likely token's log-probability is at least -log(V) (a little less after
    # rounding): only past this bound can its scaled value overflow the dtype (float16 below
    # temp ~1e-4), making mlx-lm's whole row -inf or NaN, no distribution.
    overflows = not (1.0 / sampler.temp) * (math.log(vocab) + 1) < mx.finfo(dtype).max
    return SamplerForm(top_p, min_p, sampler.min_tokens_to_keep, top_k, overflows)


@lru_cache(maxsize=64)
def _inputs(sampler: SpecSampler, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    scale = 1.0 / sampler.temp
    return (
        mx.array(scale, dtype=dtype),
        mx.array(sampler.top_p, dtype=mx.float32),
        mx.array(_log_min_p(sampler.min_p), dtype=dtype),
        mx.array(scale, dtype=mx.float32),
    )


@dataclass(frozen=True)
class SpecSampler:
    """An mlx-lm sampler that also gives the distribution it draws from.

    Build it with :func:`make_sampler`. Arguments have the meaning of
    ``mlx_lm.sample_utils.make_sampler``'s; ``temp`` 0 is greedy and then ignores the filters, as
    mlx-lm does.

    Attributes:
        temp (float): temperature, 0 or in ``[MIN_TEMP, inf)``.
        top_p (float): nucleus mass in ``[0, 1]``; 0 or 1 is off.
        min_p (float): min-p in ``[0, 1]``; 0 is off.
        min_tokens_to_keep (int): tokens min-p always keeps, >= 1.
        top_k (int): tokens top-k keeps, >= 0; 0 is off.
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0

    def __post_init__(self) -> None:
        _check_params(
            "SpecSampler", self.temp, self.top_p, self.min_p, self.min_tokens_to_keep, self.top_k
        )

    @property
    def greedy(self) -> bool:
        """bool: True iff ``temp`` is 0 (the sampler takes the argmax)."""
        return self.temp == 0

    def logits(self, logprobs: mx.array) -> mx.array:
        """The scores this sampler draws a categorical from: the filtered, temperature-scaled
        log-probabilities, in the dtype of ``logprobs`` as mlx-lm computes them (float32 where
        those overflow, see :meth:`probs`).

        Args:
            logprobs (array): ``[..., V]`` float32, float16 or bfloat16 log-probabilities.

        Returns:
            array: lazy ``[..., V]``: ``mx.random.categorical`` of it draws as mlx-lm's sampler
            with the same arguments draws.
        """
        _check_logprobs("SpecSampler.logits", logprobs)
        return self._logits(logprobs)

    def _logits(self, logprobs: mx.array) -> mx.array:
        """:meth:`logits` of checked ``logprobs``, its values written into the graph as floats."""
        scale = 1.0 / self.temp
        return self.form(logprobs).logits(
            logprobs, scale, self.top_p, _log_min_p(self.min_p), scale
        )

    def form(self, logprobs: mx.array) -> SamplerForm:
        """What the graph of :meth:`logits` on rows like ``logprobs`` is made of, apart from the
        float parameters: see :class:`SamplerForm`. Not for a greedy sampler."""
        return _form(self, logprobs.shape[-1], logprobs.dtype)

    def inputs(self, logprobs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The float parameters that :meth:`SamplerForm.logits` takes, as ``[]`` arrays rounded
        as mlx-lm's arithmetic on rows like ``logprobs`` rounds them: ``1 / temp`` in their dtype,
        ``top_p`` in float32, ``log(min_p)`` in their dtype (0 where min-p is off) and
        ``1 / temp`` in float32. Made once per dtype. Not for a greedy sampler."""
        return _inputs(self, logprobs.dtype)

    def __call__(self, logprobs: mx.array) -> mx.array:
        """Draw one token per row, as mlx-lm's sampler with the same arguments does.

        Randomness comes from ``mx.random``'s global state (so ``mx.random.seed`` applies).

        Args:
            logprobs (array): ``[..., V]`` float32, float16 or bfloat16 log-probabilities.

        Returns:
            array: lazy ``[...]`` uint32 token ids, drawn from :meth:`probs`.

        Raises:
            ValueError: ``logprobs`` has no last axis or a non-float dtype.
        """
        _check_logprobs("SpecSampler.__call__", logprobs)
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self._logits(logprobs))

    def probs(self, logprobs: mx.array) -> mx.array:
        """The distribution :meth:`__call__` draws from.

        Args:
            logprobs (array): ``[..., V]`` float32, float16 or bfloat16 log-probabilities.

        Returns:
            array: lazy ``[..., V]`` float32; rows sum to 1, filtered-out tokens are exactly 0.
            Greedy: the one-hot of the argmax (first index among ties). A row without any finite
            log-probability gives NaN. Equal to the distribution of mlx-lm's sampler on every
            row where that is defined. At a temperature so low that the scaled log-probability
            of a row's most likely token overflows the dtype (float16, below about ``1e-4``),
            mlx-lm's row is ``-inf`` or NaN; there the temperature scales the row in float32,
            after subtracting its maximum.

        Raises:
            ValueError: ``logprobs`` has no last axis or a non-float dtype.
        """
        _check_logprobs("SpecSampler.probs", logprobs)
        if self.greedy:
            best = mx.argmax(logprobs, axis=-1, keepdims=True)
            return (mx.arange(logprobs.shape[-1]) == best).astype(mx.float32)
        # mx.random.categorical adds float32 Gumbel noise, so it draws from this softmax.
        return mx.softmax(self._logits(logprobs).astype(mx.float32), axis=-1)


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
) -> SpecSampler:
    """Make a sampler that mlx-lm can use and that exposes its distribution.

    The arguments mean what they mean for ``mlx_lm.sample_utils.make_sampler``: top-p, min-p and
    top-k filter the temperature-1 log-probabilities in that order, then the temperature scales
    them; ``temp`` 0 is greedy.

    Args:
        temp (float): temperature, 0 or finite and at least :data:`MIN_TEMP` (``2**-126``).
            Default: 0 (greedy).
        top_p (float): nucleus mass in ``[0, 1]``; 0 or 1 is off. Default: 0.
        min_p (float): min-p in ``[0, 1]``; 0 is off. Default: 0.
        min_tokens_to_keep (int): tokens min-p always keeps, >= 1. Default: 1.
        top_k (int): tokens top-k keeps, >= 0; 0, or at least ``V``, is off. Default: 0.

    Returns:
        SpecSampler: ``sampler(logprobs)`` draws ``[...]`` uint32 tokens from ``[..., V]``
        log-probabilities; ``sampler.probs(logprobs)`` is their ``[..., V]`` float32
        distribution; ``sampler.greedy`` tells whether it takes the argmax.

    Raises:
        ValueError: an argument is out of range; the message names it.
    """
    _check_params("make_sampler", temp, top_p, min_p, min_tokens_to_keep, top_k)
    return SpecSampler(temp, top_p, min_p, min_tokens_to_keep, top_k)
