"""How many tokens to draft each round: a :class:`DraftPolicy` the loop asks and tells.

Before each round the loop asks :meth:`DraftPolicy.choose` for ``N`` (``0``: a plain step of the
target) given a :class:`Round`, and after it tells :meth:`DraftPolicy.observe` the
:class:`Outcome`. :class:`Fixed` always drafts ``n``; :class:`Adaptive` takes the ``N`` that
maximises ``E(N) / cost(N)``. Sampling is keyed by text position (:mod:`mlx_spec.keys`), so no
``N`` changes the text, only how fast it comes.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ._checks import check_int

__all__ = [
    "EXPLORE",
    "MAX_DRAFT_TOKENS",
    "Adaptive",
    "Calibration",
    "DraftPolicy",
    "Fixed",
    "Outcome",
    "Round",
]

#: The most draft tokens a round may take: a round keeps on average fewer than ``1 / (1 - a)``
#: tokens at an acceptance rate ``a`` (20 at 95%), and each draft token costs a scored position.
MAX_DRAFT_TOKENS = 64

#: How many times what a test round costs over a plain step the plain steps that tested no draft
#: must cost before :class:`Adaptive` runs one.
EXPLORE = 32

# Rounds measured at each of two lengths, and steady plain steps, before a calibration is fixed.
_ROUNDS, _STEPS = 3, 8
# The acceptance estimate's prior: 2 draft tokens kept of 3 tested.
_PRIOR = (2.0, 3.0)


@dataclass(frozen=True)
class Round:
    """What the loop knows before a round.

    Attributes:
        cap (int): the most the round may draft (tokens left, caches, the proposal), ``>= 0``.
        label (int): the kind of proposal (:attr:`mlx_spec.drafters.Draft.label`).
        pending (int): the tokens the target still lacks, scored in the round's call too.
        replays (bool): whether a rejection restores the target's caches, whose next call then
            feeds the kept tokens again.
    """

    cap: int
    label: int = 0
    pending: int = 1
    replays: bool = False


@dataclass(frozen=True)
class Outcome:
    """What a round, or one plain step, did.

    Attributes:
        drafted (int): draft tokens tested: verified, or (a free drafter's guess during a plain
            step) compared with the token the target emitted.
        accepted (int): how many of them, from the first, were kept.
        label (int): the kind of proposal they came from.
        seconds (float, optional): the round's or the plain step's wall time.
        plain (bool): a plain step (whose ``seconds`` is a pipelined step's, unless ``first``).
        first (bool): the first plain step after a round, which waits for its own host work.
    """

    drafted: int
    accepted: int
    label: int = 0
    seconds: float | None = None
    plain: bool = False
    first: bool = False


@runtime_checkable
class DraftPolicy(Protocol):
    """Chooses each round's number of draft tokens; pass one as ``policy=`` to the loop."""

    def choose(self, round: Round) -> int:
        """``N`` for the next round, in ``[0, round.cap]``; ``0`` runs a plain step."""

    def observe(self, outcome: Outcome) -> None:
        """Learns what the last round or plain step did."""


class Fixed:
    """Always ``n`` draft tokens (as many as the round may take, when fewer).

    Where a rejection restores the target's caches (recurrent layers not kept per position), a
    round over more than ``n + 1`` waiting tokens drafts nothing, feeding them once.

    Args:
        n (int): draft tokens a round, in ``[0, MAX_DRAFT_TOKENS]``.
    """

    def __init__(self, n: int) -> None:
        self.n = check_int("Fixed", "n", n, 0, MAX_DRAFT_TOKENS)

    def choose(self, round: Round) -> int:
        return 0 if round.replays and round.pending > self.n + 1 else min(self.n, round.cap)

    def observe(self, outcome: Outcome) -> None:
        pass


@dataclass(frozen=True)
class Calibration:
    """What rounds and plain steps cost, for one target, drafter and machine.

    Attributes:
        plain (float): seconds of a plain step, pipelined as plain decoding runs them.
        round (float): seconds a round costs whatever it drafts (the call, the host read).
        token (float): seconds each draft token adds (a scored position, a draft model's step).
    """

    plain: float
    round: float
    token: float

    def cost(self, n: int, pending: int = 1) -> float:
        """Seconds of a round drafting ``n`` tokens over ``pending`` waiting ones."""
        return self.round + self.token * (n + pending - 1)


def _expected(a: float, top: int) -> list[float]:
    """The ``top + 1`` tokens a round drafting ``0 .. top`` yields on average at acceptance
    ``a``: ``E(N) = 1 + a + ... + a^N``."""
    a, term, tokens = min(a, 0.999), 1.0, [1.0]
    for _ in range(top):
        term *= a
        tokens.append(tokens[-1] + term)
    return tokens


def _fastest(
    tokens: list[float], costs: Calibration, pending: int, untested: int, most: int
) -> int:
    """The ``N`` whose ``tokens[N]`` come fastest (``N = 0``: a plain step), or a test round of
    ``most = len(tokens) - 1`` where the ``untested`` plain steps are due one (a round the tokens
    left cut short is none: it tests less, and too few tokens are left to win back its cost).
    Plain Python: the loop asks before every plain step, where NumPy would cost more."""
    fastest, rate = 0, tokens[0] / max(costs.plain, 1e-12)
    for n in range(1, len(tokens)):
        if (this := tokens[n] / max(costs.cost(n, pending), 1e-12)) > rate:
            fastest, rate = n, this
    if fastest or len(tokens) - 1 < most:
        return fastest
    patience = EXPLORE * (costs.cost(most, pending) - costs.plain) / max(costs.plain, 1e-12)
    return most if untested >= max(1, math.ceil(patience)) else 0


class _Meter:
    """Measures a :class:`Calibration`: rounds of the most and of one token in turn, then
    plain steps."""

    def __init__(self) -> None:
        # The seconds of rounds, by length, and of the latest steady plain steps since the last
        # round (nearest the rounds in time, and bounded where a drafter long proposes nothing).
        self._rounds: dict[int, list[float]] = {}
        self._steps: deque[float] = deque(maxlen=_STEPS)

    def length(self, top: int) -> int:
        """The next ``N`` while measuring (``0``: a plain step): rounds of one token and of
        ``top`` in turn, until one token and some longer length each have enough (a round the
        tokens left cut short counts at its own length)."""
        short = len(self._rounds.get(1, []))
        long = max((len(t) for n, t in self._rounds.items() if n > 1), default=0)
        if min(short, long) > _ROUNDS:
            return 0
        return top if short > _ROUNDS or (long <= _ROUNDS and short >= long) else 1

    def record(self, outcome: Outcome) -> Calibration | None:
        """Counts a timed round or plain step: the costs measured so far, once there are enough."""
        if not outcome.plain:
            self._rounds.setdefault(outcome.drafted, []).append(outcome.seconds)
            self._steps.clear()
        elif not outcome.first:
            self._steps.append(outcome.seconds)
        lengths = sorted(n for n, times in self._rounds.items() if len(times) > _ROUNDS)
        if len(lengths) < 2 or len(self._steps) < _STEPS:
            return None
        # The first round at each length pays its first use (a compilation): left out.
        short, long = (statistics.median(self._rounds[n][1:]) for n in (lengths[0], lengths[-1]))
        token = max((long - short) / (lengths[-1] - lengths[0]), 0.0)
        fixed = max(short - token * lengths[0], 0.0)
        return Calibration(statistics.median(self._steps), fixed, token)


def _check_policy(op: str, most: object, decay: object) -> None:
    check_int(op, "most", most, 1, MAX_DRAFT_TOKENS)
    if not isinstance(decay, numbers.Real) or isinstance(decay, bool) or not 0 < decay <= 1:
        raise ValueError(f"{op}: `decay` must be in (0, 1], got {decay!r}")


class Adaptive:
    """The ``N`` that maximises tokens per second.

    A round drafting ``N`` yields ``E(N) = 1 + a + ... + a^N`` tokens on average (``a``: the
    chance a draft token is kept once the one before it was, per kind of proposal) and costs
    ``round + token * N`` seconds, a plain step ``plain`` (a :class:`Calibration`). Plain steps
    that test no draft fade the estimates toward the prior, and once they have cost
    :data:`EXPLORE` times what a round of the most tokens costs over a plain step, such a round
    tests one, where the round may take the most: a drafter whose acceptance has changed gets
    drafting back (``benchmarks/generation.py`` on the H100: the MTP head took plain steps
    throughout where ``N = 4`` kept 4.06 tokens a round), at about ``1 / EXPLORE`` of plain
    decoding's time where it has not (more by a model drafter's catch-up on the plain steps'
    positions, which the calibration does not count). Given a calibration, the choices are
    deterministic.

    Args:
        most (int): the most draft tokens a round, in ``[1, MAX_DRAFT_TOKENS]``. Default: ``8``.
        calibration (Calibration, optional): what rounds and plain steps cost, kept as the
            attribute ``calibration``. Default: measured in the first rounds and plain steps this
            policy serves (``None`` until then), then kept.
        decay (float): the weight, in ``(0, 1]``, that each newer tested token leaves to the
            older ones in the acceptance estimate. Default: ``0.97`` (about the last 30).
    """

    def __init__(
        self, most: int = 8, calibration: Calibration | None = None, decay: float = 0.97
    ) -> None:
        _check_policy("Adaptive", most, decay)
        if calibration is not None and not isinstance(calibration, Calibration):
            raise ValueError(f"Adaptive: `calibration` must be a Calibration, got {calibration!r}")
        self.most, self.calibration, self.decay = most, calibration, decay
        # [kept, tested] draft tokens per label, from _PRIOR; plain steps since a test.
        self._counts: dict[int, list[float]] = {}
        self._meter, self._untested = _Meter(), 0

    def acceptance(self, label: int = 0) -> float:
        """The estimated chance that a draft token of a proposal labelled ``label`` is kept."""
        kept, tested = self._counts.get(label, _PRIOR)
        return kept / tested

    def choose(self, round: Round) -> int:
        top = min(self.most, round.cap)
        if top == 0 or self.calibration is None:
            return self._meter.length(top) if top else 0
        tokens = _expected(self.acceptance(round.label), top)
        return _fastest(tokens, self.calibration, round.pending, self._untested, self.most)

    def observe(self, outcome: Outcome) -> None:
        self._untested = 0 if outcome.drafted else self._untested + outcome.plain
        if outcome.drafted:
            counts = self._counts.setdefault(outcome.label, list(_PRIOR))
            tested = outcome.accepted + (outcome.accepted < outcome.drafted)
            fade = self.decay**tested
            counts[:] = counts[0] * fade + outcome.accepted, counts[1] * fade + tested
        elif outcome.plain:
            # A step testing nothing fades the estimates toward the prior, so that a policy that
            # stopped drafting looks again where the prior pays (benchmarks/generation.py: one
            # policy kept from temperature 0.8 to 0 never drafted again, on the H200).
            for counts in self._counts.values():
                counts[:] = [p + (c - p) * self.decay for c, p in zip(counts, _PRIOR, strict=True)]
        if self.calibration is None and outcome.seconds is not None:
            self.calibration = self._meter.record(outcome)
