"""Draft-length policies: Fixed, and Adaptive's choice from its acceptance estimates and a
calibration of what rounds and plain steps cost (given, or measured once)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPT, run
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_spec.batch_length import BatchAdaptive
from mlx_spec.draft_length import (
    EXPLORE,
    MAX_DRAFT_TOKENS,
    Adaptive,
    Calibration,
    DraftPolicy,
    Fixed,
    Outcome,
    Round,
)

# A GPU-like machine: a round costs 1.5 plain steps and each draft token a tenth of one.
FLAT = Calibration(plain=1.0, round=1.5, token=0.1)
# A CPU that scores every position: each draft token costs most of a plain step.
STEEP = Calibration(plain=1.0, round=0.3, token=0.8)


def kept_with(policy: Adaptive, rate: float, rounds: int = 60, label: int = 0) -> None:
    """Tells ``policy`` of ``rounds`` rounds of 4 drafts whose tokens are kept at ``rate``
    (deterministically: a fixed stream of uniforms)."""
    uniforms = iter(np.random.default_rng(0).random(rounds * 4))
    for _ in range(rounds):
        kept = 0
        while kept < 4 and next(uniforms) < rate:
            kept += 1
        policy.observe(Outcome(4, kept, label))


def best_by_hand(rate: float, costs: Calibration, top: int) -> int:
    """The N that maximises E(N) / cost(N), from the formulas written out again."""
    rates = [1 / costs.plain]
    for n in range(1, top + 1):
        expected = sum(rate**i for i in range(n + 1))
        rates.append(expected / (costs.round + costs.token * n))
    return int(np.argmax(rates))


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
@pytest.mark.parametrize("rate", [0.2, 0.5, 0.8, 0.95])
def test_adaptive_takes_the_length_of_the_most_tokens_per_second(costs, rate) -> None:
    policy = Adaptive(8, calibration=costs, decay=1.0)
    kept_with(policy, rate, rounds=400)
    estimated = policy.acceptance()
    assert estimated == pytest.approx(rate, abs=0.05)
    assert policy.choose(Round(cap=8)) == best_by_hand(estimated, costs, 8)


def test_adaptive_drafts_long_where_verification_is_flat_and_short_where_it_is_steep() -> None:
    flat, steep = Adaptive(8, FLAT), Adaptive(8, STEEP)
    for policy in (flat, steep):
        kept_with(policy, 0.85)
    assert flat.choose(Round(8)) >= 6
    assert 1 <= steep.choose(Round(8)) <= 3


def test_adaptive_runs_plain_steps_when_drafts_are_not_kept() -> None:
    policy = Adaptive(8, FLAT)
    assert policy.choose(Round(8)) > 0  # the prior: 2 of 3 kept
    kept_with(policy, 0.05)
    assert policy.choose(Round(8)) == 0


def test_plain_steps_that_test_nothing_bring_drafting_back_where_the_prior_pays() -> None:
    # A draft model's acceptance is seen in rounds alone: after a poor stretch, plain steps fade
    # the estimate back to the prior, and the policy drafts again to look.
    policy = Adaptive(8, FLAT)
    kept_with(policy, 0.05)
    steps = 0
    while policy.choose(Round(8)) == 0:
        policy.observe(Outcome(0, 0, plain=True, seconds=1.0))
        steps += 1
        assert steps < 200, policy.acceptance()
    assert steps > 10  # not at once: the poor stretch still counts for a while


# A round dear against a plain step (a small target on a GPU): drafting at the prior (2 kept of 3)
# does not pay, drafting at 90% does.
DEAR = Calibration(plain=1.0, round=2.5, token=0.2)


def test_where_the_prior_does_not_pay_a_test_round_comes_after_its_cost_in_plain_steps() -> None:
    policy = Adaptive(8, DEAR)
    kept_with(policy, 0.05)
    # A round of 8 costs 4.1 plain steps, 3.1 more than one: tested after 32 x 3.1 of them.
    patience = math.ceil(EXPLORE * (2.5 + 0.2 * 8 - 1.0) / 1.0)
    for _ in range(2):
        steps = 0
        while (n := policy.choose(Round(8))) == 0:
            policy.observe(Outcome(0, 0, plain=True))
            steps += 1
            assert steps <= patience, steps
        assert (steps, n) == (patience, 8)
        # Only where the round may take the most (so never more than the round may take): with
        # fewer tokens left, drafting could not win back what the test costs.
        assert [policy.choose(Round(cap)) for cap in (3, 7)] == [0, 0]
        # The test keeps nothing: plain steps again, until the next test.
        policy.observe(Outcome(8, 0))
        assert policy.choose(Round(8)) == 0
    # A test whose drafts are all kept brings drafting back.
    for _ in range(patience):
        policy.observe(Outcome(0, 0, plain=True))
    assert policy.choose(Round(8)) == 8
    policy.observe(Outcome(8, 8))
    assert policy.acceptance() > 0.9 and policy.choose(Round(8)) > 0


def test_guesses_tested_during_plain_steps_leave_no_test_round_due() -> None:
    # Prompt lookup tests a guess each plain step: its estimate stays measured, and wrong
    # guesses keep it taking plain steps.
    policy = Adaptive(8, DEAR)
    for _ in range(1000):
        assert policy.choose(Round(8)) == 0
        policy.observe(Outcome(1, 0, plain=True))
    # A step without a guess starts the count.
    policy.observe(Outcome(0, 0, plain=True))
    assert policy.choose(Round(8)) == 0


@settings(max_examples=300)
@given(
    plain=st.floats(0.1, 10.0),
    round_=st.floats(0.0, 20.0),
    token=st.floats(0.0, 5.0),
    top=st.integers(1, MAX_DRAFT_TOKENS),
    pending=st.integers(1, 9),
    tested=st.integers(0, 400),
    kept=st.floats(0.0, 1.0),
)
def test_adaptive_chooses_as_the_rule_does_at_every_estimate(
    plain, round_, token, top, pending, tested, kept
) -> None:
    # Adaptive's plain-Python sums must choose as E(N) / cost(N), written out again with NumPy,
    # does at every estimate, calibration, cap and count of waiting tokens.
    costs = Calibration(plain=plain, round=round_, token=token)
    policy = Adaptive(MAX_DRAFT_TOKENS, costs, decay=1.0)
    if tested:
        policy.observe(Outcome(tested, round(kept * tested)))
    rate = policy.acceptance()
    rates = [1 / plain]
    for n in range(1, top + 1):
        cost = max(round_ + token * (n + pending - 1), 1e-12)
        rates.append(sum(rate**i for i in range(n + 1)) / cost)
    best = int(np.argmax(rates))
    if best != int(np.argmax(np.round(rates, 9))):
        return  # a tie within rounding: either is the rule's
    assert policy.choose(Round(cap=top, pending=pending)) == best


def test_adaptive_never_drafts_more_than_the_round_may() -> None:
    policy = Adaptive(8, FLAT)
    kept_with(policy, 0.99)
    assert [policy.choose(Round(cap)) for cap in (0, 1, 3, 20)] == [0, 1, 3, 8]


def test_acceptance_is_estimated_for_each_label_apart() -> None:
    # Prompt lookup: proposals from long n-grams are kept, those from one token are not.
    policy = Adaptive(8, FLAT)
    kept_with(policy, 0.95, label=3)
    kept_with(policy, 0.05, label=1)
    assert policy.acceptance(3) > 0.85 and policy.acceptance(1) < 0.15
    assert policy.choose(Round(8, label=3)) >= 6
    assert policy.choose(Round(8, label=1)) == 0


def test_guesses_checked_during_plain_steps_count_as_tested() -> None:
    policy = Adaptive(8, FLAT)
    for _ in range(100):
        policy.observe(Outcome(1, 1, label=2, seconds=1.0, plain=True))
    assert policy.acceptance(2) > 0.9


def test_older_tokens_weigh_less() -> None:
    forgetting, remembering = Adaptive(8, FLAT), Adaptive(8, FLAT, decay=1.0)
    for policy in (forgetting, remembering):
        kept_with(policy, 0.95, rounds=200)
        kept_with(policy, 0.1, rounds=60)
    assert forgetting.acceptance() < 0.3 < remembering.acceptance()


def test_waiting_tokens_make_a_round_dearer() -> None:
    policy = Adaptive(8, STEEP)
    kept_with(policy, 0.7)
    assert policy.choose(Round(8, pending=6)) < policy.choose(Round(8, pending=1))


def measure(policy: Adaptive, kept=lambda n: n) -> list[int]:
    """Serves ``policy`` rounds that cost ``2 + 0.5 N`` seconds and keep ``kept(N)`` tokens, and
    plain steps of 1 second, until its calibration is fixed (40 at most); returns its choices."""
    choices = []
    for _ in range(40):
        n = policy.choose(Round(8))
        choices.append(n)
        if n:
            policy.observe(Outcome(n, kept(n), seconds=2.0 + 0.5 * n))
        else:
            policy.observe(Outcome(0, 0, seconds=1.0, plain=True))
        if policy.calibration is not None:
            break
    return choices


def test_adaptive_measures_its_calibration_once_then_keeps_it() -> None:
    # Rounds cost 2 + 0.5 N seconds and plain steps 1 second: the measuring rounds draft the
    # most and one token in turn, then plain steps run until enough are timed.
    policy = Adaptive(8)
    choices = measure(policy, kept=lambda n: n // 2)
    assert choices[:8] == [8, 1, 8, 1, 8, 1, 8, 1]
    assert set(choices[8:]) == {0}
    assert policy.calibration == Calibration(plain=1.0, round=pytest.approx(2.0), token=0.5)
    # Kept: later times change nothing.
    policy.observe(Outcome(8, 4, seconds=100.0))
    assert policy.calibration.token == 0.5


def test_rounds_cut_short_by_the_tokens_left_do_not_end_the_measuring() -> None:
    # A first generation of 8 tokens (as a warm-up runs) leaves each round fewer to draft: its
    # rounds land at lengths 7, 1, 5, 1, 2, ... of one or two samples each. The measuring goes on
    # into the next generation until one token and one longer length have enough; it used to
    # stop after eight rounds of any lengths and then take plain steps for ever, never drafting
    # again (benchmarks/generation.py, 16 x 2048 pair on a GPU: 0.59x the best fixed N).
    policy = Adaptive(8)
    left = 8
    while left > 1:
        n = policy.choose(Round(left - 1))
        policy.observe(Outcome(n, n, seconds=2.0 + 0.5 * n, plain=n == 0))
        left -= n + 1
    measure(policy)
    assert policy.calibration == Calibration(plain=1.0, round=pytest.approx(2.0), token=0.5)
    # Every draft token kept so far: the best N drafts the most.
    assert policy.choose(Round(8)) == 8


def test_the_plain_steps_measured_are_those_after_the_rounds() -> None:
    # Prompt lookup may find nothing to propose for long before its first rounds: the plain
    # steps timed then (here at 3 s, the machine busier) give way to those after the rounds.
    policy = Adaptive(8)
    for _ in range(1000):
        policy.observe(Outcome(0, 0, seconds=3.0, plain=True))
    measure(policy)
    assert policy.calibration == Calibration(plain=1.0, round=pytest.approx(2.0), token=0.5)


def test_the_first_measurement_at_each_length_and_first_plain_steps_are_left_out() -> None:
    # A compilation makes each length's first round slow, and a stretch's first step waits for
    # its own host work: neither moves the calibration.
    policy = Adaptive(4)
    for i in range(8):
        n = policy.choose(Round(4))
        slow = 50.0 if i < 2 else 0.0
        policy.observe(Outcome(n, 0, seconds=1.0 + 0.25 * n + slow))
    for i in range(9):
        policy.observe(Outcome(0, 0, seconds=9.0 if i == 0 else 0.5, plain=True, first=i == 0))
    assert policy.calibration == Calibration(0.5, pytest.approx(1.0), pytest.approx(0.25))


def test_fixed_always_drafts_n_and_flushes_replays_that_grew() -> None:
    fixed = Fixed(3)
    assert [fixed.choose(Round(cap)) for cap in (0, 2, 64)] == [0, 2, 3]
    assert fixed.choose(Round(64, pending=4, replays=True)) == 3
    assert fixed.choose(Round(64, pending=5, replays=True)) == 0
    assert fixed.choose(Round(64, pending=5, replays=False)) == 3


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Fixed(-1), r"Fixed: `n`"),
        (lambda: Fixed(MAX_DRAFT_TOKENS + 1), r"Fixed: `n`"),
        (lambda: Fixed(True), r"Fixed: `n`"),
        (lambda: Adaptive(0), r"Adaptive: `most`"),
        (lambda: Adaptive(2.0), r"Adaptive: `most`"),
        (lambda: Adaptive(4, calibration=(1, 2, 3)), r"Adaptive: `calibration`"),
        (lambda: Adaptive(4, decay=0.0), r"Adaptive: `decay`"),
        (lambda: Adaptive(4, decay="0.9"), r"Adaptive: `decay`"),
        (lambda: Adaptive(4, decay=float("nan")), r"Adaptive: `decay`"),
        (lambda: BatchAdaptive(0), r"BatchAdaptive: `most`"),
        (lambda: BatchAdaptive(4, decay=2.0), r"BatchAdaptive: `decay`"),
        (lambda: BatchAdaptive(4, {0: FLAT}), r"BatchAdaptive: `calibrations` .* key 0"),
        (lambda: BatchAdaptive(4, {2: (1, 2, 3)}), r"BatchAdaptive: `calibrations\[2\]`"),
    ],
)
def test_policy_arguments_are_checked(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_both_policies_are_draft_policies() -> None:
    assert isinstance(Fixed(2), DraftPolicy) and isinstance(Adaptive(), DraftPolicy)
    assert not isinstance(object(), DraftPolicy)


def test_a_calibrated_adaptive_generation_is_deterministic(target, drafts) -> None:
    # Given its costs, the policy's choices follow the text alone: the same rounds every run.
    runs = []
    for _ in range(2):
        policy = Adaptive(6, calibration=Calibration(1.0, 1.2, 0.05))
        _, flags, stats = run(PROMPT, target, drafts["truncated"], policy=policy, max_tokens=80)
        runs.append((flags, stats.rounds, stats.drafted_at))
    assert runs[0] == runs[1]
    assert runs[0][2] and len(runs[0][2]) > 1


class Asked:
    """A policy that answers a plain step every time, keeping what it was asked."""

    def __init__(self) -> None:
        self.rounds: list[Round] = []

    def choose(self, round: Round) -> int:
        self.rounds.append(round)
        return 0

    def observe(self, outcome: Outcome) -> None:
        pass


class Stretches(Adaptive):
    """:class:`Adaptive` counting the stretches of plain steps it is told of."""

    stretches = 0

    def observe(self, outcome: Outcome) -> None:
        self.stretches += outcome.first
        super().observe(outcome)


def test_a_stretch_asks_about_the_round_that_would_follow_it(target, drafts) -> None:
    # Between a stretch's steps the step ahead has fed the last token; a round chosen there
    # runs once that step is read, one token later, with that token waiting, as every round
    # after a plain step.
    asked = Asked()
    run(PROMPT, target, drafts["truncated"], policy=asked, max_tokens=40)
    assert len(asked.rounds) >= 38  # asked between the steps, not only before the stretch
    assert {r.pending for r in asked.rounds} == {1}
    # Before the stretch 40 tokens are left (39 to draft); after its step m, the round would
    # follow the step ahead, with 40 - m - 1 left.
    assert [r.cap for r in asked.rounds] == [39] + [38 - m for m in range(1, 38)]


def test_a_policy_between_the_costs_of_waiting_tokens_keeps_its_stretch(target, drafts) -> None:
    # A round of one draft costs 1.7 plain steps with the last token waiting, 1.2 without: at
    # the prior's acceptance (2 of 3) plain steps pay. Asked as if no token waited, the policy
    # drafted between two steps and stepped again after them: a stretch every two tokens.
    policy = Stretches(1, calibration=Calibration(plain=1.0, round=1.2, token=0.5))
    _, _, stats = run(PROMPT, target, drafts["unrelated"], policy=policy, max_tokens=60)
    # What remains are the test rounds that plain steps testing nothing bring (one after 23 of
    # them here, EXPLORE), each followed by a stretch.
    tested = stats.drafted_at[0] if stats.drafted_at else 0
    assert tested <= 3 and policy.stretches <= tested + 1


def test_an_adaptive_policy_kept_for_the_next_generation_keeps_its_calibration(
    target, drafts
) -> None:
    policy = Adaptive(4)
    run(PROMPT, target, drafts["truncated"], policy=policy, max_tokens=60)
    measured = policy.calibration
    assert measured is not None and measured.plain > 0
    run(PROMPT, target, drafts["truncated"], policy=policy, max_tokens=30)
    assert policy.calibration is measured


def test_policy_and_adaptive_are_exclusive(target) -> None:
    with pytest.raises(ValueError, match="`adaptive=True` or a `policy`, not both"):
        run(PROMPT, target, None, drafter="prompt-lookup", adaptive=True, policy=Fixed(2))
    with pytest.raises(ValueError, match="`policy` must be a DraftPolicy"):
        run(PROMPT, target, None, drafter="prompt-lookup", policy=3)


def test_the_adaptive_shorthand_caps_the_policy_at_num_draft_tokens(target) -> None:
    _, _, stats = run(
        PROMPT, target, None, drafter="prompt-lookup", adaptive=True, num_draft_tokens=2,
        max_tokens=120, key=mx.random.key(0),
    )  # fmt: skip
    assert len(stats.drafted_at) <= 2


def batch_rows(policy: BatchAdaptive, rates: list[float], caps: list[int]) -> list:
    """One row a rate: its estimate told 400 rounds kept at that rate, and its situation."""
    rows = []
    for rate, cap in zip(rates, caps, strict=True):
        estimate = policy.sequence()
        estimate.decay = 1.0
        kept_with(estimate, rate, rounds=400)
        rows.append((estimate, Round(cap)))
    return rows


def batch_best_by_hand(rows: list, costs: Calibration, top: int) -> int:
    """The N that maximises the batch's expected tokens over the round's cost, written out."""
    rates = [len(rows) / costs.plain]
    for n in range(1, top + 1):
        tokens = sum(sum(e.acceptance() ** i for i in range(min(n, r.cap) + 1)) for e, r in rows)
        rates.append(tokens / (costs.round + costs.token * n))
    return int(np.argmax(rates))


@pytest.mark.parametrize("rates", [[0.9, 0.1], [0.5, 0.5, 0.95, 0.2], [0.99]])
@pytest.mark.parametrize("caps", [[8, 8, 8, 8], [2, 8, 0, 5]])
def test_a_batch_takes_the_length_of_the_most_tokens_per_second(rates, caps) -> None:
    costs = Calibration(plain=2.0, round=2.6, token=0.7)
    policy = BatchAdaptive(8, {len(rates): costs})
    rows = batch_rows(policy, rates, caps[: len(rates)])
    want = batch_best_by_hand(rows, costs, min(8, max(r.cap for _, r in rows)))
    assert policy.choose(rows) == want


def test_a_batch_drafts_at_the_sizes_where_it_pays_and_not_at_others() -> None:
    # A plain step of 4 rows costs little more than one of 1 row; a round of 4 rows costs 4
    # times one of 1 row, as where every scored position is computed.
    small = Calibration(plain=1.0, round=1.1, token=0.1)
    large = Calibration(plain=1.2, round=4.0, token=1.0)
    policy = BatchAdaptive(4, {1: small, 4: large})
    assert policy.choose(batch_rows(policy, [0.8], [4])) > 0
    assert policy.choose(batch_rows(policy, [0.8] * 4, [4] * 4)) == 0


def test_a_batch_with_nothing_to_draft_takes_plain_steps_even_while_measuring() -> None:
    policy = BatchAdaptive(4)
    assert policy.choose(batch_rows(policy, [0.9, 0.9], [0, 0])) == 0


def test_a_batch_measures_each_size_once_then_keeps_it() -> None:
    policy = BatchAdaptive(4)
    rows = batch_rows(policy, [0.9, 0.9], [4, 4])
    lengths = []
    while 2 not in policy.calibrations:
        n = policy.choose(rows)
        lengths.append(n)
        # A round of n drafts costs 1 + 0.5 n seconds; a plain step 0.8 (its first 5).
        first = n == 0 and lengths[-2:-1] != [0]
        seconds = (5.0 if first else 0.8) if n == 0 else 1.0 + 0.5 * n
        policy.observe(2, Outcome(n, 0, seconds=seconds, plain=n == 0, first=first))
        assert len(lengths) < 40
    assert lengths[:8] == [4, 1] * 4 and set(lengths[8:]) == {0}
    assert policy.calibrations[2] == Calibration(plain=0.8, round=1.0, token=0.5)
    assert 3 not in policy.calibrations and policy.choose(batch_rows(policy, [0.9] * 3, [4] * 3))
    policy.observe(2, Outcome(4, 0, seconds=100.0))
    assert policy.calibrations[2] == Calibration(plain=0.8, round=1.0, token=0.5)


def test_a_batch_whose_rows_test_nothing_runs_a_test_round_after_its_cost_in_plain_steps() -> None:
    policy = BatchAdaptive(8, {2: DEAR})
    rows = batch_rows(policy, [0.05, 0.05], [8, 5])
    assert policy.choose(rows) == 0
    patience = math.ceil(EXPLORE * (2.5 + 0.2 * 8 - 1.0) / 1.0)
    for _ in range(patience - 1):
        policy.observe(2, Outcome(0, 0, plain=True))
    assert policy.choose(rows) == 0
    # A row's guess tested (drafted: the rows that guessed) starts the count again.
    policy.observe(2, Outcome(1, 0, plain=True))
    for _ in range(patience - 1):
        policy.observe(2, Outcome(0, 0, plain=True))
        assert policy.choose(rows) == 0
    policy.observe(2, Outcome(0, 0, plain=True))
    assert policy.choose(rows) == 8
    # Only where some row may draft the most: the tokens left would not win back the test.
    assert policy.choose(batch_rows(policy, [0.05, 0.05], [7, 5])) == 0
    policy.observe(2, Outcome(8, 0))
    assert policy.choose(rows) == 0
