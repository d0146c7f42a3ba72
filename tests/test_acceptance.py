"""Behaviour of accept_greedy, accept_sampled and read: worked examples, edge cases, errors,
laziness under vmap and compile, and the reporting of invalid rows.

Exhaustive comparisons with the NumPy oracle live in test_oracle_properties.py and the
distribution proofs in test_distribution.py.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import INVALID_ROW, accept_greedy, accept_sampled, read
from mlx_spec.acceptance import check_next, greedy_token

NAN = float("nan")


def ids(*tokens: int, dtype: mx.Dtype = mx.uint32) -> mx.array:
    return mx.array(list(tokens), dtype=dtype)


def one_hot_rows(choices: list[int], v: int, high: float = 9.0) -> mx.array:
    rows = np.zeros((len(choices), v), np.float32)
    rows[np.arange(len(choices)), choices] = high
    return mx.array(rows)


# Worked examples, by hand from the definition.


def test_greedy_accepts_the_matching_prefix_and_takes_the_next_argmax():
    logits = one_hot_rows([2, 0, 1], 3)
    assert read(accept_greedy(logits, ids(2, 0))) == (2, 1, False)


def test_greedy_stops_at_the_first_mismatch():
    logits = one_hot_rows([2, 0, 1, 3], 4)
    assert read(accept_greedy(logits, ids(2, 1, 1))) == (1, 0, False)
    assert read(accept_greedy(logits, ids(0, 0, 1))) == (0, 2, False)


def test_eos_in_draft_cuts_acceptance():
    logits = one_hot_rows([2, 0, 1, 3], 4)
    assert read(accept_greedy(logits, ids(2, 0, 1), eos=ids(0))) == (2, 1, True)


def test_eos_as_next_token_is_reported():
    logits = one_hot_rows([2, 0, 1], 3)
    assert read(accept_greedy(logits, ids(2, 0), eos=ids(1))) == (2, 1, True)


def test_rejected_eos_in_draft_is_not_a_hit():
    logits = one_hot_rows([2, 0, 1], 3)
    assert read(accept_greedy(logits, ids(1, 0), eos=ids(1))) == (0, 2, False)


def test_all_eos_draft_stops_after_the_first():
    logits = one_hot_rows([4, 4, 4, 4], 5)
    assert read(accept_greedy(logits, ids(4, 4, 4), eos=ids(4))) == (1, 4, True)


@pytest.mark.parametrize("eos", [None, ids(), ids(dtype=mx.int32)])
def test_no_eos_means_no_hit(eos):
    logits = one_hot_rows([0, 0, 0], 2)
    assert read(accept_greedy(logits, ids(0, 0), eos)) == (2, 0, False)


def test_duplicate_eos_ids_count_once():
    logits = one_hot_rows([2, 0, 1], 3)
    assert read(accept_greedy(logits, ids(2, 0), eos=ids(0, 0, 0))) == (2, 1, True)


def test_int32_ids_behave_as_uint32():
    logits = one_hot_rows([2, 0, 1], 3)
    assert read(accept_greedy(logits, ids(2, 0, dtype=mx.int32), ids(1, dtype=mx.int32))) == (
        2,
        1,
        True,
    )


def test_empty_draft_returns_the_first_argmax():
    assert read(accept_greedy(one_hot_rows([3], 5), ids())) == (0, 3, False)


@pytest.mark.parametrize("on_cpu", [True, False])
@pytest.mark.parametrize(
    "row",
    [[0.5, 2.0, 2.0, -1.0], [0.5, math.nan, 3.0, 1.0], [1.0, math.inf, 0.0, 2.0], [-math.inf] * 4],
    ids=["ties", "nan", "inf", "no-token"],
)
def test_a_plain_greedy_token_is_the_next_of_an_empty_draft(row, on_cpu):
    # The loop's plain steps take greedy_token instead of accept_greedy at N = 0: the same
    # token, INVALID_ROW where the row cannot decide, and always an id the model can embed.
    logits = mx.array([row])
    token, fed = greedy_token(logits, on_cpu=on_cpu)
    assert token.tolist() == [accept_greedy(logits, ids()).tolist()[1]]
    assert 0 <= fed.item() < len(row)
    assert (token.item() >= INVALID_ROW) == (row[1] != 2.0)


@pytest.mark.parametrize(
    "options",
    [
        {"temp": 1.0},
        {"temp": 0.7, "top_p": 0.9},
        {"temp": 1.3, "top_k": 3},
        {"temp": 1.0, "min_p": 0.1},
        {"temp": 0.6},
        {"temp": 0.8, "min_p": 0.3},
    ],
    ids=["temp", "top-p", "top-k", "min-p", "temp-again", "min-p-again"],
)
def test_a_plain_sampled_step_draws_as_mlx_lms_sampler_at_the_positions_state(options):
    # The loop's sampled plain steps (Rule.step) draw what a round without a draft draws
    # (Rule.decide at N = 0) with the same state, which is what mlx-lm's sampler draws when
    # mx.random's state is that state; INVALID_ROW for a row that is no distribution, and always
    # an id the model can embed. The last two cases reuse the compiled graphs of the first and
    # the fourth (the same filters), their values those graphs' inputs.
    from mlx_lm.sample_utils import make_sampler as lm_make_sampler

    from mlx_spec.keys import KeyChain
    from mlx_spec.rules import make_rule
    from mlx_spec.sampling import make_sampler

    rule = make_rule(make_sampler(**options))
    theirs = lm_make_sampler(**options)
    logits = mx.random.normal((1, 50), key=mx.random.key(4)) * 3
    drawn = []
    for seed in range(40):
        key = rule.keys(KeyChain(mx.random.key(seed)), 0, 0, draft=False)
        token, fed, logprobs = rule.step(logits, key, on_cpu=True)
        result, reference = rule.decide(logits, ids(), None, None, key, fused=False, on_cpu=True)
        mx.random.seed(seed)
        assert token.tolist() == [result.tolist()[1]] == fed.tolist() == theirs(logprobs).tolist()
        assert mx.array_equal(logprobs, reference).item()
        drawn.append(token.item())
    assert len(set(drawn)) >= 3  # the states matter: not one token whatever the state
    nan_row = mx.array([[0.5, NAN, 1.0, 2.0]])
    token, fed, _ = rule.step(nan_row, mx.random.key(0)[None], on_cpu=True)
    assert token.item() >= INVALID_ROW and 0 <= fed.item() < 4


def test_single_token_vocabulary():
    assert read(accept_greedy(mx.zeros((3, 1)), ids(0, 0))) == (2, 0, False)
    probs = mx.ones((3, 1))
    assert read(accept_sampled(probs, ids(0, 0), probs[:2], None, mx.random.key(0))) == (
        2,
        0,
        False,
    )


def test_bfloat16_ties_take_the_first_maximum():
    # 1.0 and 1.001 are the same bfloat16 number: the first of them is the argmax.
    logits = mx.array([[0.5, 1.0, 1.001], [1.0, 1.001, 0.0]]).astype(mx.bfloat16)
    assert read(accept_greedy(logits, ids(1))) == (1, 0, False)
    assert read(accept_greedy(logits, ids(2))) == (0, 1, False)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_greedy_takes_every_float_dtype(dtype):
    logits = one_hot_rows([1, 2, 0], 4).astype(dtype)
    assert read(accept_greedy(logits, ids(1, 2))) == (2, 0, False)


def test_out_of_vocabulary_draft_ids_are_rejected():
    logits = one_hot_rows([2, 0, 1], 3)
    assert read(accept_greedy(logits, ids(3, 0))) == (0, 2, False)
    assert read(accept_greedy(logits, ids(-1, 0, dtype=mx.int32))) == (0, 2, False)
    probs = mx.softmax(logits, axis=-1)
    for draft in (ids(3, 0), ids(2**32 - 1, 0), ids(-5, 0, dtype=mx.int32)):
        for q in (None, probs[:2]):
            accepted, token, _ = read(accept_sampled(probs, draft, q, None, mx.random.key(1)))
            assert accepted == 0 and 0 <= token < 3


# Layouts: any strides.


def test_greedy_reads_a_slice_of_a_model_output():
    out = mx.random.normal((1, 7, 11), key=mx.random.key(3))
    rows = out[0, -4:]
    choice = np.argmax(np.array(rows), axis=-1)
    draft = mx.array(choice[:3].astype(np.uint32))
    assert read(accept_greedy(rows, draft)) == (3, int(choice[3]), False)


def test_greedy_reads_transposed_and_strided_views():
    base = mx.random.normal((13, 9), key=mx.random.key(4))
    for rows in (base.T[:, ::2], base[::3, 1::2]):
        choice = np.argmax(np.array(rows), axis=-1)
        n = rows.shape[0] - 1
        draft = mx.array(choice[:n].astype(np.uint32))
        assert read(accept_greedy(rows, draft)) == (n, int(choice[n]), False)


def test_sampled_reads_transposed_views_like_contiguous_rows():
    probs = mx.softmax(mx.random.normal((4, 6), key=mx.random.key(5)), axis=-1)
    draft_probs = mx.softmax(mx.random.normal((3, 6), key=mx.random.key(6)), axis=-1)
    draft = ids(1, 2, 3)
    for i in range(20):
        key = mx.random.key(i)
        expected = read(accept_sampled(probs, draft, draft_probs, None, key))
        transposed = mx.array(np.ascontiguousarray(np.array(probs).T)).T
        assert read(accept_sampled(transposed, draft, draft_probs, None, key)) == expected


# Sampled acceptance: the cases whose outcome is certain.


def test_identical_distributions_accept_everything():
    probs = mx.softmax(mx.random.normal((5, 16), key=mx.random.key(7)), axis=-1)
    draft = ids(3, 1, 4, 1)
    for i in range(50):
        accepted, token, _ = read(accept_sampled(probs, draft, probs[:4], None, mx.random.key(i)))
        assert accepted == 4 and 0 <= token < 16


def test_disjoint_supports_reject_and_draw_from_the_target():
    p = np.zeros((2, 6), np.float32)
    p[:, :3] = 1 / 3
    q = np.zeros((1, 6), np.float32)
    q[0, 3:] = 1 / 3
    for i in range(50):
        accepted, token, _ = read(
            accept_sampled(mx.array(p), ids(4), mx.array(q), None, mx.random.key(i))
        )
        assert accepted == 0 and token in (0, 1, 2)


def test_zero_mass_draft_token_is_never_accepted():
    p = mx.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for i in range(50):
        accepted, token, _ = read(accept_sampled(p, ids(0), None, None, mx.random.key(i)))
        assert accepted == 0 and token in (1, 2)


def test_certain_draft_token_is_always_accepted():
    p = mx.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    for i in range(50):
        assert read(accept_sampled(p, ids(1), None, None, mx.random.key(i)))[0] == 1


def test_zero_mass_residual_falls_back_to_the_target_row():
    # The EOS cut stops at position 1 although p = q there: the residual has no mass, so next
    # is drawn from p_1 itself, whose support is {1, 2}.
    p = mx.array([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    seen = set()
    for i in range(60):
        result = accept_sampled(p, ids(0, 2), p[:2], ids(0), mx.random.key(i))
        accepted, token, eos_hit = read(result)
        assert (accepted, eos_hit) == (1, True)
        seen.add(token)
    assert seen == {1, 2}


def test_residual_excludes_tokens_where_the_draft_had_more_mass():
    # Rejected at position 0: the residual max(p - q, 0) is zero on tokens 0 and 1.
    p = mx.array([[0.1, 0.1, 0.8], [0.5, 0.5, 0.0]])
    q = mx.array([[0.5, 0.5, 0.0]])
    for i in range(60):
        accepted, token, _ = read(accept_sampled(p, ids(0), q, None, mx.random.key(i)))
        assert (accepted, token) in ((1, 0), (1, 1), (0, 2))


def test_same_key_same_result_and_keys_matter():
    probs = mx.softmax(mx.random.normal((5, 32), key=mx.random.key(8)), axis=-1)
    q = mx.softmax(mx.random.normal((4, 32), key=mx.random.key(9)), axis=-1)
    draft = ids(1, 2, 3, 4)
    results = [read(accept_sampled(probs, draft, q, None, mx.random.key(i))) for i in range(40)]
    again = [read(accept_sampled(probs, draft, q, None, mx.random.key(i))) for i in range(40)]
    assert results == again
    assert len(set(results)) > 5


def test_key_discipline_is_the_documented_one():
    # u = uniform(key, [N + 1]); u[:N] decide acceptance: the outcome is fixed by these uniforms.
    # Ratios p / q of 0.5, 0.71 and 0.4: each test can go either way.
    probs = mx.array([[0.3, 0.7], [0.5, 0.5], [0.2, 0.8], [0.5, 0.5]])
    q = mx.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    draft = ids(0, 0, 0)
    p_d, q_d = np.array([0.3, 0.5, 0.2], np.float32), np.array([0.6, 0.7, 0.5], np.float32)
    other_rule = 0
    for i in range(30):
        key = mx.random.key(i)
        u = np.array(mx.random.uniform(shape=(4,), key=key))[:3]
        expected = int(np.cumprod(u * q_d < p_d).sum())
        assert read(accept_sampled(probs, draft, q, None, key))[0] == expected
        # Uniforms from another derivation of the key would give other counts: the check bites.
        u_split = np.array(mx.random.uniform(shape=(3,), key=mx.random.split(key)[0]))
        other_rule += int(np.cumprod(u_split * q_d < p_d).sum()) != expected
    assert other_rule > 0


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_sampled_takes_every_float_dtype(dtype):
    probs = mx.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]).astype(dtype)
    assert read(accept_sampled(probs, ids(1), probs[:1], ids(), mx.random.key(0))) == (
        1,
        2,
        False,
    )


# Invalid rows: what cannot be checked without a read.


def test_nan_in_a_deciding_greedy_row_is_reported_with_its_position():
    logits = one_hot_rows([2, 0, 1], 3)
    logits[1, 2] = NAN
    with pytest.raises(ValueError, match=r"read: .*position 1"):
        read(accept_greedy(logits, ids(2, 0)))


def test_nan_after_the_deciding_row_is_not_reported():
    logits = one_hot_rows([2, 0, 1], 3)
    logits[2, 0] = NAN
    assert read(accept_greedy(logits, ids(1, 0))) == (0, 2, False)


def test_nan_in_a_sampled_row_is_reported_with_its_position():
    # The draft token's probability is NaN: it is rejected and the residual of row 1 is NaN.
    p = mx.array([[0.0, 1.0, 0.0], [0.5, NAN, 0.5], [1.0, 0.0, 0.0]])
    for q in (None, mx.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])):
        with pytest.raises(ValueError, match=r"read: .*position 1"):
            read(accept_sampled(p, ids(1, 1), q, None, mx.random.key(0)))


@pytest.mark.parametrize("bad", [math.inf, 0.0])
def test_infinite_or_massless_sampled_row_is_reported(bad):
    p = mx.array([[bad, 0.0, 0.0], [0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match=r"read: .*position 0"):
        read(accept_sampled(p, ids(2), None, None, mx.random.key(0)))


def test_nan_in_a_batch_names_the_batch_index():
    good = one_hot_rows([0, 1], 2)
    bad = one_hot_rows([0, 1], 2)
    bad[0, 1] = NAN
    results = mx.vmap(lambda x: accept_greedy(x, ids(0)))(mx.stack([good, bad]))
    with pytest.raises(ValueError, match=r"position 0 \(batch index 1\)"):
        read(results)


# Rows that are not distributions, and greedy rows without a finite maximum.

# Four-token rows. Row 0 accepts draft token 0 with certainty (p_0(0) = q_0(0) = 1); row 1 reads
# 0 at draft token 0, so it rejects it and decides (`next` is drawn from it); row 2 is never read.
CERTAIN = [1.0, 0.0, 0.0, 0.0]
UNREAD = [0.25, 0.25, 0.25, 0.25]
DRAFT_TOKENS = (0, 0)
POINT_MASSES = [CERTAIN, CERTAIN]  # draft_probs: the draft tokens were certain

NOT_DISTRIBUTIONS = {
    "sum 2": [0.0, 1.0, 0.5, 0.5],
    "sum 0.5": [0.0, 0.25, 0.125, 0.125],
    "sum 0.98": [0.0, 0.49, 0.49, 0.0],
    "sum 1.02": [0.0, 0.51, 0.51, 0.0],
    "a negative entry, sum 1": [0.0, 0.6, 0.5, -0.1],
    "+inf": [0.0, math.inf, 0.0, 0.0],
    "NaN": [0.0, NAN, 0.5, 0.5],
    "all -inf": [-math.inf] * 4,
    "log-probabilities": [-math.inf, math.log(0.5), math.log(0.25), math.log(0.25)],
}


def probs_with(row: list[float], dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.array([CERTAIN, row, UNREAD]).astype(dtype)


def sampled(
    probs: mx.array, draft_probs: mx.array | None, key: int = 0, draft=DRAFT_TOKENS
) -> mx.array:
    return accept_sampled(probs, ids(*draft), draft_probs, None, mx.random.key(key))


@pytest.mark.parametrize("row", NOT_DISTRIBUTIONS.values(), ids=NOT_DISTRIBUTIONS.keys())
@pytest.mark.parametrize("with_q", [False, True], ids=["point masses", "draft_probs"])
def test_a_deciding_row_that_is_not_a_distribution_is_reported(row, with_q):
    q = mx.array(POINT_MASSES) if with_q else None
    for key in range(5):
        with pytest.raises(ValueError, match=r"^read: the verification row at position 1 decided"):
            read(sampled(probs_with(row), q, key))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name", ["sum 2", "sum 0.5", "a negative entry, sum 1", "+inf"])
def test_half_precision_rows_that_are_not_distributions_are_reported(dtype, name):
    q = mx.array(POINT_MASSES).astype(dtype)
    for draft_probs in (None, q):
        with pytest.raises(ValueError, match=r"position 1 decided"):
            read(sampled(probs_with(NOT_DISTRIBUTIONS[name], dtype), draft_probs))


@pytest.mark.parametrize("name", ["sum 2", "a negative entry, sum 1", "+inf", "NaN"])
def test_the_row_drawn_from_after_a_full_accept_is_checked(name):
    # One draft token, accepted with certainty: `next` is drawn from row 1, the last.
    probs = mx.array([CERTAIN, NOT_DISTRIBUTIONS[name]])
    for q in (None, mx.array([CERTAIN])):
        with pytest.raises(ValueError, match=r"position 1 decided"):
            read(accept_sampled(probs, ids(0), q, None, mx.random.key(0)))
    empty = accept_sampled(probs[1:], ids(), None, None, mx.random.key(0))
    with pytest.raises(ValueError, match=r"position 0 decided"):
        read(empty)


def test_a_row_cut_by_an_accepted_eos_is_checked():
    # Draft token 0 is an accepted EOS: row 1 decides although its own test never ran.
    with pytest.raises(ValueError, match=r"position 1 decided"):
        read(
            accept_sampled(
                probs_with([0.0, 1.0, 1.0, 0.0]), ids(0, 1), None, ids(0), mx.random.key(0)
            )
        )


@pytest.mark.parametrize("total", [1 - 2**-7, 1 + 2**-7])
def test_a_row_within_the_mass_tolerance_is_valid(total):
    # MASS_TOLERANCE is 2**-6: rows off by half of it are drawn from.
    row = [0.0, 0.5, total - 0.5, 0.0]
    for q in (None, mx.array(POINT_MASSES)):
        for key in range(5):
            accepted, token, _ = read(sampled(probs_with(row), q, key))
            assert accepted == 1 and token in (1, 2)


@pytest.mark.parametrize("total", [1 - 2**-5, 1 + 2**-5])
def test_a_row_outside_the_mass_tolerance_is_reported(total):
    with pytest.raises(ValueError, match=r"position 1 decided"):
        read(sampled(probs_with([0.0, 0.5, total - 0.5, 0.0]), None))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_softmax_rows_of_a_large_vocabulary_are_valid(dtype):
    # V = 152064: each entry rounded to float16 or bfloat16 moves the total by up to 2**-11 or
    # 2**-8 of itself, well inside MASS_TOLERANCE. Sharp and flat rows, drawn and deterministic
    # drafts; both ways to make the rows: a float32 softmax cast down, and MLX's precise softmax.
    v, n = 152064, 3
    for scale in (0.5, 4.0, 12.0):
        logits = scale * mx.random.normal((n + 1, v), key=mx.random.key(int(scale)))
        q = mx.softmax(scale * mx.random.normal((n, v), key=mx.random.key(9)), axis=-1)
        draft = mx.argmax(q, axis=-1).astype(mx.uint32)
        for probs in (
            mx.softmax(logits, axis=-1).astype(dtype),
            mx.softmax(logits.astype(dtype), axis=-1, precise=True),
        ):
            for draft_probs in (None, q.astype(dtype)):
                for key in range(3):
                    accepted, token, _ = read(
                        accept_sampled(probs, draft, draft_probs, None, mx.random.key(key))
                    )
                    assert 0 <= accepted <= n and 0 <= token < v


def test_log_probabilities_as_draft_probs_are_reported_not_accepted():
    # log q <= 0 makes every ratio test u log q(d) < p(d) pass; the first draft token whose
    # log-probability is negative is rejected and reported instead.
    probs = mx.softmax(mx.random.normal((4, 50), key=mx.random.key(0)), axis=-1)
    q = mx.softmax(mx.random.normal((3, 50), key=mx.random.key(1)), axis=-1)
    draft = mx.argmax(q, axis=-1).astype(mx.uint32)
    for key in range(5):
        with pytest.raises(ValueError, match=r"position 0 decided"):
            read(accept_sampled(probs, draft, mx.log(q), None, mx.random.key(key)))


@pytest.mark.parametrize("value", [1.5, -0.25, math.inf, NAN])
@pytest.mark.parametrize("where", ["probs", "draft_probs"])
def test_a_draft_token_probability_outside_0_1_is_reported(value, where):
    # Row 0's value at draft token 0 is not a probability: even 1.5, which would pass the ratio
    # test, rejects the token and reports row 0.
    probs = [list(CERTAIN), [0.0, 1.0, 0.0, 0.0], UNREAD]
    q = [list(CERTAIN), list(CERTAIN)]
    (probs if where == "probs" else q)[0][0] = value
    with pytest.raises(ValueError, match=r"position 0 decided"):
        read(sampled(mx.array(probs), mx.array(q)))
    if where == "probs":
        with pytest.raises(ValueError, match=r"position 0 decided"):
            read(sampled(mx.array(probs), None))


@pytest.mark.parametrize("entry", [-0.1, 1.5, math.inf, NAN])
def test_a_rejected_draft_row_outside_0_1_is_reported(entry):
    # Row 1 rejects its draft token (p_1(0) = 0): the residual subtracts q_1, whose token 1 is
    # not a probability. The value read at the draft token, q_1(0) = 1, is fine.
    q = mx.array([CERTAIN, [1.0, entry, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"position 1 decided"):
        read(sampled(probs_with([0.0, 0.5, 0.5, 0.0]), q))


def test_what_is_not_read_is_not_checked():
    # Row 2 is never read, draft row 0 only at its draft token, and no draft row's total is
    # computed: none of these is reported (docs/design.md lists what is checked).
    probs = mx.array([CERTAIN, [0.0, 0.5, 0.5, 0.0], [5.0, -1.0, NAN, 0.0]])
    q = mx.array([[1.0, -3.0, 7.0, NAN], [0.5, 0.0, 0.0, 0.0]])
    for key in range(5):
        accepted, token, _ = read(sampled(probs, q, key))
        assert accepted == 1 and token in (1, 2)


GREEDY_INVALID = {
    "all -inf": [-math.inf] * 3,
    "all +inf": [math.inf] * 3,
    "one +inf": [0.0, math.inf, 1.0],
    "NaN": [0.0, NAN, 1.0],
}


@pytest.mark.parametrize("row", GREEDY_INVALID.values(), ids=GREEDY_INVALID.keys())
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_greedy_row_without_a_finite_maximum_is_reported(row, dtype):
    logits = mx.array([[9.0, 0.0, 0.0], row, [0.0, 0.0, 9.0]]).astype(dtype)
    with pytest.raises(ValueError, match=r"^read: the verification row at position 1 decided"):
        read(accept_greedy(logits, ids(0, 0)))
    # Row 1 no longer decides when the draft is rejected at row 0.
    assert read(accept_greedy(logits, ids(1, 0))) == (0, 0, False)


def test_float16_logits_that_overflow_are_reported():
    logits = mx.array([[0.0, 70000.0, 1.0]]).astype(mx.float16)  # 70000 is +inf in float16
    with pytest.raises(ValueError, match=r"position 0 decided"):
        read(accept_greedy(logits, ids()))


def test_a_row_with_minus_inf_entries_and_a_finite_maximum_is_valid():
    logits = mx.array([[-math.inf, 2.0, -math.inf], [1.0, -math.inf, -math.inf]])
    assert read(accept_greedy(logits, ids(1))) == (1, 0, False)


def test_invalid_rows_are_reported_per_element_under_vmap():
    rows = [[0.0, 0.5, 0.5, 0.0]] + [
        NOT_DISTRIBUTIONS[k] for k in ("sum 2", "a negative entry, sum 1")
    ]
    probs = mx.stack([probs_with(r) for r in rows] + [probs_with(rows[0])])
    q = mx.stack([mx.array(POINT_MASSES)] * 3 + [mx.log(mx.array(POINT_MASSES) * 0.5 + 0.125)])
    keys = mx.random.split(mx.random.key(3), 4)
    batched = mx.vmap(lambda p, dq, k: accept_sampled(p, ids(*DRAFT_TOKENS), dq, None, k))(
        probs, q, keys
    )
    raw = np.array(batched)
    assert raw[0, 1] < INVALID_ROW
    assert raw[1:, 1].tolist() == [INVALID_ROW + 1, INVALID_ROW + 1, INVALID_ROW + 0]
    with pytest.raises(ValueError, match=r"position 1 \(batch index 1\)"):
        read(batched)
    logits = mx.stack([mx.array([[9.0, 0.0], [0.0, 9.0]]), mx.array([[9.0, 0.0], [-math.inf] * 2])])
    greedy = np.array(mx.vmap(lambda x: accept_greedy(x, ids(0)))(logits))
    assert greedy[:, 1].tolist() == [1, INVALID_ROW + 1]


def test_invalid_rows_are_reported_under_a_callers_compile():
    @mx.compile
    def both(probs, logits, q, key):
        return accept_sampled(probs, ids(*DRAFT_TOKENS), q, None, key), accept_greedy(
            logits, ids(0, 0)
        )

    probs = probs_with(NOT_DISTRIBUTIONS["a negative entry, sum 1"])
    logits = mx.array([[9.0, 0.0], [-math.inf] * 2, [0.0, 9.0]])
    for result in both(probs, logits, mx.array(POINT_MASSES), mx.random.key(0)):
        with pytest.raises(ValueError, match=r"position 1 decided"):
            read(result)


def test_check_next_names_the_function_the_position_and_the_batch_index():
    check_next("op", INVALID_ROW - 1)  # a token id: nothing to report
    with pytest.raises(ValueError, match=r"^op: the verification row at position 3 decided"):
        check_next("op", INVALID_ROW + 3)
    with pytest.raises(ValueError, match=r"^op: .* position 0 \(batch index 2, 1\)"):
        check_next("op", INVALID_ROW, (2, 1))


def test_next_is_in_vocabulary_even_when_the_read_reports():
    logits = mx.full((3, 5), NAN)
    raw = np.array(accept_greedy(logits, ids(0, 0)))
    assert raw[1] & INVALID_ROW
    probs = mx.full((3, 5), NAN)
    raw = np.array(accept_sampled(probs, ids(0, 0), probs[:2], None, mx.random.key(0)))
    assert raw[1] & INVALID_ROW and raw[0] == 0


# Laziness, vmap and compile.


def _batch_inputs(b: int, n: int, v: int):
    logits = mx.random.normal((b, n + 1, v), key=mx.random.key(20))
    probs = mx.softmax(logits, axis=-1)
    q = mx.softmax(mx.random.normal((b, n, v), key=mx.random.key(21)), axis=-1)
    draft = mx.argmax(q, axis=-1).astype(mx.uint32)
    eos = mx.array([[1, 2]] * b, dtype=mx.uint32)
    keys = mx.random.split(mx.random.key(22), b)
    return logits, probs, q, draft, eos, keys


@pytest.mark.parametrize("batched", ["logits", "draft", "eos", "all"])
def test_vmapped_greedy_equals_the_loop(batched):
    logits, _, _, draft, eos, _ = _batch_inputs(6, 4, 5)
    args = {"logits": logits, "draft": draft, "eos": eos}
    axes = tuple(0 if batched in (name, "all") else None for name in args)
    unbatched = {k: (a if batched in (k, "all") else a[0]) for k, a in args.items()}
    out = mx.vmap(accept_greedy, in_axes=axes)(*unbatched.values())
    loop = [
        read(
            accept_greedy(
                *(a[i] if ax == 0 else a for a, ax in zip(unbatched.values(), axes, strict=True))
            )
        )
        for i in range(6)
    ]
    assert read(out) == loop


@pytest.mark.parametrize("batched", ["probs", "draft", "draft_probs", "eos", "key", "all"])
def test_vmapped_sampled_equals_the_loop(batched):
    _, probs, q, draft, eos, keys = _batch_inputs(6, 4, 5)
    args = {"probs": probs, "draft": draft, "draft_probs": q, "eos": eos, "key": keys}
    axes = tuple(0 if batched in (name, "all") else None for name in args)
    unbatched = [a if ax == 0 else a[0] for a, ax in zip(args.values(), axes, strict=True)]
    out = mx.vmap(accept_sampled, in_axes=axes)(*unbatched)
    loop = [
        read(
            accept_sampled(*(a[i] if ax == 0 else a for a, ax in zip(unbatched, axes, strict=True)))
        )
        for i in range(6)
    ]
    assert read(out) == loop


def test_compiled_callers_get_the_eager_result():
    _, probs, q, draft, eos, keys = _batch_inputs(1, 3, 7)
    logits = mx.log(probs[0])

    @mx.compile
    def both(logits, probs, draft, q, eos, key):
        return accept_greedy(logits, draft, eos), accept_sampled(probs, draft, q, eos, key)

    greedy, sampled = both(logits, probs[0], draft[0], q[0], eos[0], keys[0])
    assert read(greedy) == read(accept_greedy(logits, draft[0], eos[0]))
    assert read(sampled) == read(accept_sampled(probs[0], draft[0], q[0], eos[0], keys[0]))


def test_results_are_lazy_uint32_triples():
    _, probs, q, draft, _, keys = _batch_inputs(1, 3, 7)
    for out in (
        accept_greedy(probs[0], draft[0]),
        accept_sampled(probs[0], draft[0], q[0], None, keys[0]),
    ):
        assert out.shape == (3,) and out.dtype == mx.uint32


def test_explicit_stream_gives_the_same_result():
    _, probs, q, draft, _, keys = _batch_inputs(1, 3, 7)
    expected = read(accept_sampled(probs[0], draft[0], q[0], None, keys[0]))
    assert read(accept_sampled(probs[0], draft[0], q[0], None, keys[0], stream=mx.cpu)) == expected
    assert read(accept_greedy(probs[0], draft[0], stream=mx.cpu)) == read(
        accept_greedy(probs[0], draft[0])
    )


# read.


def test_read_nests_like_the_leading_axes():
    single = mx.array([2, 7, 1], dtype=mx.uint32)
    assert read(single) == (2, 7, True)
    batch = mx.array([[[1, 2, 0], [0, 3, 1]]], dtype=mx.uint32)
    assert read(batch) == [[(1, 2, False), (0, 3, True)]]
    # Python ints and a bool, batched or not (1 == True would hide an int flag).
    for verdict in (read(single), read(batch)[0][1]):
        assert [type(x) for x in verdict] == [int, int, bool]


@pytest.mark.parametrize(
    "bad",
    [
        mx.zeros((2,), mx.uint32),
        mx.zeros((3,), mx.int32),
        mx.zeros((3,), mx.float32),
        mx.zeros((2, 4), mx.uint32),
        mx.array(3, mx.uint32),
        [1, 2, 3],
        (1, 2, True),
        np.zeros(3, np.uint32),
        None,
        "result",
    ],
)
def test_read_rejects_what_is_not_a_result(bad):
    with pytest.raises(ValueError, match="read: `result` must be"):
        read(bad)


# Errors name the function, the argument, its shape and its dtype.

LOGITS = mx.zeros((3, 5))
DRAFT = ids(1, 2)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"logits": mx.zeros((5,))}, r"`logits` must be \[N \+ 1, V\].*shape \(5,\)"),
        ({"logits": mx.zeros((3, 5), mx.int32)}, r"`logits`.*dtype int32"),
        ({"logits": mx.zeros((3, 0))}, r"`logits` needs at least one row and one column"),
        ({"draft": ids(1, 2, 3)}, r"`draft` must hold 2 tokens.*shape \(3,\)"),
        ({"draft": mx.zeros((2,), mx.float32)}, r"`draft` must be \[n\] uint32 or int32.*float32"),
        ({"draft": mx.zeros((1, 2), mx.uint32)}, r"`draft`.*shape \(1, 2\)"),
        ({"eos": mx.zeros((1, 1), mx.uint32)}, r"`eos` must be \[n\].*shape \(1, 1\)"),
        ({"eos": mx.zeros((2,), mx.int64)}, r"`eos`.*dtype int64"),
        ({"logits": np.zeros((3, 5), np.float32)}, r"`logits` must be an mx.array, got ndarray"),
    ],
)
def test_greedy_errors_name_the_argument(kwargs, pattern):
    args = {"logits": LOGITS, "draft": DRAFT, "eos": None, **kwargs}
    with pytest.raises(ValueError, match="accept_greedy: " + pattern):
        accept_greedy(**args)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"probs": mx.zeros((3, 5), mx.uint32)}, r"`probs`.*dtype uint32"),
        ({"draft": ids(1)}, r"`draft` must hold 2 tokens"),
        ({"draft_probs": mx.zeros((3, 5))}, r"`draft_probs` must be \[2, 5\].*shape \(3, 5\)"),
        ({"draft_probs": mx.zeros((2, 4))}, r"`draft_probs`.*shape \(2, 4\)"),
        ({"draft_probs": mx.zeros((2, 5), mx.int32)}, r"`draft_probs`.*dtype int32"),
        ({"key": mx.zeros((3,), mx.uint32)}, r"`key` must be a \[2\] uint32 key.*shape \(3,\)"),
        ({"key": mx.zeros((2,), mx.int32)}, r"`key`.*dtype int32"),
        ({"eos": mx.zeros((2,), mx.float32)}, r"`eos`.*float32"),
    ],
)
def test_sampled_errors_name_the_argument(kwargs, pattern):
    args = {
        "probs": LOGITS,
        "draft": DRAFT,
        "draft_probs": None,
        "eos": None,
        "key": mx.random.key(0),
        **kwargs,
    }
    with pytest.raises(ValueError, match="accept_sampled: " + pattern):
        accept_sampled(**args)


NOT_STREAMS = ["cpu", "gpu", 0, 1, True, [mx.cpu], mx.zeros(1)]
PROBS = mx.softmax(LOGITS, axis=-1)


@pytest.mark.parametrize("stream", NOT_STREAMS, ids=repr)
def test_a_stream_that_is_no_stream_or_device_is_refused(stream):
    with pytest.raises(ValueError, match=r"^accept_greedy: `stream` must be None, an mx.Stream"):
        accept_greedy(LOGITS, DRAFT, stream=stream)
    with pytest.raises(ValueError, match=r"^accept_sampled: `stream` must be None, an mx.Stream"):
        accept_sampled(PROBS, DRAFT, None, None, mx.random.key(0), stream=stream)


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="MLX runs on a GPU here")
def test_a_device_this_mlx_cannot_run_on_is_refused():
    for stream in (mx.gpu, mx.DeviceType.gpu):
        with pytest.raises(ValueError, match=r"^accept_greedy: `stream` is .*gpu.* cannot run on"):
            accept_greedy(LOGITS, DRAFT, stream=stream)
        with pytest.raises(ValueError, match=r"^accept_sampled: `stream` is .*gpu.* cannot run"):
            accept_sampled(PROBS, DRAFT, None, None, mx.random.key(0), stream=stream)


def test_streams_devices_and_device_types_are_taken():
    greedy = read(accept_greedy(LOGITS, DRAFT))
    sampled = read(accept_sampled(PROBS, DRAFT, None, None, mx.random.key(0)))
    for stream in (mx.cpu, mx.DeviceType.cpu, mx.default_stream(mx.cpu), mx.new_stream(mx.cpu)):
        assert read(accept_greedy(LOGITS, DRAFT, stream=stream)) == greedy
        assert read(accept_sampled(PROBS, DRAFT, None, None, mx.random.key(0), stream=stream)) == (
            sampled
        )


@pytest.mark.parametrize("fused", [1, 0, "yes", None, np.bool_(False), mx.array(False)], ids=repr)
def test_fused_that_is_not_a_bool_is_refused(fused):
    with pytest.raises(ValueError, match=r"^accept_greedy: `fused` must be True or False, got"):
        accept_greedy(LOGITS, DRAFT, fused=fused)
    with pytest.raises(ValueError, match=r"^accept_sampled: `fused` must be True or False, got"):
        accept_sampled(PROBS, DRAFT, None, None, mx.random.key(0), fused=fused)


@pytest.mark.skipif(
    not (mx.cuda.is_available() or mx.metal.is_available()), reason="needs a GPU beside the CPU"
)
def test_the_cpu_and_the_gpu_decide_alike_for_the_same_key():
    # MLX draws the same uniforms for a key on every device, so a verification's result does not
    # depend on where it runs; only `next` may differ where the devices' sums round differently
    # at the uniform's quantile (about 1e-6 per draw).
    rng = np.random.default_rng(3)
    same = 0
    for i in range(40):
        logits = mx.array(rng.standard_normal((9, 3001)).astype(np.float32) * 3)
        probs = mx.softmax(logits, axis=-1)
        q = mx.softmax(mx.array(rng.standard_normal((8, 3001)).astype(np.float32) * 3), axis=-1)
        draft = mx.argmax(q, axis=-1).astype(mx.uint32)
        key = mx.random.key(i)
        results = [
            (
                read(accept_greedy(logits.astype(mx.bfloat16), draft, stream=device)),
                read(accept_sampled(probs, draft, q, None, key, stream=device)),
            )
            for device in (mx.cpu, mx.gpu)
        ]
        (greedy_cpu, sampled_cpu), (greedy_gpu, sampled_gpu) = results
        assert greedy_cpu == greedy_gpu
        assert sampled_cpu[0] == sampled_gpu[0]
        same += sampled_cpu == sampled_gpu
    assert same >= 39
