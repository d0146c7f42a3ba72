"""Distribution tests: the tokens ``accept_sampled`` emits have the target's distribution.

Each test runs ``accept_sampled`` under ``mx.vmap`` over fixed keys
(``mx.random.split(mx.random.key(1234), n)``) on a small vocabulary (V = 6, N = 3), in two
scenarios: drafts drawn from ``q`` with keys split from another root key (``mx.random.key(4321)``),
and a fixed deterministic draft (``draft_probs=None``). With rows that do not depend on the context,
the emitted tokens are independent and token ``i`` follows ``p_i``, also given that the ``i``
previous ones were accepted draft tokens; the acceptance rate at a position reached is
``sum(min(p_i, q_i))``. With ``--full``, two more tests force the outcome of a one-token draft on a
vocabulary of 4099 tokens (a prime, so no block length divides it) and check the draw of ``next``
from the residual and from ``p_N`` token by token.

Token distributions are judged with ``scipy.stats.chisquare`` on the support of ``p_i`` (a token
outside it fails at once; tokens expected fewer than 20 times share a cell): a test passes when
the p-value is above ``1e-4``. Acceptance rates pass within 5 binomial standard deviations. Every
test has a negative control beside it: a wrong acceptance rule, written here in MLX and run
through the same harness, that must give a p-value below ``1e-6`` (or a rate beyond 5 standard
deviations) at the same sample size:

- ``residual_abs``: ``norm(|p - q|)`` instead of ``norm(max(p - q, 0))`` (a residual without
  the clipping, still a distribution);
- ``residual_p``: ``next`` drawn from ``p_a`` after a rejection (a residual that does not
  subtract ``q``);
- ``slack``: acceptance ``u < p / q + 0.01``;
- ``bonus_off_by_one``: after a fully accepted draft, ``next`` drawn from ``p_{N-1}``;
- ``residual_tilted`` (large vocabulary only): ``norm(max(p - q, 0) ** 1.1)``, the right support
  with weights a little off.

The sample sizes come from a power calculation, which ``test_each_control_fails_with_power``
repeats: each wrong rule's distribution of the token at a position is known in closed form
(:func:`wrong_distribution`), so the chi-square statistic it gives at ``n`` draws is noncentral
chi-square with noncentrality ``n * sum((p_wrong - p)**2 / p)``, and its acceptance rate is a
binomial. The weakest control, ``slack`` at position 2 of the drafted scenario, moves the token's
distribution by ``sum((p_wrong - p)**2 / p) = 0.0009`` (5 degrees of freedom); about 85% of the
steps reach position 2, so 101_000 keys give it a 0.999 chance to fall below ``1e-6``, and
:data:`KEYS` ``= 110_000`` gives every control at every position at least that power. The
positive tests use the same keys: at that size they would see each control's error with that
power. On the large vocabulary the weakest control, ``residual_tilted``, moves the residual by
``0.009`` over about 640 cells at 40_000 keys: power 0.9998 (:data:`LARGE_KEYS`).

The small rows were chosen so that each control moves the tested distribution far beyond the
threshold while about 90% of draft tokens are accepted, so that deep positions are reached.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from mlx_spec import accept_sampled

# Keys for every test of the small rows, the quick ones and the --full ones alike (one run per
# rule and scenario): the least that gives each negative control at each position a chance of at
# least POWER to fail (the module's docstring; test_each_control_fails_with_power checks it).
KEYS = 110_000
PASS = 1e-4  # a correct rule passes when the p-value is above this
FAIL = 1e-6  # a negative control must give a p-value below this
SIGMAS = 5.0  # acceptance rates: the binomial confidence interval
POWER = 0.999  # the chance each negative control has to fail at the sample size used

Accept = Callable[[mx.array, mx.array, mx.array | None, mx.array], mx.array]


@dataclass(frozen=True)
class Scenario:
    """One verification step's rows and how its draft is made.

    Attributes:
        probs (np.ndarray): ``[N + 1, V]`` float32 target distributions ``p``.
        draft_probs (np.ndarray or None): ``[N, V]`` float32 drafter distributions ``q`` the draft
            is sampled from; ``None`` for the fixed ``draft``.
        draft (tuple of int or None): the fixed deterministic draft, ``[N]``.
    """

    probs: np.ndarray
    draft_probs: np.ndarray | None
    draft: tuple[int, ...] | None

    def q(self) -> np.ndarray:
        """``[N, V]`` float64: ``q``, or a point mass on each token of the fixed draft."""
        if self.draft_probs is not None:
            return self.draft_probs.astype(np.float64)
        return np.eye(self.probs.shape[1])[list(self.draft)]


# p_i = 0.9 q_i + 0.1 w_i: the residual max(p_i - q_i, 0) spreads over three tokens, one of which
# both distributions share; row 0 has a token neither can emit.
_Q = np.array(
    [
        [0.4, 0.3, 0.2, 0.1, 0.0, 0.0],
        [0.1, 0.0, 0.3, 0.0, 0.2, 0.4],
        [0.0, 0.25, 0.0, 0.35, 0.15, 0.25],
    ]
)
_W = np.array(
    [
        [0.0, 0.0, 0.0, 0.3, 0.7, 0.0],
        [0.0, 0.5, 0.0, 0.3, 0.0, 0.2],
        [0.6, 0.0, 0.2, 0.0, 0.2, 0.0],
    ]
)
_BONUS = [0.1, 0.2, 0.3, 0.15, 0.05, 0.2]
SCENARIOS = {
    "drafted": Scenario(
        probs=np.vstack([0.9 * _Q + 0.1 * _W, [_BONUS]]).astype(np.float32),
        draft_probs=_Q.astype(np.float32),
        draft=None,
    ),
    # Each fixed draft token has p = 0.9 at its position.
    "deterministic": Scenario(
        probs=np.array(
            [
                [0.9, 0.04, 0.03, 0.02, 0.01, 0.0],
                [0.03, 0.0, 0.9, 0.04, 0.02, 0.01],
                [0.01, 0.02, 0.0, 0.04, 0.03, 0.9],
                _BONUS,
            ],
            dtype=np.float32,
        ),
        draft_probs=None,
        draft=(0, 2, 5),
    ),
}
N = 3


# ---------------------------------------------------------------------------------------------
# Wrong acceptance rules, for the negative controls (vmappable, like the real one).


def _clipped(p: mx.array, q: mx.array) -> mx.array:
    return mx.maximum(p - q, 0.0)


def _absolute(p: mx.array, q: mx.array) -> mx.array:
    return mx.abs(p - q)


def _target(p: mx.array, q: mx.array) -> mx.array:
    return p


def _tilted(p: mx.array, q: mx.array) -> mx.array:
    # The right support, weights off by a factor r ** 0.1 (a few tenths on a large vocabulary).
    return mx.maximum(p - q, 0.0) ** 1.1


def make_wrong_accept(
    residual: Callable[[mx.array, mx.array], mx.array], slack: float = 0.0, bonus_shift: int = 0
) -> Accept:
    """A rejection-sampling rule with one deliberate change.

    Args:
        residual: ``(p, q) -> r``, ``[N, V]`` unnormalised rows ``next`` is drawn from after a
            rejection (``p`` itself where ``r`` has no mass).
        slack: draft token ``i`` is accepted when ``u_i < p_i(d_i) / q_i(d_i) + slack``.
        bonus_shift: after a fully accepted draft, ``next`` is drawn from ``p_{N - bonus_shift}``.

    Returns:
        ``accept(probs, draft, draft_probs, key)`` -> ``[3]`` uint32 ``[accepted, next, 0]``.
    """

    def accept(
        probs: mx.array, draft: mx.array, draft_probs: mx.array | None, key: mx.array
    ) -> mx.array:
        n, v = draft.shape[0], probs.shape[1]
        if draft_probs is None:
            q = (mx.arange(v)[None, :] == draft[:, None]).astype(mx.float32)
        else:
            q = draft_probs
        k_accept, k_next = mx.random.split(key)
        u = mx.random.uniform(shape=(n,), key=k_accept)
        at = draft.reshape(n, 1)
        p_d = mx.take_along_axis(probs[:n], at, axis=-1).reshape(n)
        q_d = mx.take_along_axis(q, at, axis=-1).reshape(n)
        ok = u * q_d < p_d + slack * q_d
        accepted = mx.cumprod(ok.astype(mx.uint32)).sum()
        r = residual(probs[:n], q)
        mass = r.sum(axis=-1, keepdims=True)
        r = mx.where(mass > 0, r / mx.maximum(mass, 1e-30), probs[:n])
        rows = mx.concatenate([r, probs[n - bonus_shift : n + 1 - bonus_shift]])
        following = mx.random.categorical(mx.log(mx.take(rows, accepted, axis=0)), key=k_next)
        return mx.stack([accepted, following.astype(mx.uint32), mx.array(0, mx.uint32)])

    return accept


# Each wrong rule's change, which both its MLX version and its closed form (for the power
# calculation) are built from.
WRONG: dict[str, dict] = {
    "residual_abs": {"residual": _absolute},
    "residual_p": {"residual": _target},
    "residual_tilted": {"residual": _tilted},
    "slack": {"residual": _clipped, "slack": 0.01},
    "bonus_off_by_one": {"residual": _clipped, "bonus_shift": 1},
}
ACCEPTS: dict[str, Accept] = {
    "mlx_spec": lambda probs, draft, draft_probs, key: accept_sampled(
        probs, draft, draft_probs, None, key
    ),
    **{name: make_wrong_accept(**change) for name, change in WRONG.items()},
}
RESIDUAL_AND_ACCEPTANCE_BUGS = ("residual_abs", "residual_p", "slack")


# ---------------------------------------------------------------------------------------------
# The harness.


@cache
def emitted(rule: str, scenario: str, n_keys: int) -> np.ndarray:
    """Runs ``rule`` on ``scenario`` for ``n_keys`` fixed keys, batched with ``mx.vmap``.

    Returns:
        np.ndarray: ``[n_keys, N + 1]`` int64, the tokens emitted at positions ``0..N`` (the
        accepted draft tokens, then ``next``), ``-1`` after them.
    """
    case = SCENARIOS[scenario]
    accept = ACCEPTS[rule]
    probs = mx.array(case.probs)
    keys = mx.random.split(mx.random.key(1234), n_keys)
    if case.draft_probs is None:
        draft = mx.array(case.draft, dtype=mx.uint32)
        drafts = mx.broadcast_to(draft, (n_keys, N))
        out = mx.vmap(lambda k: accept(probs, draft, None, k))(keys)
    else:
        q = mx.array(case.draft_probs)
        draft_keys = mx.random.split(mx.random.key(4321), n_keys)
        drafts = mx.vmap(lambda k: mx.random.categorical(mx.log(q), key=k))(draft_keys)
        out = mx.vmap(lambda d, k: accept(probs, d, q, k))(drafts, keys)
    out, drafts = np.array(out).astype(np.int64), np.array(drafts).astype(np.int64)
    accepted, following = out[:, 0], out[:, 1]
    position = np.arange(N + 1)[None, :]
    tokens = np.where(position < accepted[:, None], np.pad(drafts, ((0, 0), (0, 1))), -1)
    return np.where(position == accepted[:, None], following[:, None], tokens)


def fit_pvalue(tokens: np.ndarray, p: np.ndarray, min_expected: float = 20.0) -> float:
    """Chi-square goodness-of-fit p-value of ``tokens`` (``[n]``) against ``p`` (``[V]``).

    Tokens of ``p``'s support expected fewer than ``min_expected`` times share one cell; a token
    outside the support gives 0.
    """
    p = p.astype(np.float64) / p.astype(np.float64).sum()
    if not np.isin(tokens, np.flatnonzero(p > 0)).all():
        return 0.0
    counts = np.bincount(tokens, minlength=p.shape[0])
    expected = p * tokens.shape[0]
    own = expected >= min_expected
    rest = (p > 0) & ~own
    observed, expected = counts[own], expected[own]
    if rest.any():
        observed = np.append(observed, counts[rest].sum())
        expected = np.append(expected, tokens.shape[0] * p[rest].sum())
    return float(stats.chisquare(observed, expected).pvalue)


def token_pvalue(rule: str, scenario: str, n_keys: int, position: int) -> float:
    """The fit of the token emitted at ``position`` (given ``position`` accepted draft tokens)
    to ``p_position``."""
    tokens = emitted(rule, scenario, n_keys)[:, position]
    return fit_pvalue(tokens[tokens >= 0], SCENARIOS[scenario].probs[position])


def rate_sigmas(rule: str, scenario: str, n_keys: int, position: int) -> float:
    """How many binomial standard deviations the acceptance rate at ``position`` (among the steps
    that reach it) is above ``sum(min(p, q))`` there."""
    case = SCENARIOS[scenario]
    tokens = emitted(rule, scenario, n_keys)
    reached = tokens[:, position] >= 0
    accepted = (tokens[reached, position + 1] >= 0).sum()
    rate = np.minimum(case.probs[position].astype(np.float64), case.q()[position]).sum()
    n = reached.sum()
    return float((accepted - n * rate) / np.sqrt(n * rate * (1 - rate)))


# ---------------------------------------------------------------------------------------------
# The power calculation: what each rule emits, in closed form.


def _change(rule: str) -> dict:
    return {"residual": _clipped} if rule == "mlx_spec" else WRONG[rule]


def _residual(rule: str, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``[V]`` float64: the normalised row ``rule`` draws ``next`` from after a rejection."""
    r = np.array(_change(rule)["residual"](mx.array(p), mx.array(q)), dtype=np.float64)
    return r / r.sum() if r.sum() > 0 else p


def step_distribution(rule: str, p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, float]:
    """What ``rule`` emits at a draft position it reached, whose rows are ``p`` and ``q``
    (``[V]`` float64): ``[V]`` the token's distribution (the draft token ``d ~ q`` kept with
    probability ``a(d) = min(1, p(d) / q(d) + slack)``, else a draw of the residual), and the
    chance ``sum(q * a)`` that the draft token is kept."""
    slack = _change(rule).get("slack", 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        kept = np.where(q > 0, np.minimum(1.0, p / q + slack), 0.0)
    rate = float((q * kept).sum())
    return q * kept + (1 - rate) * _residual(rule, p, q), rate


def emitted_distribution(rule: str, scenario: str, position: int) -> tuple[np.ndarray, float]:
    """``[V]`` the distribution of the token ``rule`` emits at ``position`` of ``scenario``
    given that it got there, and the chance that it gets there."""
    case = SCENARIOS[scenario]
    p, q = case.probs.astype(np.float64), case.q()
    reach = 1.0
    for i in range(position):
        reach *= step_distribution(rule, p[i], q[i])[1]
    if position == N:
        return p[N - _change(rule).get("bonus_shift", 0)], reach
    return step_distribution(rule, p[position], q[position])[0], reach


def fit_power(wrong: np.ndarray, p: np.ndarray, draws: float, min_expected: float = 20.0) -> float:
    """The chance that :func:`fit_pvalue` of ``draws`` tokens drawn from ``wrong`` against ``p``
    (``[V]`` float64) is below :data:`FAIL`: a token outside ``p``'s support fails at once;
    otherwise the statistic over ``p``'s cells is noncentral chi-square, of noncentrality
    ``draws * sum((w - p)**2 / p)`` over the cells (``w``: ``wrong`` within the support)."""
    outside = wrong[p == 0].sum()
    if outside > 1 - 1e-9:
        return 1.0
    within = wrong / (1 - outside)
    own = p * draws >= min_expected
    rest = (p > 0) & ~own
    expected, drawn = p[own], within[own]
    if rest.any():
        expected, drawn = np.append(expected, p[rest].sum()), np.append(drawn, within[rest].sum())
    df = len(expected) - 1
    noncentrality = draws * float(((drawn - expected) ** 2 / expected).sum())
    chi2 = stats.ncx2.sf(stats.chi2.isf(FAIL, df), df, noncentrality)
    return float(1 - (1 - outside) ** draws * (1 - chi2))


def rate_power(rule: str, scenario: str, position: int, keys: int) -> float:
    """The chance that :func:`rate_sigmas` of ``rule`` at ``position`` exceeds :data:`SIGMAS`,
    the steps that reach it taken at their expected number."""
    case = SCENARIOS[scenario]
    p, q = case.probs[position].astype(np.float64), case.q()[position]
    right = np.minimum(p, q).sum()
    n = round(keys * emitted_distribution(rule, scenario, position)[1])
    rate = step_distribution(rule, p, q)[1]
    return float(stats.binom.sf(n * right + SIGMAS * np.sqrt(n * right * (1 - right)), n, rate))


def test_each_control_fails_with_power():
    """The power calculation behind :data:`KEYS` and :data:`LARGE_KEYS` (the module's
    docstring): every negative control, at every position its tests check, fails with a chance
    of at least :data:`POWER`. Guarded twice: the closed form gives ``p`` for the right rule,
    and the controls' first tokens fit their closed forms."""
    for scenario, case in SCENARIOS.items():
        for position in range(N + 1):
            right, _ = emitted_distribution("mlx_spec", scenario, position)
            np.testing.assert_allclose(right, case.probs[position], atol=1e-6)
        for rule in RESIDUAL_AND_ACCEPTANCE_BUGS:
            wrong, _ = emitted_distribution(rule, scenario, 0)
            first = emitted(rule, scenario, KEYS)[:, 0]
            assert fit_pvalue(first, wrong) > PASS, (scenario, rule)
    powers = {}
    for scenario, case in SCENARIOS.items():
        checked = [(rule, i) for rule in RESIDUAL_AND_ACCEPTANCE_BUGS for i in range(N)]
        for rule, position in [*checked, ("bonus_off_by_one", N)]:
            wrong, reach = emitted_distribution(rule, scenario, position)
            p = case.probs[position].astype(np.float64)
            powers[scenario, rule, position] = fit_power(wrong, p, KEYS * reach)
        for position in range(N):
            powers[scenario, "slack rate", position] = rate_power("slack", scenario, position, KEYS)
    for kind, rule in LARGE_CONTROLS:
        probs, draft_probs, _, follows = large_case(kind)
        p = probs.astype(np.float64)
        if kind == "accepted":
            wrong = p[1 - WRONG[rule].get("bonus_shift", 0)]
        else:
            wrong = _residual(rule, p[0], draft_probs[0].astype(np.float64))
        powers[kind, rule] = fit_power(wrong, follows, LARGE_KEYS)
    weak = {case: power for case, power in powers.items() if power < POWER}
    assert not weak, weak


# ---------------------------------------------------------------------------------------------
# Default run: position 0.


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_first_token_follows_p0(scenario):
    """110_000 keys: the first emitted token fits p_0 (chi-square p-value > 1e-4)."""
    assert token_pvalue("mlx_spec", scenario, KEYS, 0) > PASS


@pytest.mark.parametrize("rule", RESIDUAL_AND_ACCEPTANCE_BUGS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_first_token_test_rejects_wrong_rules(scenario, rule):
    """Negative control, 110_000 keys: a wrong rule's first token fails the fit (p < 1e-6)."""
    assert token_pvalue(rule, scenario, KEYS, 0) < FAIL


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_acceptance_rate_at_position_0_is_sum_min_p_q(scenario):
    """110_000 keys: the rate at which draft token 0 is accepted is sum(min(p_0, q_0)) within 5
    binomial standard deviations."""
    assert abs(rate_sigmas("mlx_spec", scenario, KEYS, 0)) < SIGMAS


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_acceptance_rate_test_rejects_slack(scenario):
    """Negative control, 110_000 keys: accepting when u < p / q + 0.01 lifts the rate at
    position 0 more than 5 standard deviations."""
    assert rate_sigmas("slack", scenario, KEYS, 0) > SIGMAS


# ---------------------------------------------------------------------------------------------
# --full: the deeper positions and the bonus token, from the same runs.


@pytest.mark.statistical
@pytest.mark.parametrize("position", range(1, N))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_token_after_i_accepted_follows_p_i(scenario, position):
    """110_000 keys: given ``position`` accepted draft tokens, the next emitted token fits
    p_position (chi-square p-value > 1e-4; over 90_000 steps reach position 2)."""
    assert token_pvalue("mlx_spec", scenario, KEYS, position) > PASS


@pytest.mark.statistical
@pytest.mark.parametrize("rule", RESIDUAL_AND_ACCEPTANCE_BUGS)
@pytest.mark.parametrize("position", range(1, N))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_token_after_i_accepted_test_rejects_wrong_rules(scenario, position, rule):
    """Negative control, 110_000 keys: a wrong rule fails the fit at ``position`` (p < 1e-6)."""
    assert token_pvalue(rule, scenario, KEYS, position) < FAIL


@pytest.mark.statistical
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_bonus_token_follows_pN(scenario):
    """110_000 keys: after a fully accepted draft the bonus token fits p_N (chi-square
    p-value > 1e-4; over 80_000 steps accept the whole draft)."""
    assert token_pvalue("mlx_spec", scenario, KEYS, N) > PASS


@pytest.mark.statistical
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_bonus_token_test_rejects_off_by_one(scenario):
    """Negative control, 110_000 keys: a bonus token drawn from p_{N-1} fails (p < 1e-6)."""
    assert token_pvalue("bonus_off_by_one", scenario, KEYS, N) < FAIL


@pytest.mark.statistical
@pytest.mark.parametrize("position", range(1, N))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_acceptance_rate_given_i_accepted_is_sum_min_p_q(scenario, position):
    """110_000 keys: among steps reaching ``position``, draft token ``position`` is accepted
    at the rate sum(min(p, q)) within 5 binomial standard deviations."""
    assert abs(rate_sigmas("mlx_spec", scenario, KEYS, position)) < SIGMAS


@pytest.mark.statistical
@pytest.mark.parametrize("position", range(1, N))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_acceptance_rate_given_i_accepted_test_rejects_slack(scenario, position):
    """Negative control, 110_000 keys: u < p / q + 0.01 lifts the rate at ``position`` more
    than 5 standard deviations."""
    assert rate_sigmas("slack", scenario, KEYS, position) > SIGMAS


# ---------------------------------------------------------------------------------------------
# --full: the draw of next on a large vocabulary of prime size (no block length divides it).

LARGE_V = 4099
# residual_tilted, the weakest control here, moves the residual by sum((r_wrong - r)**2 / r) =
# 0.009 over the cells of tokens expected 20 times or more (about 640 at this size): noncentrality
# 357, power 0.9998 against the 1e-6 threshold (test_each_control_fails_with_power). The others
# put mass outside the support, or move it far more.
LARGE_KEYS = 40_000
CHUNK = 5_000
LARGE_CONTROLS = [
    ("rejected", "residual_abs"),
    ("rejected", "residual_p"),
    ("rejected", "residual_tilted"),
    ("accepted", "bonus_off_by_one"),
]  # keys per vmapped call, to bound memory ([CHUNK, V] float32 is 80 MB)


def _softmax_with_zeros(rng: np.random.Generator, zeros: float) -> np.ndarray:
    x = rng.standard_normal(LARGE_V)
    x[rng.random(LARGE_V) < zeros] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


@cache
def large_case(kind: str) -> tuple[np.ndarray, np.ndarray | None, int, np.ndarray]:
    """A one-token draft on ``LARGE_V`` tokens whose outcome is forced.

    ``rejected``: ``p_0(d) = 0 < q_0(d)``, so ``d`` is always rejected and ``next`` follows
    ``norm(max(p_0 - q_0, 0))``. ``accepted``: ``p_0`` is a point mass on ``d`` (deterministic
    draft), so ``d`` is always accepted and ``next`` follows ``p_1``.

    Returns:
        tuple: ``probs`` ``[2, V]`` float32, ``draft_probs`` ``[1, V]`` float32 or ``None``, the
        draft token, and ``[V]`` float64 the distribution ``next`` must follow.
    """
    rng = np.random.default_rng(2024)
    p = np.stack([_softmax_with_zeros(rng, 0.3), _softmax_with_zeros(rng, 0.3)])
    d = int(np.flatnonzero(p[0] == 0)[0])
    if kind == "accepted":
        p[0] = np.eye(LARGE_V)[d]
        return p.astype(np.float32), None, d, p[1]
    q = _softmax_with_zeros(rng, 0.3)
    q[d] = q.max()
    q = (q / q.sum()).astype(np.float32)[None]
    probs = p.astype(np.float32)
    residual = np.maximum(probs[0].astype(np.float64) - q[0], 0.0)
    return probs, q, d, residual / residual.sum()


@cache
def large_outcomes(rule: str, kind: str) -> np.ndarray:
    """``[LARGE_KEYS, 3]`` results of ``rule`` on ``large_case(kind)``, keys
    ``mx.random.split(mx.random.key(1234), LARGE_KEYS)``, vmapped ``CHUNK`` keys at a time."""
    probs, draft_probs, d, _ = large_case(kind)
    accept = ACCEPTS[rule]
    probs = mx.array(probs)
    q = None if draft_probs is None else mx.array(draft_probs)
    draft = mx.array([d], dtype=mx.uint32)
    step = mx.vmap(lambda k: accept(probs, draft, q, k))
    keys = mx.random.split(mx.random.key(1234), LARGE_KEYS)
    return np.concatenate(
        [np.array(step(keys[i : i + CHUNK])) for i in range(0, LARGE_KEYS, CHUNK)]
    ).astype(np.int64)


@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["rejected", "accepted"])
def test_next_follows_its_row_on_a_large_vocabulary(kind):
    """40_000 keys, V = 4099: after a forced rejection ``next`` fits norm(max(p_0 - q_0, 0)),
    after a forced acceptance it fits p_1 (chi-square p-value > 1e-4; tokens expected fewer than
    20 times share a cell)."""
    out = large_outcomes("mlx_spec", kind)
    assert (out[:, 0] == (kind == "accepted")).all()
    assert fit_pvalue(out[:, 1], large_case(kind)[3]) > PASS


@pytest.mark.statistical
@pytest.mark.parametrize(("kind", "rule"), LARGE_CONTROLS)
def test_next_on_a_large_vocabulary_test_rejects_wrong_rules(kind, rule):
    """Negative control, 40_000 keys, V = 4099: a wrong row for ``next`` fails (p < 1e-6);
    ``residual_tilted`` has the right support, so only the chi-square can see it."""
    assert fit_pvalue(large_outcomes(rule, kind)[:, 1], large_case(kind)[3]) < FAIL
