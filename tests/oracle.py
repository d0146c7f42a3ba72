"""A plain-loop NumPy oracle for speculative acceptance, written from the specification.

It follows the specification (``docs/design.md``, "Acceptance") position by position, in
float64, and takes the acceptance uniforms explicitly, so a test can feed it the uniforms that
:func:`mlx_spec.accept_sampled` derives from its key. It shares no code with ``mlx_spec``.

Semantics, for a draft ``d`` of ``N`` tokens and rows ``0..N``:

- draft token ``i`` is accepted when it is a vocabulary id (``0 <= d_i < V``) and, greedy, it is
  the first maximal index of row ``i``, a row with a finite maximum and no NaN; sampled,
  ``p_i(d_i)`` and ``q_i(d_i)`` are in ``[0, 1]`` and ``u_i * q_i(d_i) < p_i(d_i)``, with
  ``q_i(d_i) = 1`` for deterministic drafts;
- ``accepted`` is the longest accepted prefix, cut right after the first accepted EOS token;
- ``next``: greedy, the first maximal index of row ``accepted``; sampled, a draw from
  ``norm(max(p_a - q_a, 0))`` (``p_a`` itself when that has no mass) when ``a = accepted < N``
  (after a rejection or an EOS cut), or from ``p_N`` when the whole draft was accepted;
- ``next`` is ``INVALID_ROW + accepted`` instead when row ``accepted`` is invalid: greedy, its
  maximum is not finite or it holds a NaN; sampled, ``p_a`` holds a NaN or a negative entry or
  its total is more than ``MASS_TOLERANCE`` from 1, or (``a < N``) the draft row ``q_a``
  holds a value outside ``[0, 1]``, or ``p_a(d_a)`` or ``q_a(d_a)`` is outside ``[0, 1]``;
- ``eos_hit``: an accepted draft token or ``next`` is an EOS id (an accepted draft token only,
  when ``next`` is no token).
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

#: The bit ``next`` carries for an invalid deciding row, and the distance from 1 that a sampled
#: row's total may have (docs/design.md, "What is validated").
INVALID_ROW = 1 << 31
MASS_TOLERANCE = 2.0**-6


class SampledOutcome(NamedTuple):
    """What the sampled oracle decides for given acceptance uniforms.

    Attributes:
        accepted (int): the number of accepted draft tokens.
        row (np.ndarray or None): ``[V]`` float64, the normalised distribution ``next`` is drawn
            from; ``None`` when row ``accepted`` is invalid.
        next (int or None): ``next`` drawn from ``row`` by inverse CDF, when ``u_next`` was given;
            ``INVALID_ROW + accepted`` when the row is invalid.
        eos_hit (bool or None): the EOS flag for that ``next``, when ``u_next`` was given or the
            row is invalid.
    """

    accepted: int
    row: np.ndarray
    next: int | None
    eos_hit: bool | None


def _ids(ids: Sequence[int] | np.ndarray | None) -> list[int]:
    """Ids as Python ints (so that uint32 and negative int32 values compare exactly)."""
    if ids is None:
        return []
    return [int(t) for t in np.asarray(ids).reshape(-1)]


def _rows(x: np.ndarray, name: str, shape: tuple[int, int]) -> np.ndarray:
    rows = np.asarray(x, dtype=np.float64)
    if rows.shape != shape:
        raise ValueError(f"oracle: {name} must have shape {shape}, got {rows.shape}")
    return rows


def has_finite_maximum(row: np.ndarray) -> bool:
    """Whether a greedy row decides anything: no NaN, and a maximum that is neither +inf (an
    overflow) nor -inf (no token allowed)."""
    return not np.isnan(row).any() and bool(np.isfinite(np.max(row)))


def first_argmax(row: np.ndarray) -> int:
    """The first index holding the maximum of ``row`` (``[V]``, no NaN)."""
    best = 0
    for j in range(1, row.shape[0]):
        if row[j] > row[best]:
            best = j
    return best


def oracle_eos_hit(
    draft: Sequence[int], accepted: int, next_token: int | None, eos: Sequence[int] | None
) -> bool:
    """Whether one of the ``accepted`` first draft tokens, or ``next_token`` (``None``: no
    token), is an EOS id."""
    stops = set(_ids(eos))
    in_draft = any(t in stops for t in _ids(draft)[:accepted])
    return in_draft or (next_token is not None and int(next_token) in stops)


def oracle_greedy(
    logits: np.ndarray, draft: Sequence[int], eos: Sequence[int] | None = None
) -> tuple[int, int, bool]:
    """Greedy acceptance.

    Args:
        logits (np.ndarray): ``[N + 1, V]`` real values, the ones the implementation compares.
        draft (sequence of int): ``[N]`` draft ids; ids outside ``[0, V)`` are rejected.
        eos (sequence of int, optional): ``[E]`` EOS ids, duplicates allowed. Default: none.

    Returns:
        tuple: ``(accepted, next, eos_hit)`` as ``(int, int, bool)``; ``next`` is
        ``INVALID_ROW + accepted`` when row ``accepted`` has no finite maximum.
    """
    tokens, eos_ids = _ids(draft), _ids(eos)
    stops = set(eos_ids)
    n = len(tokens)
    rows = np.asarray(logits, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] != n + 1 or rows.shape[1] < 1:
        raise ValueError(f"oracle_greedy: logits must be [{n + 1}, V], got {rows.shape}")
    vocab = rows.shape[1]
    accepted = 0
    for i in range(n):
        token = tokens[i]
        if not has_finite_maximum(rows[i]):
            break
        if not 0 <= token < vocab or token != first_argmax(rows[i]):
            break
        accepted += 1
        if token in stops:
            break
    if not has_finite_maximum(rows[accepted]):
        return accepted, INVALID_ROW + accepted, oracle_eos_hit(tokens, accepted, None, eos_ids)
    following = first_argmax(rows[accepted])
    return accepted, following, oracle_eos_hit(tokens, accepted, following, eos_ids)


def _probability(x: float) -> bool:
    """Whether ``x`` is in ``[0, 1]`` (not NaN)."""
    return 0.0 <= x <= 1.0


def inverse_cdf(row: np.ndarray, u: float) -> int:
    """The token ``j`` with ``cdf[j - 1] <= u * total < cdf[j]``, a draw from ``row`` for ``u``
    uniform in ``[0, 1)``; always a token of positive mass."""
    total = 0.0
    last = -1
    mass = float(np.sum(row))
    for j in range(row.shape[0]):
        if row[j] > 0:
            total += row[j]
            last = j
            if u * mass < total:
                return j
    return last


def oracle_sampled(
    probs: np.ndarray,
    draft: Sequence[int],
    draft_probs: np.ndarray | None,
    eos: Sequence[int] | None,
    uniforms: Sequence[float],
    u_next: float | None = None,
) -> SampledOutcome:
    """Sampled (rejection) acceptance for explicit uniforms.

    Args:
        probs (np.ndarray): ``[N + 1, V]`` target probabilities ``p``; a row that is not a
            distribution (see the module's docstring) makes the outcome invalid if it decides.
        draft (sequence of int): ``[N]`` draft ids; ids outside ``[0, V)`` are rejected.
        draft_probs (np.ndarray, optional): ``[N, V]`` drafter probabilities ``q``; ``None``
            for deterministic drafts (a point mass on each draft token).
        eos (sequence of int, optional): ``[E]`` EOS ids, duplicates allowed.
        uniforms (sequence of float): ``[N]`` acceptance uniforms ``u`` in ``[0, 1)``.
        u_next (float, optional): a uniform in ``[0, 1)`` to draw ``next`` by inverse CDF.

    Returns:
        SampledOutcome: ``accepted``, the ``row`` ``next`` is drawn from, and, when ``u_next`` is
        given, ``next`` and ``eos_hit``; for an invalid deciding row, no ``row`` and
        ``next = INVALID_ROW + accepted``.
    """
    tokens, eos_ids = _ids(draft), _ids(eos)
    stops = set(eos_ids)
    n = len(tokens)
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != n + 1 or p.shape[1] < 1:
        raise ValueError(f"oracle_sampled: probs must be [{n + 1}, V], got {p.shape}")
    vocab = p.shape[1]
    q = None if draft_probs is None else _rows(draft_probs, "draft_probs", (n, vocab))
    u = np.asarray(uniforms, dtype=np.float64).reshape(-1)
    if u.shape != (n,):
        raise ValueError(f"oracle_sampled: uniforms must be [{n}], got {u.shape}")

    def drafter_row(i: int) -> np.ndarray:
        if q is not None:
            return q[i]
        point = np.zeros(vocab)
        if 0 <= tokens[i] < vocab:
            point[tokens[i]] = 1.0
        return point

    def misread(i: int) -> bool:
        """Whether a value the ratio test of position ``i`` reads is not a probability."""
        token = tokens[i]
        return 0 <= token < vocab and not (
            _probability(p[i, token]) and _probability(drafter_row(i)[token])
        )

    accepted = 0
    for i in range(n):
        token = tokens[i]
        if not 0 <= token < vocab or misread(i):
            break
        if not u[i] * drafter_row(i)[token] < p[i, token]:
            break
        accepted += 1
        if token in stops:
            break

    target = p[accepted]
    invalid = (
        np.isnan(target).any()
        or (target < 0).any()
        or not abs(np.sum(target) - 1) <= MASS_TOLERANCE
        or (
            accepted < n
            and (misread(accepted) or not all(map(_probability, drafter_row(accepted))))
        )
    )
    if invalid:
        following = INVALID_ROW + accepted
        return SampledOutcome(
            accepted, None, following, oracle_eos_hit(tokens, accepted, None, eos_ids)
        )
    if accepted == n:
        row = p[n]
    else:
        row = np.maximum(p[accepted] - drafter_row(accepted), 0.0)
        if not np.sum(row) > 0:
            row = p[accepted]
    row = row / np.sum(row)
    if u_next is None:
        return SampledOutcome(accepted, row, None, None)
    following = inverse_cdf(row, u_next)
    return SampledOutcome(
        accepted, row, following, oracle_eos_hit(tokens, accepted, following, eos_ids)
    )
