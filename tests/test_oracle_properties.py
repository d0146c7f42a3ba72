"""Property tests: ``accept_greedy`` and ``accept_sampled`` against the NumPy oracle.

Hypothesis draws the structure of a case (N in 0..16, V in 1..4096, dtype, layout, id dtypes,
EOS set, how often the draft agrees with the target) and a seed; NumPy builds the arrays from
the seed. The oracle always sees the values MLX sees: the input cast to float32 after its own
dtype conversion, so ties created by float16/bfloat16 rounding are judged identically.

Where MLX runs on CUDA, every case also runs the fused kernels (``fused=True``) against the same
oracle; there a tenth of the examples run, since each new shape compiles the composition's kernels
at run time (seconds each): the GPU run checks the backend, the CPU run the breadth.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from oracle import (
    INVALID_ROW,
    first_argmax,
    inverse_cdf,
    oracle_eos_hit,
    oracle_greedy,
    oracle_sampled,
)

from mlx_spec import accept_greedy, accept_sampled, kernels

ON_CUDA = kernels.available()


def _examples(n: int) -> int:
    """``n`` examples on the CPU, a tenth (at least 10) where MLX runs on CUDA."""
    return max(10, n // 10) if ON_CUDA else n


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
LAYOUTS = ("contiguous", "slice", "transposed", "strided")
ID_DTYPES = (np.uint32, np.int32)


def _place(x: np.ndarray, dtype: mx.Dtype, layout: str, rng: np.random.Generator) -> mx.array:
    """``x`` (``[R, V]`` float32) as an MLX array of ``dtype`` laid out as ``layout``.

    ``slice`` is ``big[0, -R:]`` of a ``[1, L, V]`` array, ``transposed`` the ``.T`` of a
    ``[V, R]`` array and ``strided`` is ``big[::2, ::3]`` of a ``[2R, 3V]`` array; the other
    elements of ``big`` are noise that must not be read.
    """
    r, v = x.shape
    if layout == "contiguous":
        return mx.array(x).astype(dtype)
    if layout == "slice":
        big = rng.standard_normal((1, r + 3, v)).astype(np.float32)
        big[0, 3:] = x
        placed = mx.array(big).astype(dtype)
        return placed[0, -r:] if r else placed[0, 3:]  # -0 would take every row
    if layout == "transposed":
        return mx.array(np.ascontiguousarray(x.T)).astype(dtype).T
    big = rng.standard_normal((2 * r, 3 * v)).astype(np.float32)
    big[::2, ::3] = x
    return mx.array(big).astype(dtype)[::2, ::3]


def _seen(x: mx.array) -> np.ndarray:
    """The values MLX computes with: ``x`` cast to float32, as NumPy."""
    return np.array(x.astype(mx.float32))


def _out_of_vocab(vocab: int, id_dtype: type, rng: np.random.Generator) -> int:
    """A draft id the vocabulary does not have (negative ones only for int32)."""
    top = np.iinfo(id_dtype).max
    choices = [vocab, vocab + 1 + int(rng.integers(0, 1000)), top]
    if id_dtype is np.int32:
        choices += [-1, -vocab - 1, np.iinfo(np.int32).min]
    return int(rng.choice(choices))


def _draft(
    likely: list[int], agree: float, vocab: int, id_dtype: type, rng: np.random.Generator
) -> np.ndarray:
    """A draft taking ``likely[i]`` with probability ``agree``, else an in-vocabulary id (3/4)
    or an out-of-vocabulary one (1/4)."""
    tokens = []
    for token in likely:
        r = rng.random()
        if r < agree:
            tokens.append(token)
        elif r < agree + (1 - agree) * 3 / 4:
            tokens.append(int(rng.integers(0, vocab)))
        else:
            tokens.append(_out_of_vocab(vocab, id_dtype, rng))
    return np.array(tokens, dtype=id_dtype)


def _eos(
    kind: str,
    draft: np.ndarray,
    likely: list[int],
    vocab: int,
    id_dtype: type,
    rng: np.random.Generator,
) -> np.ndarray | None:
    """``None``, an empty set, or three ids (one repeated) taken from the draft, the likely
    tokens, the vocabulary and, for int32, a negative id."""
    if kind == "none":
        return None
    if kind == "empty":
        return np.zeros((0,), dtype=id_dtype)
    pool = [int(t) for t in draft if 0 <= int(t) <= np.iinfo(id_dtype).max]
    pool += [*likely, int(rng.integers(0, vocab)), vocab]
    if id_dtype is np.int32:
        pool.append(-1)
    ids = list(rng.choice(pool, size=2))
    ids.append(ids[0])  # a duplicate (three ids, so that E does not add shapes to compile)
    return np.array(ids, dtype=np.int64).astype(id_dtype)


def _ids(x: np.ndarray | None) -> mx.array | None:
    return None if x is None else mx.array(x)


def _assert_consistent(
    out: np.ndarray, draft: np.ndarray, eos: np.ndarray | None, vocab: int
) -> None:
    """What any acceptance result must satisfy, whatever the rows: ``next`` is a token, or the
    flag of the row at ``accepted``."""
    assert out.shape == (3,) and out.dtype == np.uint32
    accepted, following, hit = (int(t) for t in out)
    assert 0 <= accepted <= draft.shape[0]
    assert 0 <= following < vocab or following == INVALID_ROW + accepted
    assert hit in (0, 1)
    stops = set() if eos is None else {int(t) for t in eos}
    kept = [int(t) for t in draft[:accepted]]
    assert all(0 <= t < vocab for t in kept)
    assert not stops.intersection(kept[:-1]), "accepted tokens continue past an EOS"
    assert hit == (bool(stops.intersection(kept)) or following in stops)


def _bucket(accepted: int, n: int) -> str:
    """A coarse label of how deep a case went, for ``--hypothesis-show-statistics``."""
    if n == 0:
        return "N = 0"
    depth = "all" if accepted == n else f"{accepted // 4 * 4}+"
    return f"{depth} of N >= {n // 4 * 4}"


@dataclass(frozen=True)
class Shape:
    """The structure of one drawn case; the values come from ``seed``."""

    n: int
    vocab: int
    dtype: str
    layout: str
    draft_dtype: type
    eos_dtype: type
    eos: str
    agree: float
    seed: int


ALL_N = tuple(range(17))
ALL_VOCABS = (1, 2, 3, 5, 8, 13, 31, 64, 127, 256, 257, 1000, 1023, 2048, 3001, 4096)
# Both functions are compiled per shape (accept_greedy per N and id dtypes; accept_sampled per N,
# V, E and dtypes), and each compile costs far more than a call, so the default run keeps to a few
# shapes; the --full run sweeps every N (and, sampled, 16 vocabulary sizes).
FEW_N = (0, 1, 2, 9, 16)
FEW_VOCABS = (1, 2, 7, 100, 1023, 4096)


def _shapes(ns: tuple[int, ...], vocabs: tuple[int, ...]) -> st.SearchStrategy[Shape]:
    return st.builds(
        Shape,
        n=st.sampled_from(ns),
        vocab=st.sampled_from(vocabs),
        dtype=st.sampled_from(tuple(DTYPES)),
        layout=st.sampled_from(LAYOUTS),
        draft_dtype=st.sampled_from(ID_DTYPES),
        eos_dtype=st.sampled_from(ID_DTYPES),
        eos=st.sampled_from(("none", "empty", "some")),
        agree=st.sampled_from((0.5, 0.97, 1.0)),
        seed=st.integers(0, 2**32 - 1),
    )


# ---------------------------------------------------------------------------------------------
# The oracle itself, on hand-worked cases (the reference's documented example first).


def test_oracle_greedy_hand_examples():
    logits = np.array([[0.0, 0.0, 9.0], [9.0, 0.0, 0.0], [0.0, 9.0, 0.0]])
    assert oracle_greedy(logits, [2, 0], []) == (2, 1, False)
    assert oracle_greedy(logits, [1, 0], []) == (0, 2, False)
    assert oracle_greedy(logits, [2, 1], None) == (1, 0, False)
    # An accepted EOS cuts the draft; next is the choice at the cut.
    assert oracle_greedy(logits, [2, 0], [2]) == (1, 0, True)
    assert oracle_greedy(logits, [2, 0], [1, 1]) == (2, 1, True)
    # A rejected EOS does not count.
    assert oracle_greedy(logits, [1, 0], [1]) == (0, 2, False)
    # Out-of-vocabulary ids are rejected.
    assert oracle_greedy(logits, [3, 0], []) == (0, 2, False)
    assert oracle_greedy(logits, np.array([-1, 0], np.int32), []) == (0, 2, False)
    # N = 0, V = 1.
    assert oracle_greedy(np.zeros((1, 1)), [], [0]) == (0, 0, True)


def test_oracle_first_argmax_takes_the_first_maximum():
    assert first_argmax(np.array([1.0, 3.0, 3.0, -np.inf])) == 1
    assert first_argmax(np.array([-np.inf, -np.inf, 2.0, 2.0])) == 2
    assert oracle_greedy(np.array([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]]), [2], []) == (0, 1, False)


def test_oracle_sampled_hand_examples():
    p = np.array([[0.5, 0.5], [0.2, 0.8]])
    # Deterministic draft: accept token 0 when u < p_0(0) = 0.5, then next ~ p_1.
    accepted, row, _, _ = oracle_sampled(p, [0], None, None, [0.4])
    assert accepted == 1 and np.allclose(row, [0.2, 0.8])
    # Rejected: next ~ norm(max(p_0 - e_0, 0)) = [0, 1].
    accepted, row, _, _ = oracle_sampled(p, [0], None, None, [0.6])
    assert accepted == 0 and np.allclose(row, [0.0, 1.0])
    # Drafted: accept token 1 when u * 0.7 < 0.4, i.e. u < 4/7.
    p = np.array([[0.6, 0.4], [0.1, 0.9]])
    q = np.array([[0.3, 0.7]])
    assert oracle_sampled(p, [1], q, None, [0.57]).accepted == 1
    outcome = oracle_sampled(p, [1], q, None, [0.58], u_next=0.99)
    assert outcome.accepted == 0 and np.allclose(outcome.row, [1.0, 0.0])
    assert outcome.next == 0 and outcome.eos_hit is False
    # q = 0 on the draft token: accepted whenever p > 0, rejected when p = 0 too.
    assert oracle_sampled(p, [1], np.array([[1.0, 0.0]]), None, [0.99]).accepted == 1
    assert oracle_sampled(np.array([[1.0, 0.0], [0.5, 0.5]]), [1], p[:1], None, [0.0]).accepted == 0


def test_oracle_sampled_zero_mass_residual_falls_back_to_p():
    p = np.array([[0.25, 0.75], [0.5, 0.5]])
    # p = q: the residual is empty; an out-of-vocabulary draft is rejected.
    accepted, row, _, _ = oracle_sampled(p, [2], p[:1], None, [0.1])
    assert accepted == 0 and np.allclose(row, p[0])
    # Deterministic draft out of the vocabulary: the point mass is nowhere, residual = p_0.
    accepted, row, _, _ = oracle_sampled(p, np.array([-3], np.int32), None, None, [0.0])
    assert accepted == 0 and np.allclose(row, p[0])


def test_oracle_sampled_eos_cut_draws_from_the_residual_of_the_cut_row():
    p = np.array([[1.0, 0.0, 0.0], [0.1, 0.6, 0.3], [0.0, 0.0, 1.0]])
    outcome = oracle_sampled(p, [0, 1], None, [0, 0], [0.5, 0.0], u_next=0.0)
    assert outcome.accepted == 1
    assert np.allclose(outcome.row, [0.25, 0.0, 0.75])
    assert outcome.next == 0 and outcome.eos_hit is True


def test_oracle_inverse_cdf_draws_inside_the_support():
    row = np.array([0.0, 0.25, 0.0, 0.75])
    assert [inverse_cdf(row, u) for u in (0.0, 0.2499, 0.25, 0.9999999)] == [1, 1, 3, 3]


@pytest.mark.parametrize("drafted", [True, False], ids=["drafted", "deterministic"])
def test_oracle_sampled_is_lossless(drafted):
    """Integrating the oracle over the draft token and a 4000-point grid of uniforms gives back
    p_0 (to 1e-3): the oracle's rule is the lossless one."""
    p = np.array([[0.1, 0.45, 0.05, 0.4, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = np.array([[0.3, 0.1, 0.2, 0.0, 0.4]])
    grid = (np.arange(4000) + 0.5) / 4000
    emitted = np.zeros(5)
    for d in range(5):
        weight = q[0, d] if drafted else float(d == 1)
        if weight == 0:
            continue
        for u in grid:
            outcome = oracle_sampled(p, [d], q if drafted else None, None, [u])
            if outcome.accepted:
                emitted[d] += weight / grid.size
            else:
                emitted += weight / grid.size * outcome.row
    np.testing.assert_allclose(emitted, p[0], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# The implementation against the oracle.


def _logits(shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """``[N + 1, V]`` float32 logits: plain, full of ties, close enough for float16 and
    bfloat16 to merge them, or partly masked with ``-inf``."""
    rows = (shape.n + 1, shape.vocab)
    kind = rng.choice(["normal", "ties", "close", "masked"])
    if kind == "ties":
        x = rng.integers(-2, 3, size=rows).astype(np.float32)
    elif kind == "close":
        x = (40.0 + 0.05 * rng.standard_normal(rows)).astype(np.float32)
    else:
        x = (4 * rng.standard_normal(rows)).astype(np.float32)
    if kind == "masked":
        mask = rng.random(rows) < 0.5
        mask[np.arange(rows[0]), rng.integers(0, shape.vocab, rows[0])] = False
        x[mask] = -np.inf
    return x


def _greedy_fault(x: np.ndarray, rng: np.random.Generator) -> str:
    """Leaves ``x`` as it is (3 cases in 4), or gives one of its rows no finite maximum."""
    fault = str(rng.choice(["none"] * 12 + ["all -inf", "all +inf", "one +inf", "one NaN"]))
    r, c = rng.integers(x.shape[0]), rng.integers(x.shape[1])
    if fault.startswith("all"):
        x[r] = -np.inf if fault == "all -inf" else np.inf
    elif fault != "none":
        x[r, c] = np.inf if fault == "one +inf" else np.nan
    return fault


def _check_greedy(shape: Shape) -> None:
    """Runs ``accept_greedy`` on one drawn case and compares it with the oracle."""
    rng = np.random.default_rng(shape.seed)
    x = _logits(shape, rng)
    event(f"greedy fault: {_greedy_fault(x, rng)}")
    logits = _place(x, DTYPES[shape.dtype], shape.layout, rng)
    seen = _seen(logits)
    if rng.random() < 0.5:
        choice = [first_argmax(row) for row in seen[: shape.n]]
    else:
        # The last maximal index: a tie (frequent in bfloat16) must reject it.
        choice = [shape.vocab - 1 - first_argmax(row[::-1]) for row in seen[: shape.n]]
    draft = _draft(choice, shape.agree, shape.vocab, shape.draft_dtype, rng)
    eos = _eos(shape.eos, draft, choice, shape.vocab, shape.eos_dtype, rng)

    out = np.array(accept_greedy(logits, mx.array(draft), _ids(eos)))

    _assert_consistent(out, draft, eos, shape.vocab)
    expected = oracle_greedy(seen, draft, eos)
    event(f"greedy accepted {_bucket(expected[0], shape.n)}")
    event(f"greedy {'reported' if expected[1] >= INVALID_ROW else 'decided'}")
    assert (int(out[0]), int(out[1]), bool(out[2])) == expected
    if ON_CUDA:
        kernel = np.array(accept_greedy(logits, mx.array(draft), _ids(eos), fused=True))
        assert kernel.tolist() == out.tolist()


@settings(max_examples=_examples(400))
@given(shape=_shapes(FEW_N, ALL_VOCABS))
def test_greedy_equals_oracle(shape):
    _check_greedy(shape)


@pytest.mark.slow
@pytest.mark.eager
@settings(max_examples=_examples(500))
@given(shape=_shapes(ALL_N, ALL_VOCABS))
def test_greedy_equals_oracle_over_all_shapes(shape):
    """The same comparison over every N in 0..16, uncompiled (test_greedy_equals_oracle runs
    the compiled graphs)."""
    _check_greedy(shape)


def _probs(rows: int, vocab: int, sharp: float, rng: np.random.Generator) -> np.ndarray:
    """``[rows, V]`` float32 softmax of random logits, with exact zeros (never a whole row)."""
    x = sharp * rng.standard_normal((rows, vocab))
    zero = rng.random((rows, vocab)) < rng.choice([0.0, 0.3, 0.8])
    zero[np.arange(rows), np.argmax(x, axis=-1)] = False
    x[zero] = -np.inf
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _near(p: np.ndarray, relation: str, rng: np.random.Generator) -> np.ndarray:
    """Drafter probabilities ``[N, V]`` equal to, close to, or independent of ``p``."""
    if relation == "equal":
        return p.copy()
    if relation == "independent":
        return _probs(p.shape[0], p.shape[1], 2.0, rng)
    with np.errstate(divide="ignore"):
        noisy = np.log(p) + 0.1 * rng.standard_normal(p.shape)
    zero = rng.random(p.shape) < 0.02
    zero[np.arange(p.shape[0]), np.argmax(p, axis=-1)] = False
    noisy[zero] = -np.inf
    e = np.exp(noisy - noisy.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _sample(rows: np.ndarray, rng: np.random.Generator) -> list[int]:
    return [int(rng.choice(row.shape[0], p=row / row.sum())) for row in rows.astype(np.float64)]


P_FAULTS = ("sum 2", "sum 0.5", "negative entry, same sum", "NaN entry", "+inf entry")
Q_FAULTS = ("log-probabilities", "negative entry", "sum 2")


def _sampled_fault(
    p: np.ndarray, q: np.ndarray | None, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None, str]:
    """``p`` and ``q`` as they are (2 cases in 3), or with one row that is not a distribution:
    a row of ``p`` (any position), or of ``q``, or ``q`` as log-probabilities."""
    faults = ["none"] * 16 + [f"probs: {f}" for f in P_FAULTS]
    if q is not None and q.shape[0]:
        faults += [f"draft_probs: {f}" for f in Q_FAULTS]
    fault = str(rng.choice(faults))
    if fault == "none":
        return p, q, fault
    p, q = p.copy(), None if q is None else q.copy()
    rows = p if fault.startswith("probs") else q
    r, c = rng.integers(rows.shape[0]), rng.integers(rows.shape[1])
    if fault.endswith("sum 2"):
        rows[r] *= 2
    elif fault.endswith("sum 0.5"):
        rows[r] *= 0.5
    elif fault.endswith("same sum"):
        # Entry c goes to -0.05, the largest entry takes the difference (unless it is c).
        top = int(np.argmax(rows[r]))
        shift = rows[r, c] + 0.05
        rows[r, c] -= shift
        rows[r, top] += shift
    elif fault.endswith("negative entry"):
        rows[r, c] = -0.05
    elif fault.endswith("NaN entry"):
        rows[r, c] = np.nan
    elif fault.endswith("+inf entry"):
        rows[r, c] = np.inf
    elif fault.endswith("log-probabilities"):
        with np.errstate(divide="ignore"):
            q = np.log(q)
    return p, q, fault


drafters = st.sampled_from(("none", "equal", "close", "close", "independent"))
sharpness = st.sampled_from((0.5, 3.0, 8.0, 30.0))


def _check_sampled(shape: Shape, drafter: str, q_dtype: str, q_layout: str, sharp: float) -> None:
    """Runs ``accept_sampled`` on one drawn case and compares it with the oracle."""
    rng = np.random.default_rng(shape.seed)
    n, vocab = shape.n, shape.vocab
    probs = _place(_probs(n + 1, vocab, sharp, rng), DTYPES[shape.dtype], shape.layout, rng)
    p = _seen(probs)
    if drafter == "none":
        draft_probs, q = None, None
        # Deterministic drafts: the target's favourite or a draw from it.
        likely = [first_argmax(row) for row in p[:n]] if rng.random() < 0.5 else _sample(p[:n], rng)
    else:
        draft_probs = _place(_near(p[:n], drafter, rng), DTYPES[q_dtype], q_layout, rng)
        q = _seen(draft_probs)
        likely = _sample(q, rng)
    draft = _draft(likely, shape.agree, vocab, shape.draft_dtype, rng)
    eos = _eos(shape.eos, draft, likely, vocab, shape.eos_dtype, rng)
    key = mx.random.key(shape.seed)
    faulty_p, faulty_q, fault = _sampled_fault(p, q, rng)
    event(f"sampled fault: {fault}")
    if fault != "none":
        # Values that came from the dtypes go back exactly; the oracle sees the faults as cast.
        probs = _place(faulty_p, DTYPES[shape.dtype], shape.layout, rng)
        p = _seen(probs)
        if q is not None:
            draft_probs = _place(faulty_q, DTYPES[q_dtype], q_layout, rng)
            q = _seen(draft_probs)

    out = np.array(accept_sampled(probs, mx.array(draft), draft_probs, _ids(eos), key))
    results = [out]
    if ON_CUDA:
        kernel = accept_sampled(probs, mx.array(draft), draft_probs, _ids(eos), key, fused=True)
        results.append(np.array(kernel))

    # The uniforms, derived from the key as the key discipline specifies.
    uniforms = np.array(mx.random.uniform(shape=(n + 1,), key=key))[:n]
    expected = oracle_sampled(p, draft, q, eos, uniforms)
    event(f"sampled accepted {_bucket(expected.accepted, n)}")
    event(f"sampled {'reported' if expected.row is None else 'drawn'}")
    for result in results:  # the composition, and the fused kernel on CUDA
        _assert_consistent(result, draft, eos, vocab)
        accepted, following, hit = (int(t) for t in result)
        assert accepted == expected.accepted
        if expected.row is None:
            assert (following, bool(hit)) == (expected.next, expected.eos_hit), "not reported"
            continue
        assert following < INVALID_ROW, f"reported row {following - INVALID_ROW} is valid"
        assert expected.row[following] > 0, f"next {following} is outside the support of its row"
        assert bool(hit) == oracle_eos_hit(draft, accepted, following, eos)


@settings(max_examples=_examples(60))
@given(
    shape=_shapes(FEW_N, FEW_VOCABS),
    drafter=drafters,
    q_dtype=st.sampled_from(tuple(DTYPES)),
    q_layout=st.sampled_from(LAYOUTS),
    sharp=sharpness,
)
def test_sampled_matches_oracle_for_the_same_uniforms(shape, drafter, q_dtype, q_layout, sharp):
    _check_sampled(shape, drafter, q_dtype, q_layout, sharp)


@pytest.mark.slow
@pytest.mark.eager
@settings(max_examples=_examples(200))
@given(
    shape=_shapes(ALL_N, ALL_VOCABS),
    drafter=drafters,
    q_dtype=st.sampled_from(tuple(DTYPES)),
    q_layout=st.sampled_from(LAYOUTS),
    sharp=sharpness,
)
def test_sampled_matches_oracle_over_all_shapes(shape, drafter, q_dtype, q_layout, sharp):
    """The same comparison over every N in 0..16 and 16 vocabulary sizes, uncompiled
    (test_sampled_matches_oracle_for_the_same_uniforms runs the compiled graphs)."""
    _check_sampled(shape, drafter, q_dtype, q_layout, sharp)
