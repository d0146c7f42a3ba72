"""Acceptance of a speculative draft, as one lazy MLX graph per verification step.

A drafter proposes ``N`` tokens; the target scores the ``N + 1`` positions in one forward pass. The
functions here decide how many draft tokens to keep and which token comes next, and return one lazy
``[3]`` uint32 array ``[accepted, next, eos_hit]``:

- ``accepted``: the longest accepted prefix of the draft, cut right after the first accepted
  end-of-sequence token;
- ``next``: the token after the accepted prefix (the target's own choice at that position);
- ``eos_hit``: 1 if an accepted draft token or ``next`` is an end-of-sequence id.

Nothing here reads the device: :func:`read` evaluates the result, one small host read per step.

Both ops take two keywords: ``stream``, where to run, and ``fused``, which makes the same decisions
in the CUDA kernels of :mod:`mlx_spec.kernels` instead of the composition of MLX ops. The kernels
run where :func:`mlx_spec.kernels.available` holds for the stream, and not under ``mx.vmap`` (MLX
cannot vmap custom kernels). An argument of the wrong rank, dtype, shape, length or type, a
``stream`` this MLX cannot run on, or ``fused=True`` where the kernels cannot run raises
``ValueError`` before any work, naming the op and the argument.
"""

# Past 400 lines, as one module on purpose: greedy and sampled acceptance share the result's
# layout, the EOS cut, the invalid-row flag, the small graph helpers and the compiled or fused
# dispatch, and read() is their one reader. The two-level draw of `next` (_draw_residual) is the
# only part that could stand alone, and it needs the same helpers: a module of its own would
# spread one idea over three.

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, wraps
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import kernels
from ._checks import (
    INVALID_ROW,
    MASS_TOLERANCE,
    StreamOrDevice,
    check_draft_probs,
    check_eos,
    check_flag,
    check_ids,
    check_key,
    check_rows,
    check_stream,
    describe,
    device_type,
)

Verdict = tuple[int, int, bool]


@contextmanager
def _on(stream: StreamOrDevice) -> Iterator[None]:
    if stream is None:
        yield
    else:
        with mx.stream(stream):
            yield


def _compile_per_thread(fun: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``mx.compile(fun)``, compiled once in each thread that calls it.

    MLX keeps a compile cache per thread. One that still holds entries when its thread ends is
    freed by the thread's C++ exit handlers, which take the GIL: if the main thread is finalizing
    the interpreter by then, the process aborts ("terminate called without an active
    exception"). ``mlx_lm.server`` generates in such a thread. A compiled function erases its
    entries when it is freed, so each thread's copy lives in a ``threading.local``, freed with
    the thread's Python state before those handlers run.
    """
    local = threading.local()

    @wraps(fun)
    def compiled(*args: mx.array | None) -> mx.array:
        here = getattr(local, "fun", None)
        if here is None:
            here = local.fun = mx.compile(fun)
        return here(*args)

    return compiled


def _use_fused(op: str, fused: bool, stream: StreamOrDevice, vocab: int | None = None) -> bool:
    """Checks that ``op`` can run the fused kernel when asked to (on ``stream``, and for rows of
    ``vocab`` tokens where the kernel has a limit); returns ``fused``."""
    if not fused:
        return False
    if not kernels.available(stream):
        where = stream if stream is not None else mx.default_device()
        raise ValueError(
            f"{op}: `fused=True` needs MLX's CUDA backend and a GPU stream, got {where} "
            f"(CUDA available: {mx.cuda.is_available()})"
        )
    if vocab is not None and vocab > kernels.MAX_VOCAB:
        raise ValueError(
            f"{op}: `fused=True` takes V <= {kernels.MAX_VOCAB}, got V = {vocab}; "
            "use the composition (fused=False)"
        )
    return True


# Boolean `&` and `|` are avoided: under mx.vmap, MLX 0.32's bitwise ops mix up a batched and an
# unbatched operand (mx.vmap(lambda x: x & m)(X) is wrong); logical_and and logical_or are right.


def _is_eos(tokens: mx.array, eos: mx.array) -> mx.array:
    """``[...]`` bool: whether each of ``tokens`` (``[...]`` uint32) is one of ``eos`` (``[E]``)."""
    return (tokens[..., None] == _uint32(eos)).any(axis=-1)


def _iota(n: int, offset: int = 0) -> mx.array:
    """``[n]`` uint32 ``offset, offset + 1, ...`` as a constant: ``mx.arange`` would be a kernel."""
    return mx.array(np.arange(offset, offset + n, dtype=np.uint32))


class _Sizes(NamedTuple):
    """The sizes a sampled decision computes with, as ``[]`` uint32 arrays: inputs of its
    compiled graph, where Python ints would be literals in the source of its fused kernels and
    each ``V`` and ``N`` would compile kernels of its own (a ``g++`` run each on MLX's CPU
    backend, a JIT compile on Metal and CUDA)."""

    last_id: mx.array  # V - 1
    last_draft: mx.array  # N - 1 (0 when N = 0)
    blocks: mx.array  # the two-level draw's blocks (_block_count)
    depth: mx.array  # tokens per block, ceil(V / blocks)


@cache
def _sizes(v: int, n: int) -> _Sizes:
    """The :class:`_Sizes` of ``V = v`` and ``N = n`` (made once: a generation meets few)."""
    blocks = _block_count(v)
    values = (v - 1, max(n - 1, 0), blocks, -(-v // blocks))
    return _Sizes(*(mx.array(x, dtype=mx.uint32) for x in values))


def _uint32(ids: mx.array) -> mx.array:
    return ids if ids.dtype == mx.uint32 else ids.astype(mx.uint32)


def _float32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _leading(flags: mx.array) -> mx.array:
    """``[]`` uint32: how many of ``flags`` (``[n]`` bool) are true before the first false (``n``
    when none is). A scan rather than the least index of a false: ``n`` as a default would be a
    constant of the graph, and each ``N`` would compile kernels of its own."""
    return mx.cumprod(flags.astype(mx.uint32)).sum()


def _accepted(ok: mx.array, draft: mx.array, eos: mx.array | None) -> tuple[mx.array, mx.array]:
    """The accepted count and whether it ends on an EOS.

    Args:
        ok (array): ``[N]`` bool, whether each draft token passes its own test.
        draft (array): ``[N]`` uint32 draft tokens.
        eos (array, optional): ``[E]`` end-of-sequence ids, ``E >= 1``.

    Returns:
        tuple[array, array]: ``[]`` uint32, the longest prefix of passing tokens cut right after
        its first EOS; ``[]`` bool, whether that prefix holds an EOS.
    """
    n = draft.shape[0]
    if n == 0:
        return mx.array(0, mx.uint32), mx.array(False)
    accepted = _leading(ok)
    if eos is None:
        return accepted, mx.array(False)
    first_eos = _leading(~_is_eos(draft, eos))
    accepted = mx.minimum(accepted, first_eos + 1)
    return accepted, first_eos < accepted


def _result(
    accepted: mx.array, eos_in_draft: mx.array, token: mx.array, eos: mx.array | None
) -> mx.array:
    """``[3]`` uint32 ``[accepted, next, eos_hit]``, assembled without a concatenation."""
    eos_hit = eos_in_draft if eos is None else mx.logical_or(eos_in_draft, _is_eos(token, eos))
    which = _iota(3)
    return mx.where(which == 0, accepted, mx.where(which == 1, token, eos_hit.astype(mx.uint32)))


def accept_greedy(
    logits: mx.array,
    draft: mx.array,
    eos: mx.array | None = None,
    *,
    fused: bool = False,
    stream: StreamOrDevice = None,
) -> mx.array:
    """Greedy acceptance of a draft from one verification step.

    Draft token ``i`` is kept while it equals the argmax of row ``i`` (the first maximal index on
    ties); ``next`` is the argmax of row ``accepted``. The emitted tokens are exactly the target's
    greedy decoding.

    A row decides only when its maximum is finite: a row with a NaN, a ``+inf`` (an overflow,
    which loses which token is largest) or only ``-inf`` rejects its draft token and, if it is
    row ``accepted``, is reported through :data:`INVALID_ROW`. The check reads only the one
    value per row that the argmax picks.

    Args:
        logits (array): ``[N + 1, V]`` float32, float16 or bfloat16 target logits (or any scores
            with the same argmax), any strides: ``out[0, -(N + 1):]`` of a ``[1, L, V]`` output,
            a transposed view or a strided slice.
        draft (array): ``[N]`` uint32 or int32 draft tokens, ``N >= 0``. An id outside
            ``[0, V)`` is rejected.
        eos (array, optional): ``[E]`` uint32 or int32 end-of-sequence ids; ``None`` or empty
            for none. Default: ``None``.
        fused (bool, optional): decide in two fused kernel launches (compiled once per shape),
            with the same result. Default: ``False``.
        stream (Stream, Device or DeviceType, optional): where to run. Default: the default
            stream.

    Returns:
        array: the lazy ``[3]`` result; :func:`read` raises if row ``accepted`` has no finite
        maximum.
    """
    op = "accept_greedy"
    n, _ = check_rows(op, "logits", logits)
    draft = check_ids(op, "draft", draft, n)
    eos = check_eos(op, eos)
    fused = check_flag(op, "fused", fused)
    stream = check_stream(op, stream)
    with _on(stream):
        fused = _use_fused(op, fused, stream)
        on_cpu = device_type(stream) == mx.DeviceType.cpu
        return greedy_decision(logits, draft, eos, fused=fused, on_cpu=on_cpu)


def greedy_decision(
    logits: mx.array, draft: mx.array, eos: mx.array | None, *, fused: bool, on_cpu: bool
) -> mx.array:
    """:func:`accept_greedy` on the default stream, without checking its arguments: for a caller
    whose arguments are right by construction and that decides every step (the generation loop),
    where the checks would cost more host time than building the graph.

    Args:
        logits (array): ``[N + 1, V]`` float target logits.
        draft (array): ``[N]`` uint32 or int32 draft tokens.
        eos (array, optional): ``[E]`` end-of-sequence ids, ``E >= 1``; ``None`` for none.
        fused (bool): decide with the fused kernels (MLX's CUDA backend only).
        on_cpu (bool): whether the default stream is on a CPU.

    Returns:
        array: the lazy ``[3]`` uint32 result of :func:`accept_greedy`.
    """
    if fused:
        return _fused_greedy_graph(
            logits,
            draft if draft.shape[0] else kernels.no_id(),
            kernels.no_id() if eos is None else eos,
        )
    return _greedy_graph(on_cpu)(logits, draft, eos)


@_compile_per_thread
def _fused_greedy_graph(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
    """The two greedy launches, compiled: a call replays the graph traced for its shapes instead
    of building both launches again on the host."""
    return kernels.greedy(logits, draft, eos)


def _argmax_rows(logits: mx.array, on_cpu: bool) -> tuple[mx.array, mx.array]:
    """Each row's argmax (``[n]`` uint32) and whether the row fails to decide (``[n]`` bool).

    A row decides only when its maximum is finite: argmax returns the index of a NaN when the
    row has one, and a maximum of +inf (an overflow: which of the overflowed tokens is largest is
    lost) or of -inf (no token allowed) picks a token that means nothing. One gather per row
    finds them.
    """
    # MLX's CPU backend reduces half precision slower than it casts and reduces float32; the
    # cast is exact, so the argmax is unchanged.
    rows = logits.astype(mx.float32) if on_cpu else logits
    choice = mx.argmax(rows, axis=-1)
    invalid = ~mx.isfinite(mx.take_along_axis(rows, choice[:, None], axis=-1)[:, 0])
    return choice, invalid


def _matching(
    choice: mx.array, invalid: mx.array, draft: mx.array, eos: mx.array | None
) -> mx.array:
    """The ``[3]`` result of keeping draft tokens while they equal the target's own ``choice``
    (``[N + 1]`` uint32) at rows that decide (``invalid``: ``[N + 1]`` bool, rows that do not)."""
    n = draft.shape[0]
    draft = _uint32(draft)
    ok = mx.logical_and(draft == choice[:n], ~invalid[:n])
    # `next` for every accepted count: the choice, or the position of an invalid row, flagged.
    flagged = _iota(n + 1, INVALID_ROW)
    candidates = mx.where(invalid, flagged, _uint32(choice))
    accepted, eos_in_draft = _accepted(ok, draft, eos)
    return _result(accepted, eos_in_draft, mx.take(candidates, accepted), eos)


@cache
def _greedy_graph(on_cpu: bool) -> Callable[..., mx.array]:
    """The compiled greedy graph for one backend (compiled once per thread, traced once per
    shape)."""

    def greedy(logits: mx.array, draft: mx.array, eos: mx.array | None) -> mx.array:
        choice, invalid = _argmax_rows(logits, on_cpu)
        return _matching(choice, invalid, draft, eos)

    return _compile_per_thread(greedy)


_matching_graph = _compile_per_thread(_matching)


def matching_decision(
    choice: mx.array, invalid: mx.array, draft: mx.array, eos: mx.array | None
) -> mx.array:
    """The decision of a round whose target tokens were drawn already: draft tokens are kept
    while they equal the target's token at their position, and ``next`` is the target's token
    after them. Coupled sampling decides so (the target's token at each position drawn with that
    position's randomness, see :mod:`mlx_spec.rules`); greedy acceptance is this with each row's
    argmax. Unchecked (see :func:`greedy_decision`).

    Args:
        choice (array): ``[N + 1]`` uint32 or int32: the target's token at each position.
        invalid (array): ``[N + 1]`` bool: rows that cannot decide (reported through
            :data:`INVALID_ROW` when one decides).
        draft (array): ``[N]`` uint32 or int32 draft tokens.
        eos (array, optional): ``[E]`` end-of-sequence ids, ``E >= 1``; ``None`` for none.

    Returns:
        array: the lazy ``[3]`` uint32 ``[accepted, next, eos_hit]``.
    """
    return _matching_graph(choice, invalid, draft, eos)


@cache
def _greedy_token_graph(on_cpu: bool) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    def token(logits: mx.array) -> tuple[mx.array, mx.array]:
        choice, invalid = _argmax_rows(logits, on_cpu)
        return mx.where(invalid, INVALID_ROW, choice), choice

    return _compile_per_thread(token)


def greedy_token(logits: mx.array, *, on_cpu: bool) -> tuple[mx.array, mx.array]:
    """The token of a plain greedy step, which has no draft to decide: the ``next`` of
    :func:`accept_greedy` at ``N = 0`` in fewer operations, unchecked (see
    :func:`greedy_decision`).

    Args:
        logits (array): ``[1, V]`` float target logits.
        on_cpu (bool): whether the default stream is on a CPU.

    Returns:
        tuple[array, array]: the lazy ``[1]`` uint32 token, :data:`INVALID_ROW` where the row
        has no finite maximum; and the ``[1]`` uint32 argmax, an id to feed the model in either
        case.
    """
    return _greedy_token_graph(on_cpu)(logits)


def _block_count(v: int) -> int:
    """A number of blocks near ``sqrt(V)`` for the two-level draw, dividing ``V`` if it can
    (``ms_block_count`` in :mod:`mlx_spec.kernels` computes the same)."""
    root = max(1, math.isqrt(v))
    for blocks in range(root, max(root // 4, 1) - 1, -1):
        if v % blocks == 0:
            return blocks
    return root


def _table(x: mx.array, blocks: int) -> mx.array:
    """``[V]`` as ``[ceil(V / blocks), blocks]``, zero-padded: block ``b`` is column ``b``.

    Any fixed order of the tokens gives an exact inverse-CDF draw, and strided blocks make the
    block sums a reduction over the leading axis, which MLX's CPU backend runs faster than one
    over the last axis.
    """
    v = x.shape[0]
    depth = -(-v // blocks)
    if depth * blocks != v:
        x = mx.pad(x, [(0, depth * blocks - v)])
    return x.reshape(depth, blocks)


def _in_unit(x: mx.array) -> mx.array:
    """``[...]`` bool: whether each of ``x`` is in ``[0, 1]`` (false for NaN)."""
    return mx.logical_and(x >= 0, x <= 1)


def _residual(p: mx.array, q: mx.array, rejected: mx.array) -> mx.array:
    """``max(p - q, 0)`` (NaN kept), or ``p`` when not ``rejected``; NaN where a subtracted
    ``q`` entry is outside ``[0, 1]``, so a draft row that is not a distribution poisons the
    residual's sums."""
    q = mx.where(rejected, _float32(q), 0.0)
    # Nested selects rather than logical_and: MLX's compiled CPU kernels are slow on boolean
    # intermediates over a whole row.
    return mx.where(q >= 0, mx.where(q <= 1, mx.maximum(p - q, 0.0), mx.nan), mx.nan)


def _draw_residual(
    p_row: mx.array,
    q_row: mx.array | None,
    rejected: mx.array | None,
    removed: mx.array | None,
    u: mx.array,
    sizes: _Sizes,
) -> tuple[mx.array, mx.array]:
    """Draws an index from ``norm(max(p - q, 0))``, or from ``p`` when that has no mass, and
    checks the row drawn from.

    A two-level inverse CDF: block sums locate the block, a scan of that block locates the
    index, so one uniform is drawn and no scan runs over the whole vocabulary. For a point-mass
    ``q`` the residual is ``p`` without the ``removed`` token, so it costs one pass, not three.

    The checks use the block sums the draw computes anyway: ``p``'s total must be within
    :data:`MASS_TOLERANCE` of 1, and a negative, NaN or infinite entry of ``p`` makes that total
    NaN or infinite; a subtracted ``q`` entry outside ``[0, 1]`` makes the residual's total NaN.

    Args:
        p_row (array): ``[V]`` float32 target distribution.
        q_row (array, optional): ``[V]`` draft distribution to subtract when ``rejected``.
        rejected (array, optional): ``[]`` bool, whether ``q_row`` is subtracted (not after a
            full accept), chosen inside the fused residual rather than in a pass of its own.
        removed (array, optional): ``[]`` uint32 token whose mass is removed instead (no token
            when ``>= V``).
        u (array): ``[]`` float32 uniform in ``[0, 1)``.
        sizes (_Sizes): the sizes of ``V``.

    Returns:
        tuple[array, array]: ``[]`` uint32 index in ``[0, V)``; ``[]`` bool, true when the row
        is invalid (then the index means nothing).
    """
    v = p_row.shape[0]
    blocks = _block_count(v)
    # A negative entry becomes NaN: it poisons its block's sum, and so p's total.
    p = _table(mx.where(p_row < 0, mx.nan, p_row), blocks)
    depth = p.shape[0]
    p_sums = p.sum(axis=0)
    q = None if q_row is None else _table(q_row, blocks)

    def residual_block(b: mx.array) -> mx.array:
        block = mx.take(p, b, axis=1)
        if q is not None:
            return _residual(block, mx.take(q, b, axis=1), rejected)
        if removed is not None:
            row, column = removed // sizes.blocks, removed % sizes.blocks
            hit = mx.logical_and(_iota(depth) == row, b == column)
            return mx.where(hit, 0.0, block)
        return block

    if q is not None:
        r_sums = _residual(p, q, rejected).sum(axis=0)
    elif removed is not None:
        # Only the removed token's block changes: sum it again without that token.
        own = removed % sizes.blocks
        r_sums = mx.where(_iota(blocks) == own, residual_block(own).sum(), p_sums)
    else:
        r_sums = p_sums
    r_total = r_sums.sum()
    use_p = ~(r_total > 0)
    cum = mx.cumsum(mx.where(use_p, p_sums, r_sums))
    total = cum[-1]
    # Strictly below the total, so the block found has mass.
    t = mx.minimum(u * total, total * (1 - 2.0**-23))
    b = mx.minimum((cum <= t).sum().astype(mx.uint32), sizes.blocks - 1)
    below = mx.where(b > 0, mx.take(cum, mx.maximum(b, 1) - 1), 0.0)
    scan = mx.cumsum(mx.where(use_p, mx.take(p, b, axis=1), residual_block(b)))
    j = (scan <= t - below).sum().astype(mx.uint32)
    # Block sums and scans round differently: when the scan ends at or below the target, take
    # the last index with mass, the first maximum of the scan.
    j = mx.where(j >= sizes.depth, mx.argmax(scan).astype(mx.uint32), j)
    index = mx.minimum(b + sizes.blocks * j, sizes.last_id)
    # A valid p has a positive, finite total, and so has the residual when it is drawn from.
    off = ~(mx.abs(p_sums.sum() - 1) <= MASS_TOLERANCE)
    return index, mx.logical_or(off, mx.isnan(r_total))


def accept_sampled(
    probs: mx.array,
    draft: mx.array,
    draft_probs: mx.array | None,
    eos: mx.array | None,
    key: mx.array,
    *,
    fused: bool = False,
    stream: StreamOrDevice = None,
) -> mx.array:
    """Lossless sampled acceptance (rejection sampling) of a draft from one verification step.

    Draft token ``d_i`` is accepted when ``u_i * q_i(d_i) < p_i(d_i)`` with ``u_i`` uniform in
    ``[0, 1)``, that is with probability ``min(1, p_i(d_i) / q_i(d_i))``. After the first rejection,
    at position ``a``, ``next`` is drawn from ``norm(max(p_a - q_a, 0))`` (from ``p_a`` when that
    has no mass); after a fully accepted draft, from ``p_N``. Every emitted token then has exactly
    the target's distribution (Leviathan et al. 2023; Chen et al. 2023).

    ``key`` draws ``N + 1`` uniforms, ``u = mx.random.uniform(shape=(N + 1,), key=key)``: ``u[:N]``
    for the ratio tests, ``u[N]`` for the draw of ``next``; the same key gives the same result.
    The drafter must sample its tokens with keys independent of ``key``: shared randomness biases
    the output towards the draft.

    The values the decision reads are checked where they are read, without a pass of their own:

    - ``p_i(d_i)`` and ``q_i(d_i)``, read by the ratio test of a draft token in the vocabulary,
      must be in ``[0, 1]``: otherwise (NaN, a log-probability, ...) the token is rejected;
    - the row ``next`` is drawn from, ``a = accepted``: ``p_a`` must hold no NaN and no negative
      entry and have a total within :data:`MASS_TOLERANCE` of 1 (an infinite entry fails it),
      and, after a rejection or an EOS cut, every entry of the subtracted ``q_a`` must be in
      ``[0, 1]``.

    When position ``a`` fails any of these, ``next`` is :data:`INVALID_ROW` plus ``a``. Not
    checked: the rows after ``a``, the rows before it except at their draft tokens, and the
    total of any ``draft_probs`` row.

    Args:
        probs (array): ``[N + 1, V]`` float32, float16 or bfloat16 target distributions (after
            temperature and filters; rows sum to 1 within :data:`MASS_TOLERANCE`), any strides.
        draft (array): ``[N]`` uint32 or int32 draft tokens, ``N >= 0``. An id outside
            ``[0, V)`` is rejected.
        draft_probs (array, optional): ``[N, V]`` float32, float16 or bfloat16 distributions the
            draft tokens were drawn from; ``None`` for deterministic drafts (a point mass on each
            draft token).
        eos (array, optional): ``[E]`` uint32 or int32 end-of-sequence ids; ``None`` or empty
            for none.
        key (array): ``[2]`` uint32 key from ``mx.random.key``.
        fused (bool, optional): decide in one fused kernel launch after the uniforms, with the
            same result up to the rounding of sums in the draw of ``next``; only for
            ``V <= 2**24``. Default: ``False``.
        stream (Stream, Device or DeviceType, optional): where to run. Default: the default
            stream.

    Returns:
        array: the lazy ``[3]`` result; :func:`read` raises if position ``accepted`` failed a
        check above.
    """
    op = "accept_sampled"
    n, v = check_rows(op, "probs", probs)
    draft = check_ids(op, "draft", draft, n)
    q = check_draft_probs(op, draft_probs, n, v)
    eos = check_eos(op, eos)
    key = check_key(op, key)
    fused = check_flag(op, "fused", fused)
    stream = check_stream(op, stream)
    with _on(stream):
        return sampled_decision(probs, draft, q, eos, key, fused=_use_fused(op, fused, stream, v))


def sampled_decision(
    probs: mx.array,
    draft: mx.array,
    draft_probs: mx.array | None,
    eos: mx.array | None,
    key: mx.array,
    *,
    fused: bool,
) -> mx.array:
    """:func:`accept_sampled` on the default stream, without checking its arguments (see
    :func:`greedy_decision`).

    Args:
        probs (array): ``[N + 1, V]`` float target distributions.
        draft (array): ``[N]`` uint32 or int32 draft tokens.
        draft_probs (array, optional): ``[N, V]`` float draft distributions; ``None`` for point
            masses.
        eos (array, optional): ``[E]`` end-of-sequence ids, ``E >= 1``; ``None`` for none.
        key (array): ``[2]`` uint32 key.
        fused (bool): decide with the fused kernel (MLX's CUDA backend, ``V <= 2**24`` only).

    Returns:
        array: the lazy ``[3]`` uint32 result of :func:`accept_sampled`.
    """
    if fused:
        return _fused_sampled_graph(probs, draft, draft_probs, eos, key)
    sizes = _sizes(probs.shape[1], draft.shape[0])
    return _sampled_graph(probs, draft, draft_probs, eos, key, sizes)


@_compile_per_thread
def _fused_sampled_graph(
    probs: mx.array, draft: mx.array, q: mx.array | None, eos: mx.array | None, key: mx.array
) -> mx.array:
    """The uniforms, then the fused kernel (compiled: the uniforms' element-wise ops fuse)."""
    n = draft.shape[0]
    return kernels.sampled(
        probs,
        probs if q is None or n == 0 else q,
        draft if n else kernels.no_id(),
        kernels.no_id() if eos is None else eos,
        mx.random.uniform(shape=(n + 1,), key=key),
        has_q=q is not None and n > 0,
    )


@_compile_per_thread
def _sampled_graph(
    probs: mx.array,
    draft: mx.array,
    q: mx.array | None,
    eos: mx.array | None,
    key: mx.array,
    sizes: _Sizes,
) -> mx.array:
    """The compiled sampled graph (traced once per shape and set of optional inputs)."""
    uniforms = mx.random.uniform(shape=(draft.shape[0] + 1,), key=key)
    return sampled_from_uniforms(probs, draft, q, eos, uniforms, sizes)


def sampled_from_uniforms(
    probs: mx.array,
    draft: mx.array,
    q: mx.array | None,
    eos: mx.array | None,
    uniforms: mx.array,
    sizes: _Sizes | None = None,
) -> mx.array:
    """The composition of :func:`accept_sampled` given its uniforms (``[N + 1]`` float32): the
    reference that the fused kernel is checked against. ``sizes`` are those of ``probs`` and
    ``draft`` (default: made here)."""
    n = draft.shape[0]
    sizes = _sizes(probs.shape[1], n) if sizes is None else sizes
    u = uniforms[:n]
    draft = _uint32(draft)
    safe = mx.minimum(draft, sizes.last_id)[:, None]
    p_draft = _float32(mx.take_along_axis(probs[:n], safe, axis=-1)[:, 0])
    # The values a ratio test reads at a draft token must be probabilities: a position that reads
    # one outside [0, 1] (NaN, a log-probability, ...) is not accepted, and is reported if it
    # decides. An id outside the vocabulary reads nothing and is rejected.
    in_vocab = draft <= sizes.last_id
    valid = _in_unit(p_draft)
    if q is None:
        ok = u < p_draft
    else:
        q_draft = _float32(mx.take_along_axis(q, safe, axis=-1)[:, 0])
        valid = mx.logical_and(valid, _in_unit(q_draft))
        ok = u * q_draft < p_draft
    ok = mx.logical_and(mx.logical_and(ok, valid), in_vocab)
    accepted, eos_in_draft = _accepted(ok, draft, eos)
    token, bad = _next_token(probs, q, draft, accepted, uniforms[n], sizes)
    if n:
        last = mx.minimum(accepted, sizes.last_draft)
        misread = mx.take(mx.logical_and(in_vocab, ~valid), last)
        bad = mx.logical_or(bad, mx.logical_and(accepted <= sizes.last_draft, misread))
    token = mx.where(bad, accepted + INVALID_ROW, token)
    return _result(accepted, eos_in_draft, token, eos)


def _next_token(
    probs: mx.array,
    q: mx.array | None,
    draft: mx.array,
    accepted: mx.array,
    u: mx.array,
    sizes: _Sizes,
) -> tuple[mx.array, mx.array]:
    """``next`` (``[]`` uint32) drawn with uniform ``u`` from the residual of row ``accepted``,
    and whether that row is invalid."""
    p_row = _float32(mx.take(probs, accepted, axis=0))
    if draft.shape[0] == 0:
        return _draw_residual(p_row, None, None, None, u, sizes)
    last = mx.minimum(accepted, sizes.last_draft)
    rejected = accepted <= sizes.last_draft
    if q is None:
        # A point mass on the draft token: the residual is p without that token.
        removed = mx.where(rejected, mx.take(draft, last), 0xFFFFFFFF)
        return _draw_residual(p_row, None, None, removed, u, sizes)
    # After a full accept the draw is from p_N: q is not subtracted.
    return _draw_residual(p_row, mx.take(q, last, axis=0), rejected, None, u, sizes)


def read(result: mx.array) -> Verdict | list:
    """Reads acceptance results with one host read.

    Args:
        result (array): ``[3]`` or ``[..., 3]`` uint32 from :func:`accept_greedy` or
            :func:`accept_sampled` (batched through ``mx.vmap``).

    Returns:
        ``(accepted, next, eos_hit)`` as ``(int, int, bool)`` for a ``[3]`` result; for
        ``[..., 3]``, a list of such tuples nested like the leading axes.

    Raises:
        ValueError: ``result`` is not ``[..., 3]`` uint32, or the row that decided a result was
            invalid (see :func:`accept_greedy` and :func:`accept_sampled`): the message names the
            position, and the batch index for a batched result.
    """
    if not isinstance(result, mx.array) or result.ndim < 1 or result.shape[-1] != 3:
        shown = describe(result) if isinstance(result, mx.array) else type(result).__name__
        raise ValueError(f"read: `result` must be [..., 3] uint32, got {shown}")
    if result.dtype != mx.uint32:
        raise ValueError(f"read: `result` must be [..., 3] uint32, got {describe(result)}")
    if result.ndim == 1:
        # One [3] result: tolist costs less host time than a NumPy copy (docs/performance.md).
        accepted, token, eos_hit = result.tolist()
        check_next("read", token)
        return accepted, token, bool(eos_hit)
    values = np.array(result)
    flagged = values[..., 1] >= INVALID_ROW
    if flagged.any():
        where = tuple(int(i) for i in np.unravel_index(np.argmax(flagged), flagged.shape))
        check_next("read", int(values[where][1]), where)
    return _verdicts(values)


def check_next(op: str, token: int, where: tuple[int, ...] = ()) -> None:
    """Raises if ``token``, the ``next`` of a result as read, carries :data:`INVALID_ROW`.

    Args:
        op (str): the function to name in the message.
        token (int): ``next`` of one result.
        where (tuple[int, ...], optional): the result's batch index. Default: none.

    Raises:
        ValueError: the row that decided the result was invalid; the message names ``op``, the
            row's position and ``where``.
    """
    if token < INVALID_ROW:
        return
    batch = f" (batch index {', '.join(map(str, where))})" if where else ""
    raise ValueError(
        f"{op}: the verification row at position {token - INVALID_ROW}{batch} decided the result "
        "but is invalid: logits with a NaN, a +inf or only -inf, or probabilities that are not a "
        "distribution (a NaN or negative entry, a total off 1, a value read outside [0, 1])"
    )


def _verdicts(values: np.ndarray) -> Verdict | list:
    if values.ndim == 1:
        return int(values[0]), int(values[1]), bool(values[2])
    return [_verdicts(v) for v in values]
