"""Tests of mlx_spec.sampling against mlx-lm's own samplers and filters.

Distribution tests draw tokens from mlx-lm's ``make_sampler(...)`` (one call on a ``[S, V]`` batch
of the same row, with a fixed ``mx.random.seed``) and run a chi-square goodness-of-fit test of
those counts against ``SpecSampler.probs``: it passes when the p-value is above ``ALPHA``. Each
has a negative control: the same counts against the distribution of a slightly wrong sampler
must give a p-value below ``ALPHA``. Tokens drawn where the tested distribution is 0 give a
p-value of 0.
"""

import math

import mlx.core as mx
import mlx_lm.sample_utils as mlx_lm_sampling
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from mlx_spec.sampling import SpecSampler, make_sampler, min_p_mask, top_k_mask, top_p_mask

ALPHA = 1e-3
CHEAP_DRAWS = 20_000  # test_filtered_tokens_never_emitted: every kept token appears
POWER = 0.999  # the chance each negative control has to fail at its case's draws

# A row with distinct probabilities; the cumulative masses from the top are
# 0, .30, .50, .65, .77, .87, .94, .98, so no filter below sits on a boundary.
PROBS = [0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]
# Ties: three tokens share the second value, so top-k = 2 must pick one of them.
TIED = [0.25, 0.15, 0.15, 0.15, 0.12, 0.10, 0.08]

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _row(probs: list[float], dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.log(mx.array(probs, dtype=mx.float32)).astype(dtype)


def _random_logprobs(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    logits = 3.0 * mx.random.normal(shape, key=mx.random.key(seed))
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)


def _counts(sampler, row: mx.array, draws: int, seed: int) -> np.ndarray:
    # In batches of at most 50,000 rows: MLX's CUDA sort and partition fail to launch on more
    # than 65,535 rows (cudaGraphAddKernelNode: invalid argument, MLX 0.32.4).
    mx.random.seed(seed)
    counts = np.zeros(row.shape[-1], np.int64)
    for start in range(0, draws, 50_000):
        batch = mx.broadcast_to(row, (min(50_000, draws - start), row.shape[-1]))
        counts += np.bincount(np.array(sampler(batch)), minlength=row.shape[-1])
    return counts


def _gof_pvalue(counts: np.ndarray, probs: mx.array) -> float:
    p = np.array(probs, dtype=np.float64)
    support = p > 0
    if counts[~support].any():
        return 0.0
    expected = counts.sum() * p[support] / p[support].sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def _mlx_lm_filtered(row: mx.array, top_p=0.0, min_p=0.0, min_tokens_to_keep=1, top_k=0):
    """The log-probabilities mlx-lm's sampler chain hands to its categorical draw (temp 1)."""
    if 0 < top_p < 1:
        row = mlx_lm_sampling.apply_top_p(row, top_p)
    if min_p != 0:
        row = mlx_lm_sampling.apply_min_p(row, min_p, min_tokens_to_keep)
    if top_k > 0:
        row = mlx_lm_sampling.apply_top_k(row, top_k)
    return row


# (mlx-lm arguments, the same sampler made slightly wrong, the row).
CASES = {
    "temp": (dict(temp=0.7), dict(temp=0.77), PROBS),
    "top_p": (dict(temp=1.0, top_p=0.8), dict(temp=1.0, top_p=0.72), PROBS),
    "min_p": (dict(temp=1.0, min_p=0.3), dict(temp=1.0, min_p=0.45), PROBS),
    "min_tokens_to_keep": (
        dict(temp=1.0, min_p=0.5, min_tokens_to_keep=4),
        dict(temp=1.0, min_p=0.5, min_tokens_to_keep=3),
        PROBS,
    ),
    "top_k": (dict(temp=1.0, top_k=3), dict(temp=1.0, top_k=4), PROBS),
    "top_k_ties": (dict(temp=1.3, top_k=2), dict(temp=1.3, top_k=3), TIED),
    "combination": (
        dict(temp=0.8, top_p=0.9, min_p=0.3, top_k=4),
        dict(temp=0.88, top_p=0.9, min_p=0.3, top_k=4),
        PROBS,
    ),
}
# Draws per case: the least (to 1,000) at which the wrong sampler's distribution fails the fit
# with a chance of at least POWER, for every dtype, and every token kept is expected 20 times.
# Drawn from the right sampler, counts tested against the wrong one's probabilities q give a
# noncentral chi-square of noncentrality draws * sum((p - q)**2 / q), or fail at once where p
# has mass outside q's support (test_each_control_fails_with_power computes it): a temperature
# off by 10% needs 12,100 draws on its own, 31,600 with the filters of "combination"; the
# wrong filters, which change the support, fail within 300.
DRAWS = {
    "temp": 13_000,
    "top_p": 1_000,
    "min_p": 1_000,
    "min_tokens_to_keep": 1_000,
    "top_k": 1_000,
    "top_k_ties": 1_000,
    "combination": 32_000,
}


def _control_power(case: str, dtype: mx.Dtype, draws: int) -> tuple[float, float]:
    """The chance that ``draws`` draws of case's sampler fail the fit to its wrong sampler's
    probabilities (chi-square p-value below ALPHA), and the least count a kept token expects."""
    args, wrong, row_probs = CASES[case]
    row = _row(row_probs, dtype)
    p = np.array(make_sampler(**args).probs(row), np.float64)
    q = np.array(make_sampler(**wrong).probs(row), np.float64)
    p, q = p / p.sum(), q / q.sum()
    outside = p[q == 0].sum()
    least = draws * p[p > 0].min()
    if outside > 1 - 1e-9:
        return 1.0, least
    kept = q > 0
    df = int(kept.sum()) - 1
    noncentrality = draws * float(((p[kept] / (1 - outside) - q[kept]) ** 2 / q[kept]).sum())
    chi2 = stats.ncx2.cdf(stats.chi2.isf(ALPHA, df), df, noncentrality)
    return float(1 - (1 - outside) ** draws * chi2), least


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_control_fails_with_power(case):
    for dtype in DTYPES:
        power, least = _control_power(case, dtype, DRAWS[case])
        assert power >= POWER and least >= 20, (dtype, power, least)
    # And the least such, to 1,000 draws, so that no test draws more than it needs.
    if DRAWS[case] > 1_000:
        fewer = [_control_power(case, dtype, DRAWS[case] - 1_000) for dtype in DTYPES]
        assert min(power for power, _ in fewer) < POWER


def test_combination_matches_mlx_lm_sampler_cheap():
    """32k mlx-lm draws fit our probs (p > 1e-3); temperature off by 10% does not."""
    args, wrong, row_probs = CASES["combination"]
    row = _row(row_probs)
    counts = _counts(mlx_lm_sampling.make_sampler(**args), row, DRAWS["combination"], seed=11)
    assert _gof_pvalue(counts, make_sampler(**args).probs(row)) > ALPHA
    assert _gof_pvalue(counts, make_sampler(**wrong).probs(row)) < ALPHA


@pytest.mark.statistical
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_probs_match_mlx_lm_sampler(case, dtype):
    """mlx-lm's draws (DRAWS) fit our probs (p > 1e-3); the wrong sampler's don't."""
    args, wrong, row_probs = CASES[case]
    row = _row(row_probs, dtype)
    counts = _counts(mlx_lm_sampling.make_sampler(**args), row, DRAWS[case], seed=5)
    assert _gof_pvalue(counts, make_sampler(**args).probs(row)) > ALPHA
    assert _gof_pvalue(counts, make_sampler(**wrong).probs(row)) < ALPHA


@pytest.mark.statistical
@pytest.mark.parametrize("case", sorted(CASES))
def test_call_draws_from_probs(case):
    """Draws of our own __call__ (DRAWS) fit our probs (p > 1e-3); the wrong sampler's don't."""
    args, wrong, row_probs = CASES[case]
    row = _row(row_probs)
    counts = _counts(make_sampler(**args), row, DRAWS[case], seed=6)
    assert _gof_pvalue(counts, make_sampler(**args).probs(row)) > ALPHA
    assert _gof_pvalue(counts, make_sampler(**wrong).probs(row)) < ALPHA


@pytest.mark.parametrize("case", sorted(CASES))
def test_call_draws_mlx_lm_tokens_under_same_seed(case):
    args, _, row_probs = CASES[case]
    rows = mx.broadcast_to(_row(row_probs), (2_000, len(row_probs)))
    mx.random.seed(21)
    ours = make_sampler(**args)(rows)
    mx.random.seed(21)
    theirs = mlx_lm_sampling.make_sampler(**args)(rows)
    assert ours.dtype == mx.uint32
    assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_probs_zero_exactly_where_mlx_lm_filters_out(case):
    args, _, row_probs = CASES[case]
    row = _row(row_probs)
    filters = {k: v for k, v in args.items() if k != "temp"}
    kept = mx.isfinite(_mlx_lm_filtered(row, **filters))
    probs = make_sampler(**args).probs(row)
    assert mx.array_equal(probs > 0, kept).item()
    assert mx.all(mx.where(kept, probs, 0) == probs).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_filtered_tokens_never_emitted(case):
    args, _, row_probs = CASES[case]
    row = _row(row_probs)
    counts = _counts(make_sampler(**args), row, CHEAP_DRAWS, seed=3)
    support = np.array(make_sampler(**args).probs(row)) > 0
    assert not counts[~support].any()
    assert counts[support].all()


def test_probs_is_softmax_of_mlx_lm_filtered_logits():
    row = _random_logprobs((9, 500), mx.float32, seed=1)
    args = dict(temp=0.6, top_p=0.9, min_p=0.01, top_k=40)
    filters = {k: v for k, v in args.items() if k != "temp"}
    expected = mx.softmax(_mlx_lm_filtered(row, **filters) / args["temp"], axis=-1)
    assert mx.allclose(make_sampler(**args).probs(row), expected, rtol=1e-5, atol=0).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [9, 1000, 32000, 152064])
def test_top_p_mask_equals_mlx_lm(vocab, dtype):
    """Identical kept sets, also at V = 152064 where float32 rounding of the mass matters."""
    rows = _random_logprobs((9, vocab), dtype, seed=vocab)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        expected = mx.isfinite(mlx_lm_sampling.apply_top_p(rows, top_p))
        assert mx.array_equal(top_p_mask(rows, top_p), expected).item(), top_p


@pytest.mark.parametrize("dtype", DTYPES)
def test_min_p_and_top_k_masks_equal_mlx_lm(dtype):
    rows = _random_logprobs((9, 1000), dtype, seed=2)
    for min_p, keep in ((0.02, 1), (0.3, 5), (1.0, 1), (1.0, 3)):
        expected = mx.isfinite(mlx_lm_sampling.apply_min_p(rows, min_p, keep))
        assert mx.array_equal(min_p_mask(rows, min_p, keep), expected).item(), (min_p, keep)
    for top_k in (1, 2, 50, 999):
        expected = mx.isfinite(mlx_lm_sampling.apply_top_k(rows, top_k))
        assert mx.array_equal(top_k_mask(rows, top_k), expected).item(), top_k


# Rows drawn from a few values (many ties) with some -inf tokens.
_tied_rows = st.lists(
    st.sampled_from([0.0, -0.5, -1.0, -1.0, -2.0, -3.5, -math.inf]), min_size=2, max_size=12
).filter(lambda r: any(v != -math.inf for v in r))


# The filters' settings for a tied row. mlx-lm compiles its filters with each setting as a
# constant, so each example's new floats compile them anew (once per machine, to a disk cache):
# the quick suite takes a few examples, --full the default 100.
_mask_settings = {
    "row": _tied_rows,
    "dtype": st.sampled_from(DTYPES),
    "top_p": st.floats(0.01, 0.99),
    "min_p": st.floats(0.01, 1.0),
    "keep": st.integers(1, 3),
    "top_k": st.integers(1, 11),
}


def _check_masks_equal_mlx_lm(row, dtype, top_p, min_p, keep, top_k):
    x = mx.array(row).astype(dtype)
    vocab = len(row)
    expected = mx.isfinite(mlx_lm_sampling.apply_top_p(x, top_p))
    assert mx.array_equal(top_p_mask(x, top_p) & mx.isfinite(x), expected).item()
    if keep <= vocab:
        expected = mx.isfinite(mlx_lm_sampling.apply_min_p(x, min_p, keep))
        assert mx.array_equal(min_p_mask(x, min_p, keep) & mx.isfinite(x), expected).item()
    if top_k < vocab:
        expected = mx.isfinite(mlx_lm_sampling.apply_top_k(x, top_k))
        assert mx.array_equal(top_k_mask(x, top_k) & mx.isfinite(x), expected).item()


@pytest.mark.quick_only
@pytest.mark.eager  # mlx-lm's filters, compiled, bake each example's value into new kernels
@settings(max_examples=20)
@given(**_mask_settings)
def test_masks_equal_mlx_lm_on_a_few_tied_rows(row, dtype, top_p, min_p, keep, top_k):
    _check_masks_equal_mlx_lm(row, dtype, top_p, min_p, keep, top_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_equal_mlx_lms_compiled_filters(dtype):
    # The sweeps above run mlx-lm's filters uncompiled; here its compiled ones, on tied rows
    # with -inf, at one value of each filter.
    for row in (TIED, [-1.0, -0.5, -0.5, -math.inf, -3.0, -0.5]):
        _check_masks_equal_mlx_lm(row, dtype, top_p=0.55, min_p=0.3, keep=2, top_k=2)


@pytest.mark.slow
@pytest.mark.eager  # mlx-lm's filters, compiled, bake each example's value into new kernels
@given(**_mask_settings)
def test_masks_equal_mlx_lm_with_ties_and_minus_inf(row, dtype, top_p, min_p, keep, top_k):
    _check_masks_equal_mlx_lm(row, dtype, top_p, min_p, keep, top_k)


def test_top_p_keeps_all_tokens_tied_with_the_last_kept():
    # Mass above the first 0.2 is 0.4 < 0.5, so it is kept, and with it every 0.2.
    row = _row([0.4, 0.2, 0.2, 0.2])
    assert top_p_mask(row, 0.5).tolist() == [True, True, True, True]
    # Mass above the first 0.2 is 0.4 >= 0.3: only the top token stays.
    assert top_p_mask(row, 0.3).tolist() == [True, False, False, False]


def test_top_k_keeps_exactly_k_among_ties():
    row = _row(TIED)
    assert top_k_mask(row, 2).sum().item() == 2
    assert top_k_mask(row, 2)[0].item()
    assert (make_sampler(temp=1.0, top_k=2).probs(row) > 0).sum().item() == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_is_first_argmax_one_hot(dtype):
    row = mx.array([-2.0, -0.5, -0.5, -3.0]).astype(dtype)
    sampler = make_sampler(temp=0.0, top_k=1, top_p=0.5)
    assert sampler.greedy
    assert sampler.probs(row).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sampler.probs(row).dtype == mx.float32
    assert sampler(row).item() == 1
    rows = _random_logprobs((7, 50), dtype, seed=4)
    assert mx.array_equal(sampler(rows), mlx_lm_sampling.make_sampler(temp=0.0)(rows)).item()
    assert mx.array_equal(mx.argmax(sampler.probs(rows), axis=-1), sampler(rows)).item()
    assert not make_sampler(temp=0.5).greedy


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_sum_to_one_in_float32(dtype):
    rows = _random_logprobs((9, 32000), dtype, seed=7)
    for args in (dict(temp=1.0), dict(temp=0.3, top_p=0.95), dict(temp=2.0, min_p=0.05, top_k=9)):
        probs = make_sampler(**args).probs(rows)
        assert probs.dtype == mx.float32
        # float32 normalisation over 32000 terms is good to about 4e-5 (measured on CPU).
        sums = np.array(probs).astype(np.float64).sum(axis=-1)
        assert np.abs(sums - 1).max() < 1e-4, args


def test_batch_of_rows_equals_each_row():
    rows = _random_logprobs((9, 1000), mx.bfloat16, seed=8)
    sampler = make_sampler(temp=0.7, top_p=0.9, min_p=0.01, min_tokens_to_keep=3, top_k=100)
    each = mx.stack([sampler.probs(rows[i]) for i in range(rows.shape[0])])
    assert mx.array_equal(sampler.probs(rows), each).item()
    nested = sampler.probs(rows.reshape(3, 3, 1000)).reshape(9, 1000)
    assert mx.array_equal(nested, each).item()


def test_probs_works_inside_compile():
    rows = _random_logprobs((9, 1000), mx.float32, seed=9)
    sampler = make_sampler(temp=0.7, top_p=0.9, min_p=0.01, top_k=100)
    assert mx.array_equal(mx.compile(sampler.probs)(rows), sampler.probs(rows)).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_compiled_form_gives_each_samplers_own_logits_from_its_inputs(dtype):
    # Samplers that differ in their values only (temperature, top-p, min-p) share a form; one
    # graph compiled from it, their values its inputs, gives each sampler's own scores bit for
    # bit. Values written into the graph at its first call would give the first sampler's. The
    # lowest temperature overflows float16 (its rows scaled in float32), a form of its own there.
    rows = _random_logprobs((5, 3000), dtype, seed=14)
    graphs = {}
    for temp, top_p, min_p in [(0.7, 0.9, 0.05), (1.3, 0.5, 0.2), (0.31, 0.97, 0.001), (1e-5,) * 3]:
        sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=100)
        form = sampler.form(rows)
        graph = graphs.setdefault(form, mx.compile(form.logits))
        ours = graph(rows, *sampler.inputs(rows))
        assert mx.array_equal(ours, sampler.logits(rows), equal_nan=True).item(), (temp, dtype)
    assert len(graphs) == (2 if dtype == mx.float16 else 1)


def test_probs_works_under_vmap():
    rows = _random_logprobs((2, 9, 1000), mx.float32, seed=12)
    sampler = make_sampler(temp=0.7, top_p=0.9, min_p=0.01, min_tokens_to_keep=3, top_k=100)
    expected = sampler.probs(rows)
    assert mx.array_equal(mx.vmap(sampler.probs)(rows), expected).item()
    moved = mx.vmap(sampler.probs, in_axes=1, out_axes=1)(rows)
    assert mx.array_equal(moved, expected).item()


def test_single_token_vocabulary():
    row = mx.array([[-0.0], [0.0]])
    for args in (dict(), dict(temp=1.0, top_p=0.5, min_p=0.5, min_tokens_to_keep=3, top_k=4)):
        sampler = make_sampler(**args)
        assert sampler.probs(row).tolist() == [[1.0], [1.0]]
        assert sampler(row).tolist() == [0, 0]


def test_minus_inf_tokens_get_zero_and_are_never_drawn():
    row = mx.array([-math.inf, -1.0, -math.inf, -0.5, -2.0])
    sampler = make_sampler(temp=1.5, top_p=0.99)
    probs = sampler.probs(row)
    assert probs[0].item() == 0.0 and probs[2].item() == 0.0
    counts = _counts(sampler, row, 10_000, seed=1)
    assert counts[0] == 0 and counts[2] == 0


def test_top_k_at_least_vocab_is_off():
    row = _row(PROBS)
    plain = make_sampler(temp=0.9).probs(row)
    for top_k in (len(PROBS), len(PROBS) + 1, 10**6):
        assert mx.array_equal(make_sampler(temp=0.9, top_k=top_k).probs(row), plain).item()


def test_top_p_one_is_off_as_in_mlx_lm():
    rows = _random_logprobs((3, 100), mx.float32, seed=10)
    plain = make_sampler(temp=0.9).probs(rows)
    assert mx.array_equal(make_sampler(temp=0.9, top_p=1.0).probs(rows), plain).item()
    mx.random.seed(2)
    theirs = mlx_lm_sampling.make_sampler(temp=0.9, top_p=1.0)(rows)
    mx.random.seed(2)
    assert mx.array_equal(make_sampler(temp=0.9, top_p=1.0)(rows), theirs).item()


def test_row_without_mass_gives_nan():
    probs = make_sampler(temp=1.0, top_p=0.9).probs(mx.full((2, 4), -math.inf))
    assert mx.all(mx.isnan(probs)).item()


@pytest.mark.parametrize(
    "args, name",
    [
        (dict(temp=-0.1), "temp"),
        (dict(temp=math.inf), "temp"),
        (dict(temp=math.nan), "temp"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(temp=1e-39), "temp"),
        (dict(temp=5e-324), "temp"),
    ],
)
def test_bad_arguments_raise_naming_them(args, name):
    with pytest.raises(ValueError, match=f"make_sampler: {name} "):
        make_sampler(**args)
    with pytest.raises(ValueError, match=f"SpecSampler: {name} "):
        SpecSampler(**args)


def test_bad_logprobs_raise_with_shape_and_dtype():
    sampler = make_sampler(temp=1.0)
    with pytest.raises(ValueError, match=r"SpecSampler.probs: logprobs .*\(\).*int32"):
        sampler.probs(mx.array(3))
    with pytest.raises(ValueError, match=r"SpecSampler.__call__: logprobs .*\(2, 0\)"):
        sampler(mx.zeros((2, 0)))
    with pytest.raises(ValueError, match="top_p_mask: top_p"):
        top_p_mask(mx.zeros((4,)), 1.2)
    with pytest.raises(ValueError, match="min_p_mask: min_tokens_to_keep"):
        min_p_mask(mx.zeros((4,)), 0.1, 0)
    with pytest.raises(ValueError, match="top_k_mask: logprobs"):
        top_k_mask(mx.zeros((4,), dtype=mx.int32), 1)


MASKS = {
    "top_p_mask": lambda row, stream: top_p_mask(row, 0.5, stream=stream),
    "min_p_mask": lambda row, stream: min_p_mask(row, 0.1, 2, stream=stream),
    "top_k_mask": lambda row, stream: top_k_mask(row, 2, stream=stream),
}


@pytest.mark.parametrize("stream", ["cpu", 0, True, [mx.cpu], mx.zeros(1)], ids=repr)
@pytest.mark.parametrize("name", MASKS)
def test_masks_refuse_a_stream_that_is_no_stream_or_device(name, stream):
    with pytest.raises(ValueError, match=rf"^{name}: `stream` must be None, an mx.Stream"):
        MASKS[name](_row(PROBS), stream)


@pytest.mark.parametrize("name", MASKS)
def test_masks_take_streams_devices_and_device_types(name):
    row = _row(PROBS)
    expected = MASKS[name](row, None)
    for stream in (mx.cpu, mx.DeviceType.cpu, mx.default_stream(mx.cpu)):
        assert mx.array_equal(MASKS[name](row, stream), expected).item()


def _temperature_distribution(row: mx.array, temp: float) -> np.ndarray:
    """softmax(row / temp) in float64, from the values of ``row``."""
    x = np.array(row.astype(mx.float32), np.float64) / temp
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_a_tiny_temperature_on_float16_gives_the_temperatures_distribution():
    # 1 / 1e-5 overflows float16: in mlx-lm's float16 arithmetic every scaled row is -inf or
    # NaN. probs is softmax(logprobs / temp), and __call__ draws from it.
    temp = 1e-5
    row = _random_logprobs((6, 40), mx.float16, seed=11)
    theirs = mx.softmax((row * (1 / temp)).astype(mx.float32), axis=-1)
    assert mx.isnan(theirs).all().item()
    sampler = make_sampler(temp=temp)
    probs = sampler.probs(row)
    np.testing.assert_allclose(np.array(probs), _temperature_distribution(row, temp), atol=1e-6)
    assert mx.array_equal(sampler(row), mx.argmax(probs, axis=-1)).item()


@pytest.mark.parametrize("temp", [1e-2, 1e-3, 2e-4, 1e-4, 1 / 65504])
def test_low_temperatures_on_float16_equal_mlx_lm_on_every_row_it_defines(temp):
    # Sharp rows keep a finite most likely token in mlx-lm's float16 arithmetic; flat rows
    # (most likely log-probability near -log(V)) overflow to -inf at the lowest temperatures.
    rows = mx.concatenate(
        [
            _random_logprobs((4, 3000), mx.float16, seed=13),
            _row([1 / 3000] * 3000, mx.float16)[None],
        ]
    )
    theirs = mx.softmax((rows * (1 / temp)).astype(mx.float32), axis=-1)
    probs = make_sampler(temp=temp).probs(rows)
    expected = _temperature_distribution(rows, temp)
    for i, defined in enumerate(np.array(mx.isfinite(theirs).all(axis=-1))):
        if defined:
            assert mx.array_equal(probs[i], theirs[i]).item()
        else:
            np.testing.assert_allclose(np.array(probs[i]), expected[i], atol=1e-6)
    assert not mx.isnan(probs).any().item()
