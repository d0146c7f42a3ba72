"""How many tokens to draft each round: a fixed number, or the number that pays most.

A round that drafts ``N`` tokens, each kept with probability ``a`` once the ones before it were,
yields ``E(N) = 1 + a + ... + a^N`` tokens on average. It costs one target call over the ``k``
tokens the target still lacks plus the ``N`` drafts, and the drafter's own calls. The adaptive
choice keeps estimates of both and takes the ``N`` that maximises ``E(N) / cost(N)``:

- ``a`` from the recent rounds: every draft token tested counts (a kept token is a success, the
  first rejected one a failure), with older rounds weighing less;
- the cost of a round as ``c0 + c1 * (k + N) + c2 * steps`` seconds (``steps``: the drafter's
  model calls), fitted by least squares with forgetting to the measured time of each round. On a
  GPU or Apple silicon ``c1`` is small, so long drafts pay; on a CPU that computes every scored
  position, ``c1`` is about the cost of a one-token step, so only well-kept drafts pay.

Exploration keeps both estimates alive: every few rounds the choice drafts one token more or fewer
than its best, so the fit sees rounds of different lengths; and when drafting does not pay, the
loop still asks a free drafter (prompt lookup) for a proposal and checks it against the token the
target emits, which measures its acceptance without verifying it. A time far above the prediction
(a compilation, a first use) counts as three times the prediction, not more.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["MAX_DRAFT_TOKENS", "DraftLength"]

#: The most draft tokens a round may take. A round keeps on average fewer than ``1 / (1 - a)``
#: tokens for an acceptance rate ``a`` (20 at 95%), while each draft token costs a position of the
#: verification and, for a draft model, a draft step.
MAX_DRAFT_TOKENS = 64

# Forgetting per round: the acceptance is a mean over about the last 30 rounds, the costs a fit
# to the last 48 rounds with weights falling by this factor per round of age.
_ACCEPT_DECAY = 0.97
_COST_DECAY = 0.97
_COST_WINDOW = 48
# The acceptance before any round, as pseudo-counts: a mean of 2/3 worth 3 tested tokens.
_PRIOR_KEPT, _PRIOR_TESTED = 2.0, 3.0
# Every this many rounds the choice tries one token more or fewer than its best (alternately),
# so the fit always sees rounds of different lengths.
_EXPLORE_EVERY = 6
# A measured round counts as at most this many times its predicted time.
_OUTLIER = 3.0
# Ridge on the per-token costs, relative to the fit's weight: without rounds of different lengths
# they stay near 0 (long drafts look free) until exploration measures them.
_RIDGE = 1e-3


class DraftLength:
    """Chooses each round's number of draft tokens.

    Args:
        most (int): the most draft tokens in a round, ``>= 0``.
        adaptive (bool): choose each round's number (see the module's description) instead of
            always ``most``.
        free (bool): whether a proposal costs no model call (prompt lookup): then the drafter's
            steps cost nothing, and when drafting does not pay the loop checks proposals against
            the emitted text instead of verifying them.
    """

    def __init__(self, most: int, adaptive: bool, free: bool = False) -> None:
        self.most = most
        self.adaptive = adaptive
        self.free = free
        self._kept = _PRIOR_KEPT
        self._tested = _PRIOR_TESTED
        self._rounds: deque[tuple[float, float, float]] = deque(maxlen=_COST_WINDOW)
        self._theta: np.ndarray | None = None
        self._count = 0

    @property
    def acceptance(self) -> float:
        """float: the estimated chance that a draft token is kept, once the ones before it are."""
        return self._kept / self._tested

    def _cost(self, fed: int, steps: int) -> float:
        c0, c1, c2 = self._theta
        return c0 + c1 * fed + c2 * steps

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
        if top == 0 or self._theta is None:
            return top
        a = min(self.acceptance, 0.999)
        best, best_rate = 0, 0.0
        for n in range(top + 1):
            tokens = (1 - a ** (n + 1)) / (1 - a)
            cost = self._cost(pending + n, 0 if self.free else n)
            if replays and n:
                # A rejection (chance 1 - a^n) makes the next call feed again what waits now and
                # the tokens kept before the rejection.
                kept = sum(i * a**i * (1 - a) for i in range(n)) / max(1 - a**n, 1e-12)
                cost += (1 - a**n) * self._theta[1] * (pending + kept)
            rate = tokens / max(cost, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        if self._count % _EXPLORE_EVERY == _EXPLORE_EVERY - 1:
            step = 1 if (self._count // _EXPLORE_EVERY) % 2 else -1
            if best == 0 or best == top:
                step = 1 if best == 0 else -1
            best = min(max(best + step, 0), top)
        return best

    def record(self, drafted: int, accepted: int, fed: int, steps: int, seconds: float) -> None:
        """What one round did and cost.

        Args:
            drafted (int): draft tokens verified.
            accepted (int): how many of them were kept.
            fed (int): tokens the target scored (the pending ones and the drafts).
            steps (int): the drafter's model calls.
            seconds (float): the round's time, from proposing to reading the result.
        """
        if drafted:
            self.shadow(accepted, drafted)
        self._count += 1
        if self._theta is not None:
            seconds = min(seconds, _OUTLIER * max(self._cost(fed, steps), 0.0))
        self._rounds.append((float(fed), float(steps), seconds))
        self._theta = self._fit()

    def _fit(self) -> np.ndarray:
        """Weighted least squares of the round times on ``[1, fed, steps]``, newest heaviest."""
        data = np.array(self._rounds)
        weights = _COST_DECAY ** np.arange(len(data) - 1, -1, -1)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        gram = (x * weights[:, None]).T @ x
        gram += np.diag([0.0, 1.0, 1.0]) * _RIDGE * weights.sum() * (1 + data[:, 0].var())
        return np.linalg.solve(gram, (x * weights[:, None]).T @ data[:, 2])

    def shadow(self, accepted: int, tested: int) -> None:
        """Counts ``tested`` draft tokens of which the first ``accepted`` were kept, the rest not
        reached after a rejection (also for a proposal checked against the emitted text)."""
        failures = 1 if accepted < tested else 0
        self._kept = self._kept * _ACCEPT_DECAY + accepted
        self._tested = self._tested * _ACCEPT_DECAY + accepted + failures
