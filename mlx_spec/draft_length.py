"""How many tokens to draft each round: a fixed number, or the number that pays most.

A round that drafts ``N`` tokens, each kept with probability ``a`` once the ones before it were,
yields ``E(N) = 1 + a + ... + a^N`` tokens on average. It costs one target call over the ``k``
tokens the target still lacks and the ``N`` drafts, plus the drafter's own work. The adaptive
choice keeps estimates of both and takes the ``N`` that maximises ``E(N) / cost(N)``:

- ``a`` from the recent rounds: every draft token tested counts (a kept token is a success, the
  first rejected one a failure), older rounds weighing less;
- the cost of a round as ``base + slope * (k + N)`` seconds for prompt lookup, whose proposals
  cost nothing, and ``base + slope * N`` for a draft model, whose ``slope`` also holds a draft
  step (and whose ``base`` holds the waiting tokens). ``slope`` is the median, over recent pairs
  of consecutive rounds that drafted different numbers, of their difference in time over their
  difference in ``N``, each pair weighing the square of that difference: pairs close in time
  cancel the drift of a machine whose load changes, and the median ignores the outliers (a
  compilation, a first use). ``base`` is then the median of
  what each round's time leaves. On a GPU or Apple silicon the slope is small, so long drafts pay;
  on a CPU that computes every scored position it is about the cost of a one-token step, so only
  well-kept drafts pay.

Exploration keeps both estimates alive: every few rounds the choice drafts one token more or fewer
than its best, so consecutive rounds differ; when drafting does not pay, it drafts the most and
one token in turn (a pair far apart, which measures the slope again); and the loop still asks a
free drafter (prompt lookup) for a proposal and checks it against the token the target emits,
which measures its acceptance without verifying it. The first rounds draft the most and one token
in turn, until the slope is measured.

A target whose caches are restored after a rejection (recurrent layers) feeds again, in the next
call, everything since its last fully kept round; the choice counts that future cost too, and a
fixed length drafts nothing in a round where more than ``N + 1`` tokens wait, so they are fed once.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["MAX_DRAFT_TOKENS", "DraftLength"]

#: The most draft tokens a round may take. A round keeps on average fewer than ``1 / (1 - a)``
#: tokens for an acceptance rate ``a`` (20 at 95%), while each draft token costs a position of the
#: verification and, for a draft model, a draft step.
MAX_DRAFT_TOKENS = 64

# The acceptance is a mean over about the last 30 rounds (weights falling by this factor a round).
_ACCEPT_DECAY = 0.97
# The acceptance before any round, as pseudo-counts: a mean of 2/3 worth 3 tested tokens.
_PRIOR_KEPT, _PRIOR_TESTED = 2.0, 3.0
# The costs come from the last this many rounds.
_COST_WINDOW = 48
# Plain decoding's cost a token is the median of the last this many stretches, measured at least
# every _REMEASURE choices.
_PLAIN_WINDOW = 8
_REMEASURE = 64
# Every this many rounds the choice tries one token more or fewer than its best (alternately),
# so consecutive rounds with different lengths keep measuring the slope.
_EXPLORE_EVERY = 6


class DraftLength:
    """Chooses each round's number of draft tokens.

    Args:
        most (int): the most draft tokens in a round, ``>= 0``.
        adaptive (bool): choose each round's number (see the module's description) instead of
            always ``most``.
        free (bool): whether a proposal costs no model call (prompt lookup): then a draft token
            costs what a scored position costs, and when drafting does not pay the loop checks
            proposals against the emitted text instead of verifying them.
        stretches (bool): whether drafting nothing runs a stretch of pipelined plain steps (see
            :mod:`mlx_spec.loop`), whose cost per token is then measured and is what drafting
            must beat; else drafting nothing is a round of one step.
    """

    def __init__(
        self, most: int, adaptive: bool, free: bool = False, stretches: bool = False
    ) -> None:
        self.most = most
        self.adaptive = adaptive
        self.free = free
        self.stretches = stretches
        self._kept = _PRIOR_KEPT
        self._tested = _PRIOR_TESTED
        # (pending, drafted, seconds) of the recent rounds, oldest first.
        self._rounds: deque[tuple[int, int, float]] = deque(maxlen=_COST_WINDOW)
        self._base = self._slope = None
        # Seconds a token of the recent stretches of plain steps (see mlx_spec.loop).
        self._plain: deque[float] = deque(maxlen=_PLAIN_WINDOW)
        self._count = 0
        # Draft tokens tested so far (verified, or checked against the emitted text).
        self._shadowed = 0

    @property
    def acceptance(self) -> float:
        """float: the estimated chance that a draft token is kept, once the ones before it are."""
        return self._kept / self._tested

    def cost(self, pending: int, n: int) -> float:
        """The predicted seconds of a round over ``pending`` waiting tokens and ``n`` drafts
        (``nan`` before two rounds of different lengths were measured)."""
        if self._slope is None:
            return float("nan")
        # A waiting token is a scored position; for prompt lookup so is a draft token, for a draft
        # model the slope also holds its step.
        return self._base + self._slope * (pending + n if self.free else n)

    def choose(self, pending: int, cap: int, replays: bool = False) -> int:
        """The number of draft tokens of the next round.

        Args:
            pending (int): the tokens of the text the target still lacks (``>= 1``).
            cap (int): the most this round may draft (tokens left to generate, the limits of the
                caches), ``>= 0``.
            replays (bool): whether a rejection restores the target's caches, whose next call
                then feeds again everything since the last fully kept round.

        Returns:
            int: ``N`` in ``[0, min(most, cap)]``. With ``replays`` and a fixed length, 0 once
            more than ``most + 1`` tokens wait: that round is a plain step over them, which
            keeps the tokens fed again from growing with every rejection.
        """
        top = min(self.most, cap)
        if not self.adaptive:
            return 0 if replays and pending > self.most + 1 else top
        self._count += 1
        if top == 0:
            return 0
        if self._slope is None:
            if self.stretches and self._rounds and (self._shadowed == 0 or self.acceptance < 0.5):
                # A drafter that proposed nothing yet (prompt lookup before any match): plain
                # steps, until its proposals checked against the text show it would be kept.
                if not any(drafted for _, drafted, _ in self._rounds):
                    return 0
            # Until a pair of rounds of different lengths is measured: the most, then one, ...
            # (lengths far apart measure the slope above the noise of a round's time).
            return top if len(self._rounds) % 2 == 0 else 1
        if self.stretches and (not self._plain or self._count % _REMEASURE == 0):
            # A stretch of plain steps, to measure (again) what drafting must beat.
            return 0
        a = min(self.acceptance, 0.999)
        # Drafting nothing: plain steps, at the cost measured in stretches (or a round of one).
        plain = float(np.median(self._plain)) if self.stretches else self.cost(pending, 0)
        best, best_rate = 0, 1 / max(plain, 1e-9)
        for n in range(1, top + 1):
            tokens = (1 - a ** (n + 1)) / (1 - a)
            cost = self.cost(pending, n)
            if replays and n:
                # A rejection (chance 1 - a^n) makes the next call feed again what waits now and
                # the tokens kept before the rejection.
                kept = sum(i * a**i * (1 - a) for i in range(n)) / max(1 - a**n, 1e-12)
                cost += (1 - a**n) * self._slope * (pending + kept)
            rate = tokens / max(cost, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        if self._count % _EXPLORE_EVERY == 0:
            odd = (self._count // _EXPLORE_EVERY) % 2
            if best == 0:
                # Drafting does not pay: rounds of the most and of one token, alternately, are
                # consecutive among the rounds (plain steps are not rounds), so each new pair
                # measures the slope again, far apart.
                return top if odd else 1
            step = 1 if odd else -1
            if best == top:
                step = -1
            best = min(max(best + step, 0), top)
        return best

    def record(self, drafted: int, accepted: int, fed: int, steps: int, seconds: float) -> None:
        """What one round did and cost.

        Args:
            drafted (int): draft tokens verified.
            accepted (int): how many of them were kept.
            fed (int): tokens the target scored (the waiting ones and the drafts).
            steps (int): the drafter's model calls (folded into the slope of a draft token).
            seconds (float): the round's time, from proposing to reading the result.
        """
        if drafted:
            self.shadow(accepted, drafted)
        if self.adaptive:
            self._rounds.append((fed - drafted, drafted, seconds))
            self._fit()

    def record_plain(self, seconds: float) -> None:
        """The seconds a token took in a stretch of plain steps (which drafting must beat)."""
        self._plain.append(seconds)

    def _fit(self) -> None:
        rounds = np.array(self._rounds, dtype=np.float64)
        pending, drafted, seconds = rounds.T
        # Per draft token for a draft model; per scored position for prompt lookup.
        x = pending + drafted if self.free else drafted
        dx, dt = np.diff(x), np.diff(seconds)
        paired = dx != 0
        if not self.free:
            # Waiting tokens are in a draft model's base: compare rounds with as many.
            paired &= np.diff(pending) == 0
        if not paired.any():
            return
        self._slope = max(_weighted_median(dt[paired] / dx[paired], dx[paired] ** 2), 0.0)
        self._base = float(np.median(seconds - self._slope * x))

    def shadow(self, accepted: int, tested: int) -> None:
        """Counts ``tested`` draft tokens of which the first ``accepted`` were kept, the rest not
        reached after a rejection (also for a proposal checked against the emitted text)."""
        self._shadowed += tested
        failures = 1 if accepted < tested else 0
        self._kept = self._kept * _ACCEPT_DECAY + accepted
        self._tested = self._tested * _ACCEPT_DECAY + accepted + failures


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half the weight lies: a pair of rounds that differ by more tokens
    measures the slope with less noise, so it weighs more."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])
