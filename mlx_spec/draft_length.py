"""How many tokens to draft each round: a fixed number, or the number that pays most.

A round that drafts ``N`` tokens yields ``E(N) = 1 + s(1) + ... + s(N)`` tokens on average,
``s(i)`` being the chance that its first ``i`` draft tokens are all kept: ``a1 * a^(i - 1)``, with
``a1`` the chance that a first draft token is kept and ``a`` that a later one is, once the one
before it was. It costs one target call over the ``k`` tokens the target still lacks and the ``N``
drafts, plus the drafter's own work. The adaptive choice keeps estimates of both and takes the
``N`` that maximises ``E(N) / cost(N)``:

- ``a1`` and ``a`` from the recent rounds: every draft token tested counts (a kept token is a
  success, the first rejected one a failure), older rounds weighing less. ``a1`` is kept apart for
  each kind of proposal (:attr:`mlx_spec.drafters.Draft.label`): prompt lookup's proposals from
  a long matched n-gram are kept far more often than those from one matched token, and a first
  token tells where a copy begins, whose later tokens are then kept alike;
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
than its best, so consecutive rounds differ. When drafting does not pay, a round still comes once
``_EXPLORE_PLAIN`` plain steps ran since the last one, drafting the most and one token in turn (a
pair far apart, which measures the slope again); it also measures a draft model's acceptance,
which only verifying its drafts measures, so that drafts worth verifying again (another stretch of
text, or estimates misled by a slow moment of the machine) are noticed. Meanwhile the loop still
asks a free drafter (prompt lookup) for a proposal and checks it against the token the target
emits, which measures its acceptance without verifying it; the stretch of plain steps ends as soon
as a proposal of a kind that pays comes. The first rounds draft the most and one token in turn,
until the slope is measured.

What rounds and plain steps cost is a property of the target, the drafter and the device, not of
the text: what one generation measured is kept for the next generation with the same target and
drafter on the same device (:func:`cost_key`, :func:`recall`, :func:`keep`), which then chooses
from its first round instead of first drafting the most and one token to measure the costs. The
acceptance depends on the text as well as on the drafter, so the next generation starts from the
last one's estimates weighed as at most ``_KEPT_TESTED`` tested tokens: a few rounds of the new
text outweigh them, while one rejected first round does not make a drafter that is usually kept
look worse than plain steps (whose estimate would then not be measured again for a long while).
:func:`forget_costs` drops what was kept.

Where drafting nothing runs stretches of pipelined plain steps, a stretch's first step waits for
its own host work, which the steps after it hide: going from plain steps to rounds and back costs
that restart once more, which a round's own time does not hold. Each round is charged the
restart's measured excess over a plain step, times the estimated chance that plain steps come
after it: the share of rounds after which there was nothing to propose or the next choice, made
without this charge, was plain steps (older rounds weighing less). Copies that run round after
round pay it once; prompt lookup's lone rounds between plain steps (a guess from a long n-gram
kept, the next proposal from a short one not worth verifying) pay it in full. Choices made without
the charge decide the share, so the charge cannot make rounds look lone by itself.

A target whose caches are restored after a rejection (recurrent layers) feeds again, in the next
call, everything since its last fully kept round; the choice counts that future cost too, and a
fixed length drafts nothing in a round where more than ``N + 1`` tokens wait, so they are fed once.
"""

from __future__ import annotations

import copy
import statistics
import threading
import weakref
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "MAX_DRAFT_TOKENS",
    "DraftLength",
    "Measured",
    "cost_key",
    "forget_costs",
    "keep",
    "recall",
]

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
# every _REMEASURE choices (at the first rejection after them).
_PLAIN_WINDOW = 8
_REMEASURE = 64
# Every this many rounds the choice tries one token more or fewer than its best (alternately),
# so consecutive rounds with different lengths keep measuring the slope.
_EXPLORE_EVERY = 6
# While drafting does not pay, a round comes once this many plain steps ran since the last one:
# the stretches of plain steps double from 8 up to 64 steps, so this comes after the fifth, and a
# round drafting in vain then costs little next to the plain steps between two of them.
_EXPLORE_PLAIN = 128
# The acceptance a generation starts from, kept from the last one, weighs at most this many
# tested draft tokens (the estimates of a generation weigh up to about 30 rounds' worth).
_KEPT_TESTED = 10.0
# The chance that plain steps follow a round, before any round, as pseudo-counts: none, worth 1.
_PRIOR_ENDS, _PRIOR_ROUNDS = 0.0, 1.0


@dataclass
class Measured:
    """What the rounds and plain steps of one target and drafter on one device cost, and how often
    its drafts were kept, kept from one generation to the next (see the module's description).

    Attributes:
        rounds (list): ``(waiting tokens, draft tokens, seconds)`` of the latest rounds, oldest
            first.
        plain (list): seconds a token of the latest stretches of plain steps.
        first (dict): for each proposal label, ``(kept, tested)`` of its first draft tokens,
            older ones weighing less (see :meth:`DraftLength.acceptance`).
        later (tuple): ``(kept, tested)`` of the later draft tokens, likewise.
        restarts (list): seconds by which the first step of the latest stretches exceeded a plain
            step.
    """

    rounds: list[tuple[int, int, float]] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    first: dict[int, tuple[float, float]] = field(default_factory=dict)
    later: tuple[float, float] = (_PRIOR_KEPT, _PRIOR_TESTED)
    restarts: list[float] = field(default_factory=list)


CostKey = tuple[int, Hashable, str]

# What the last generation of each target, drafter and device measured (see cost_key).
_KEPT: dict[CostKey, Measured] = {}
# The keys whose removal is registered with their models.
_WATCHED: set[CostKey] = set()
_KEPT_LOCK = threading.Lock()


def cost_key(target: Any, drafter: Any, device: Any) -> CostKey:
    """The key under which the costs of ``target`` with ``drafter`` on ``device`` are kept.

    Its entry goes when the target or the draft model is freed (so an ``id`` is never taken for
    another model's).

    Args:
        target (nn.Module): the target model.
        drafter (object): the draft model, or for a drafter without one (prompt lookup) its
            class.
        device (mx.Device): where the generation runs.

    Returns:
        tuple: ``(id(target), the draft model's id or the drafter class, str(device))``.
    """
    key = (id(target), drafter if isinstance(drafter, type) else id(drafter), str(device))
    with _KEPT_LOCK:
        if key not in _WATCHED:
            _WATCHED.add(key)
            for owner in (target, drafter):
                if not isinstance(owner, type):
                    weakref.finalize(owner, _drop, key)
    return key


def recall(key: CostKey) -> Measured | None:
    """What was kept under ``key`` (a copy), or ``None``."""
    with _KEPT_LOCK:
        kept = _KEPT.get(key)
        return None if kept is None else copy.deepcopy(kept)


def keep(key: CostKey, measured: Measured) -> None:
    """Keeps ``measured`` under ``key`` for the next generation (the last one kept wins)."""
    with _KEPT_LOCK:
        if key in _WATCHED:
            _KEPT[key] = measured


def _drop(key: CostKey) -> None:
    with _KEPT_LOCK:
        _KEPT.pop(key, None)
        _WATCHED.discard(key)


def forget_costs() -> None:
    """Drops everything kept (costs and acceptance): the next generation of each target and
    drafter measures anew."""
    with _KEPT_LOCK:
        _KEPT.clear()


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
        kept (Measured, optional): what an earlier generation with the same target, drafter
            and device measured (see :func:`recall`), to start from. Default: none.
    """

    def __init__(
        self,
        most: int,
        adaptive: bool,
        free: bool = False,
        stretches: bool = False,
        kept: Measured | None = None,
    ) -> None:
        self.most = most
        self.adaptive = adaptive
        self.free = free
        self.stretches = stretches
        # [kept, tested] of the first draft tokens, by label, and of the later ones.
        self._first: dict[int, list[float]] = {}
        self._later = [_PRIOR_KEPT, _PRIOR_TESTED]
        # (pending, drafted, seconds) of the recent rounds, oldest first.
        self._rounds: deque[tuple[int, int, float]] = deque(maxlen=_COST_WINDOW)
        self._base = self._slope = None
        # Seconds a token of the recent stretches of plain steps (see mlx_spec.loop), and the
        # excess of their first steps.
        self._plain: deque[float] = deque(maxlen=_PLAIN_WINDOW)
        self._restarts: deque[float] = deque(maxlen=_PLAIN_WINDOW)
        # [followed by plain steps, rounds] of the rounds with drafts, and whether the last thing
        # run was such a round (whose follower is not yet known).
        self._ends = [_PRIOR_ENDS, _PRIOR_ROUNDS]
        self._after_round = False
        # Plain steps run since the last round with drafts, and the rounds explored while
        # drafting did not pay.
        self._plain_since = self._explored = 0
        if kept is not None:
            self._rounds.extend(kept.rounds)
            self._plain.extend(kept.plain)
            self._restarts.extend(kept.restarts)
            if self._rounds:
                self._fit()
            self._first = {label: _weighed(*counts) for label, counts in kept.first.items()}
            self._later = _weighed(*kept.later)
        self._count = 0
        # The choice at which plain steps were last measured, and whether the last round kept
        # all its drafts (a copy going on, which a measurement would interrupt).
        self._measured_at = 0
        self._kept_all = False
        #: Whether the last choice of 0 was made to measure plain steps (a stretch that must run).
        self.measuring = False

    def acceptance(self, label: int = 0) -> tuple[float, float]:
        """The estimated chances that a first draft token of a proposal labelled ``label`` is kept,
        and that a later one is, once the one before it was: ``(a1, a)``."""
        kept, tested = self._first.get(label, (_PRIOR_KEPT, _PRIOR_TESTED))
        return kept / tested, self._later[0] / self._later[1]

    def cost(self, pending: int, n: int | np.ndarray) -> float | np.ndarray:
        """The predicted seconds of a round over ``pending`` waiting tokens and ``n`` drafts
        (``nan`` before two rounds of different lengths were measured); elementwise for an
        array of ``n``."""
        if self._slope is None:
            return float("nan")
        # A waiting token is a scored position; for prompt lookup so is a draft token, for a draft
        # model the slope also holds its step.
        return self._base + self._slope * (pending + n if self.free else n)

    def choose(self, pending: int, cap: int, replays: bool = False, label: int = 0) -> int:
        """The number of draft tokens of the next round.

        Args:
            pending (int): the tokens of the text the target still lacks (``>= 1``).
            cap (int): the most this round may draft (tokens left to generate, the limits of the
                caches), ``>= 0``.
            replays (bool): whether a rejection restores the target's caches, whose next call
                then feeds again everything since the last fully kept round.
            label (int): the label of the proposal to draft from (see
                :attr:`mlx_spec.drafters.Draft.label`).

        Returns:
            int: ``N`` in ``[0, min(most, cap)]``. With ``replays`` and a fixed length, 0 once
            more than ``most + 1`` tokens wait: that round is a plain step over them, which
            keeps the tokens fed again from growing with every rejection.
        """
        top = min(self.most, cap)
        self.measuring = False
        if not self.adaptive:
            return 0 if replays and pending > self.most + 1 else top
        self._count += 1
        if top == 0:
            return 0
        if self._after_round and self._slope is not None and self._charges_restarts:
            # Plain steps would follow the last round whatever a restart costs.
            self._followed(self._best(pending, top, replays, label, restart=False) == 0)
        if self._slope is None:
            # Until a pair of rounds of different lengths is measured: the most, then one, ...
            # (lengths far apart measure the slope above the noise of a round's time).
            return top if len(self._rounds) % 2 == 0 else 1
        due = not self._plain or self._count - self._measured_at >= _REMEASURE
        if self.stretches and due and not self._kept_all:
            # A stretch of plain steps, to measure (again) what drafting must beat; not in the
            # middle of drafts all kept, but after the next rejection.
            self.measuring = True
            self._measured_at = self._count
            return 0
        best = self._best(pending, top, replays, label)
        if best == 0:
            if self._plain_since < _EXPLORE_PLAIN:
                return 0
            # Drafting does not pay: rounds of the most and of one token, alternately, are
            # consecutive among the rounds (plain steps are not rounds), so each new pair
            # measures the slope again, far apart.
            self._explored += 1
            return top if self._explored % 2 else 1
        if self._count % _EXPLORE_EVERY == 0:
            odd = (self._count // _EXPLORE_EVERY) % 2
            step = 1 if odd else -1
            if best == top:
                step = -1
            best = min(max(best + step, 0), top)
        return best

    def pays(self, label: int, replays: bool = False) -> bool:
        """Whether drafting from a proposal labelled ``label``, with one token waiting, is
        expected to beat plain steps (once the costs are measured; always with a fixed length)."""
        if not self.adaptive:
            return True
        measured = self._slope is not None and bool(self._plain)
        return measured and self._best(1, self.most, replays, label) > 0

    @property
    def _charges_restarts(self) -> bool:
        """Whether rounds are charged the restart of the plain steps after them: where drafting
        nothing runs stretches, once a restart was measured."""
        return self.stretches and bool(self._restarts)

    def _best(self, pending: int, top: int, replays: bool, label: int, restart: bool = True) -> int:
        """The ``N`` in ``[0, top]`` of the most tokens per second, 0 being plain steps;
        ``restart``: whether a round is charged the restart of the plain steps after it."""
        if top == 0:
            return 0
        a1, a = (min(x, 0.999) for x in self.acceptance(label))
        # Drafting nothing: plain steps, at the cost measured in stretches (or a round of one,
        # before any stretch measured them).
        plain = statistics.median(self._plain) if self._plain else self.cost(pending, 0)
        best_rate = 1 / max(plain, 1e-9)
        # survival[i]: the chance that the first i draft tokens are all kept.
        survival = np.concatenate([[1.0], a1 * a ** np.arange(top)])
        tokens = np.cumsum(survival)[1:]
        cost = self.cost(pending, np.arange(1, top + 1))
        if replays:
            # A rejection (chance 1 - s(n)) makes the next call feed again what waits now and the
            # tokens kept before the rejection: sum over i < n of i * (s(i) - s(i + 1)).
            rejected = survival[:-1] - survival[1:]
            kept = np.cumsum(np.arange(top) * rejected)
            cost = cost + self._slope * ((1 - survival[1:]) * pending + kept)
        if restart and self._charges_restarts:
            # Plain steps after the round start their pipeline again (see the module's text).
            cost = cost + self._ends[0] / self._ends[1] * statistics.median(self._restarts)
        rates = tokens / np.maximum(cost, 1e-9)
        best = int(np.argmax(rates))
        # Drafting must beat plain steps by more than rounding to be chosen.
        return best + 1 if rates[best] > best_rate * (1 + 1e-9) else 0

    def record(
        self, drafted: int, accepted: int, fed: int, steps: int, seconds: float, label: int = 0
    ) -> None:
        """What one round did and cost.

        Args:
            drafted (int): draft tokens verified.
            accepted (int): how many of them were kept.
            fed (int): tokens the target scored (the waiting ones and the drafts).
            steps (int): the drafter's model calls (folded into the slope of a draft token).
            seconds (float): the round's time, from proposing to reading the result.
            label (int): the proposal's label.
        """
        self._kept_all = drafted > 0 and accepted == drafted
        self._after_round = drafted > 0
        # A round without drafts is a plain step (where there are no stretches).
        self._plain_since = self._plain_since + 1 if drafted == 0 else 0
        if drafted:
            self.shadow(accepted, drafted, label)
        if self.adaptive:
            self._rounds.append((fed - drafted, drafted, seconds))
            self._fit()

    def record_plain(self, seconds: float) -> None:
        """The seconds a token took in a stretch of plain steps (which drafting must beat)."""
        self._plain.append(seconds)

    def record_restart(self, seconds: float) -> None:
        """The seconds the first step of a stretch of plain steps took, which waits for its own
        host work; its excess over a plain step is what a round costs more when plain steps
        follow it (counted once plain steps were measured)."""
        if self._plain:
            self._restarts.append(max(seconds - statistics.median(self._plain), 0.0))

    def ran_plain(self, steps: int) -> None:
        """Counts ``steps`` plain steps run (a stretch, measured or cut short)."""
        self._plain_since += steps
        if steps:
            self._after_round = False

    def no_proposal(self) -> None:
        """Tells that the drafter had nothing to propose: plain steps follow."""
        if self._after_round:
            self._followed(True)

    def _followed(self, by_plain: bool) -> None:
        """Counts whether plain steps followed the last round, which was followed by a choice."""
        _add(self._ends, int(by_plain), 1)
        self._after_round = False

    def measured(self) -> Measured:
        """Measured: what the rounds and plain steps cost so far and the acceptance estimates
        (a copy), to keep for the next generation (see :func:`keep`)."""
        first = {label: tuple(counts) for label, counts in self._first.items()}
        return Measured(
            list(self._rounds), list(self._plain), first, tuple(self._later), list(self._restarts)
        )

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
        self._base = statistics.median((seconds - self._slope * x).tolist())

    def shadow(self, accepted: int, tested: int, label: int = 0) -> None:
        """Counts ``tested`` draft tokens of a proposal labelled ``label``, of which the first
        ``accepted`` were kept, the rest not reached after a rejection (also for a proposal checked
        against the emitted text)."""
        first = self._first.setdefault(label, [_PRIOR_KEPT, _PRIOR_TESTED])
        _add(first, accepted > 0, 1)
        if accepted and tested > 1:
            later = accepted - 1
            _add(self._later, later, later + (accepted < tested))


def _weighed(kept: float, tested: float) -> list[float]:
    """``[kept, tested]`` scaled to weigh at most ``_KEPT_TESTED`` tested tokens."""
    scale = min(1.0, _KEPT_TESTED / tested) if tested > 0 else 1.0
    return [kept * scale, tested * scale]


def _add(estimate: list[float], kept: int, tested: int) -> None:
    """Adds ``kept`` successes of ``tested`` trials to ``[kept, tested]``, older ones decayed."""
    estimate[0] = estimate[0] * _ACCEPT_DECAY + kept
    estimate[1] = estimate[1] * _ACCEPT_DECAY + tested


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half the weight lies: a pair of rounds that differ by more tokens
    measures the slope with less noise, so it weighs more."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])
