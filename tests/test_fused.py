"""The fused CUDA kernels (``mlx_spec.kernels``): their contract everywhere, their results on a GPU.

Everywhere, the kernel launch is swapped for a reference launcher that runs the composition on what
the kernel is handed (stand-ins for a missing draft or eos, the uniforms drawn from the key), so
the plumbing of ``fused=True`` is tested on the CPU. Where MLX's CUDA backend runs
(``scripts/gpu-check.sh``), the kernels themselves are checked against the composition on the same
inputs, and the generation tests run them (the generation loop uses them on CUDA).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from kernel_reference import reference_launch

from mlx_spec import INVALID_ROW, accept_greedy, accept_sampled, kernels

on_cuda = pytest.mark.skipif(not kernels.available(), reason="needs MLX's CUDA backend and a GPU")


def ids(*tokens: int, dtype: mx.Dtype = mx.uint32) -> mx.array:
    return mx.array(list(tokens), dtype)


def _raw(result: mx.array) -> list:
    """The result as read, flags included (``read`` would raise on an invalid row)."""
    return np.array(result).tolist()


@pytest.fixture
def launches(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[tuple[str, list[mx.array], dict]]]:
    """Makes the kernels 'available' with the reference launcher; records every launch built."""
    calls: list[tuple[str, list[mx.array], dict]] = []

    def recorded(name: str, inputs: list[mx.array], template: list) -> mx.array:
        calls.append((name, inputs, dict(template)))
        return reference_launch(name, inputs, template)

    monkeypatch.setattr(kernels, "launch", recorded)
    monkeypatch.setattr(kernels, "available", lambda stream=None: True)
    # Uncompiled, every call builds (and records) its launch from the arrays it is given.
    mx.disable_compile()
    yield calls
    mx.enable_compile()


def case(n: int, v: int, seed: int) -> dict[str, mx.array]:
    """Logits, probabilities, draft distributions and a draft agreeing with the argmax at 70%."""
    keys = mx.random.split(mx.random.key(seed), 3)
    logits = 3 * mx.random.normal((n + 1, v), key=keys[0])
    probs = mx.softmax(logits, axis=-1)
    q = mx.softmax(3 * mx.random.normal((n, v), key=keys[1]), axis=-1)
    if n == 0:
        return {"logits": logits, "probs": probs, "q": q, "draft": mx.zeros((0,), mx.uint32)}
    draft = mx.argmax(logits[:n], axis=-1).astype(mx.uint32)
    flip = mx.random.bernoulli(0.3, draft.shape, key=keys[2])
    draft = mx.where(flip, (draft + 1) % v, draft).astype(mx.uint32)
    return {"logits": logits, "probs": probs, "q": q, "draft": draft}


@pytest.mark.parametrize("name", ["greedy_slices", "greedy_decide", "sampled"])
def test_each_launch_finds_the_functions_it_calls_in_its_header(name: str) -> None:
    # The sources are package data read through importlib.resources: a launch whose header lost
    # a function would only fail to compile on a GPU.
    subject, _, _, source = kernels._SOURCES[name]
    header = kernels.header(subject)
    called = set(re.findall(r"\b(ms_\w+)\s*(?:<[^>]*>)?\(", source))
    assert called
    for function in called:
        assert re.search(rf"\b(?:void|bool|int|float)\s+{function}\s*\(", header), function


def test_fused_needs_the_cuda_backend() -> None:
    c = case(2, 5, 0)
    with pytest.raises(ValueError, match=r"accept_greedy: `fused=True` needs MLX's CUDA backend"):
        accept_greedy(c["logits"], c["draft"], fused=True, stream=mx.cpu)
    with pytest.raises(ValueError, match=r"accept_sampled: `fused=True` needs MLX's CUDA"):
        accept_sampled(
            c["probs"], c["draft"], None, None, mx.random.key(0), fused=True, stream=mx.cpu
        )


def test_fused_sampled_takes_vocabularies_up_to_2_to_the_24(launches) -> None:
    probs = mx.zeros((1, kernels.MAX_VOCAB + 1))
    with pytest.raises(ValueError, match=r"accept_sampled: `fused=True` takes V <= 16777216"):
        accept_sampled(probs, ids(), None, None, mx.random.key(0), fused=True)
    assert launches == []


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("eos", [None, [2], [2, 4]])
def test_the_kernel_contract_gives_the_composition(launches, n: int, eos: list | None) -> None:
    # What the kernels are handed (stand-ins for a missing draft or eos, the uniforms of the key)
    # decides as the composition does.
    c = case(n, 7, n)
    e = None if eos is None else mx.array(eos, mx.uint32)
    for k in range(4):
        key = mx.random.key(k)
        for q in (c["q"], None):
            got = accept_sampled(c["probs"], c["draft"], q, e, key, fused=True)
            want = accept_sampled(c["probs"], c["draft"], q, e, key, fused=False)
            assert _raw(got) == _raw(want)
    greedy = accept_greedy(c["logits"], c["draft"], e, fused=True)
    assert _raw(greedy) == _raw(accept_greedy(c["logits"], c["draft"], e, fused=False))
    name, inputs, template = launches[-1]
    assert name == "greedy" and _raw(inputs[0]) == _raw(c["logits"])
    assert inputs[1].shape == ((n,) if n else (1,))
    assert _raw(inputs[2]) == (eos or [0xFFFFFFFF])
    assert template == {"T": mx.float32, "D": mx.uint32, "ET": mx.uint32}


def test_fused_greedy_builds_its_launches_once_per_shape(monkeypatch) -> None:
    # The launches are compiled: calls with the shapes of an earlier call replay its graph on
    # their own inputs instead of building the launches again (the first call may find a graph
    # that another test traced).
    built = []

    def recorded(name: str, inputs: list[mx.array], template: list) -> mx.array:
        built.append(name)
        return reference_launch(name, inputs, template)

    monkeypatch.setattr(kernels, "launch", recorded)
    monkeypatch.setattr(kernels, "available", lambda stream=None: True)
    for seed in range(4):
        c = case(6, 23, seed)
        got = accept_greedy(c["logits"], c["draft"], ids(5), fused=True)
        assert _raw(got) == _raw(accept_greedy(c["logits"], c["draft"], ids(5)))
        if seed == 0:
            first = len(built)
    assert first <= 1 and len(built) == first


#: The shapes ``(N, V)`` of the greedy kernel's checks (also ``benchmarks/fused_greedy.py``'s).
GREEDY_SHAPES = [(0, 1), (1, 5), (8, 4099), (16, 152064), (40, 33)]


def greedy_inputs(n: int, v: int, dtype: mx.Dtype, seed: int) -> list[tuple]:
    """Cases for one shape: agreeing prefixes of every length, ties, NaN rows, -inf and +inf rows,
    rows with one +inf, out-of-vocabulary and negative ids, EOS sets."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(12):
        scale = [0.5, 3.0, 30.0][i % 3]
        rows = rng.standard_normal((n + 1, v)).astype(np.float32) * scale
        if i % 4 == 1:
            rows = np.round(rows)  # many ties
        if i % 6 == 2:
            rows[rng.integers(n + 1)] = -np.inf
        if i % 5 == 3:
            rows[rng.integers(n + 1), rng.integers(v)] = np.nan
        if i % 8 == 5:
            rows[rng.integers(n + 1), rng.integers(v)] = np.inf
        if i % 9 == 7:
            rows[rng.integers(n + 1)] = np.inf
        logits = mx.array(rows).astype(dtype)
        choice = np.array(mx.argmax(logits.astype(mx.float32), axis=-1))
        agree = rng.integers(n + 1)
        draft = np.where(np.arange(n) < agree, choice[:n], (choice[:n] + 1) % v).astype(np.int64)
        if i % 7 == 4 and n:
            draft[rng.integers(n)] = [v, -1, 2**31 - 1][i % 3]
        draft_dtype = mx.int32 if i % 2 else mx.uint32
        draft = mx.array(draft.astype(np.int32)).astype(draft_dtype)
        eos = [None, ids(int(choice[0])), ids(int(choice[min(1, n)]), 7 % v)][i % 3]
        cases.append((logits, draft, eos))
    return cases


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(("n", "v"), GREEDY_SHAPES)
def test_greedy_kernel_equals_the_composition(dtype, n: int, v: int) -> None:
    for logits, draft, eos in greedy_inputs(n, v, dtype, seed=n * 1000 + v):
        assert _raw(accept_greedy(logits, draft, eos, fused=True)) == _raw(
            accept_greedy(logits, draft, eos, fused=False)
        )


@on_cuda
def test_greedy_kernel_reads_views() -> None:
    out = 3 * mx.random.normal((2, 12, 3001), key=mx.random.key(1))
    rows = out[1, -9:]  # the last N + 1 rows of a model's output, an offset view
    draft = mx.argmax(rows[:8], axis=-1).astype(mx.uint32)
    assert _raw(accept_greedy(rows, draft, fused=True)) == [8, int(mx.argmax(rows[8]).item()), 0]
    transposed = mx.contiguous(rows.T).T  # [9, 3001] with column-major strides
    assert _raw(accept_greedy(transposed, draft, fused=True)) == _raw(
        accept_greedy(rows, draft, fused=False)
    )


@on_cuda
def test_the_kernels_do_not_vmap() -> None:
    # MLX 0.32 has no vmap rule for custom kernels: the documented limit, and the reason the
    # composition is the default. If MLX adds one, this fails and the docs should change.
    c = case(3, 50, 2)
    logits = mx.stack([c["logits"], c["logits"]])
    with pytest.raises(ValueError, match="CustomKernel"):
        mx.vmap(lambda x: accept_greedy(x, c["draft"], fused=True))(logits)


GREEDY_FAULTS = {
    "all -inf": lambda row, c: np.full_like(row, -np.inf),
    "all +inf": lambda row, c: np.full_like(row, np.inf),
    "one +inf": lambda row, c: np.where(np.arange(row.size) == c, np.inf, row),
    "one NaN": lambda row, c: np.where(np.arange(row.size) == c, np.nan, row),
}


@on_cuda
@pytest.mark.parametrize("fault", GREEDY_FAULTS.keys())
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("v", [3, 4099, 152064])
def test_greedy_kernel_reports_the_rows_the_composition_reports(fault, dtype, v: int) -> None:
    # A row without a finite maximum at each position of a draft that agrees with every argmax:
    # the kernels report that position (or an earlier mismatch), as the composition does.
    rng = np.random.default_rng(v)
    n = 3
    rows = rng.standard_normal((n + 1, v)).astype(np.float32)
    draft = mx.array(np.argmax(rows[:n], axis=-1), mx.uint32)
    for r in range(n + 1):
        bad = rows.copy()
        bad[r] = GREEDY_FAULTS[fault](bad[r], int(rng.integers(v)))
        logits = mx.array(bad).astype(dtype)
        got = _raw(accept_greedy(logits, draft, fused=True))
        assert got == _raw(accept_greedy(logits, draft, fused=False))
        assert got[1] == INVALID_ROW + r


def _not_distributions(v: int) -> dict[str, tuple]:
    """Sampled verifications with N = 2 over V = v >= 3, draft (0, 0), each with at most one
    fault: row 0 accepts draft token 0 with certainty, row 1 reads 0 there, so it rejects it and
    decides, and row 2 is not read. Values: ``(probs, draft_probs, position)``, the position the
    composition reports (None for the valid case); ``draft_probs`` is None where the fault is in
    ``probs`` (then the case runs with point masses for draft_probs, and without them)."""
    certain = np.eye(1, v, 0, dtype=np.float32)[0]
    deciding = np.zeros(v, np.float32)
    deciding[1:] = 1 / (v - 1)
    unread = np.full(v, 1 / v, np.float32)

    def case(row=deciding, first=certain, q=None, position=1):
        return np.stack([first, row, unread]), q, position

    def with_entry(row, index, value):
        row = row.copy()
        row[index] = value
        return row

    negative = with_entry(with_entry(deciding, 1, deciding[1] + deciding[2] + 0.05), 2, -0.05)
    with np.errstate(divide="ignore"):
        log_q = np.log(np.stack([certain, certain]) * 0.5 + 0.5 / v)
    return {
        "valid": case(position=None),
        "sum 2": case(2 * deciding),
        "sum 0.5": case(0.5 * deciding),
        "negative entry, sum 1": case(negative),
        "+inf entry": case(with_entry(deciding, 2, np.inf)),
        "NaN entry": case(with_entry(deciding, 2, np.nan)),
        "all -inf": case(np.full(v, -np.inf, np.float32)),
        "draft token probability 1.5": case(first=with_entry(certain, 0, 1.5), position=0),
        "rejected draft row with a negative entry": case(
            q=np.stack([certain, with_entry(certain, 1, -0.1)])
        ),
        "log-probabilities as draft_probs": case(q=log_q, position=0),
    }


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("v", [4, 4099, 152064])
def test_sampled_kernel_reports_the_rows_the_composition_reports(dtype, v: int) -> None:
    if v == 152064 and dtype != mx.float32:
        pytest.skip("one dtype at the largest vocabulary")
    draft = ids(0, 0)
    points = mx.array(np.eye(1, v, 0, dtype=np.float32).repeat(2, axis=0)).astype(dtype)
    for name, (p, q, position) in _not_distributions(v).items():
        probs = mx.array(p).astype(dtype)
        for draft_probs in (points, None) if q is None else (mx.array(q).astype(dtype),):
            for k in range(3):
                key = mx.random.key(k)
                got = _raw(accept_sampled(probs, draft, draft_probs, None, key, fused=True))
                want = _raw(accept_sampled(probs, draft, draft_probs, None, key))
                assert got[0] == want[0], name
                flagged = [x[1] >= INVALID_ROW for x in (got, want)]
                assert flagged == [position is not None] * 2, name
                if position is not None:
                    assert got[1] == want[1] == INVALID_ROW + position, name
    # After a full accept the last row decides.
    p, _, _ = _not_distributions(v)["sum 2"]
    probs = mx.array(p[:2]).astype(dtype)
    for draft_probs in (None, points[:1]):
        got = _raw(accept_sampled(probs, ids(0), draft_probs, None, mx.random.key(0), fused=True))
        assert got[1] == INVALID_ROW + 1


def _sampled_inputs(n: int, v: int, dtype: mx.Dtype, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(10):
        sharp = [1.0, 4.0, 12.0][i % 3]
        p = mx.softmax(mx.array(rng.standard_normal((n + 1, v)).astype(np.float32) * sharp), -1)
        q = mx.softmax(mx.array(rng.standard_normal((n, v)).astype(np.float32) * sharp), -1)
        if i % 4 == 1:  # sparse supports, as after top-k
            p = mx.where(mx.array(rng.random((n + 1, v)) < 0.2), p, 0)
            p = p / mx.maximum(p.sum(-1, keepdims=True), 1e-30)
        if i % 5 == 2 and n:
            p = mx.concatenate([p[:1] * mx.nan, p[1:]])
        draft = mx.array(np.array(mx.argmax(q, -1)) if n else np.zeros(0), mx.uint32)
        if i % 3 == 0 and n:
            draft = mx.array(np.array(mx.argmax(p[:n], -1)), mx.uint32)
        # Rows that are not distributions: a total of 2, a negative entry (with the total kept),
        # log-probabilities as draft_probs.
        r = int(rng.integers(n + 1))
        if i == 3:
            p = mx.concatenate([p[:r], 2 * p[r : r + 1], p[r + 1 :]])
        if i == 6:
            row = np.array(p[r])
            c, top = int(rng.integers(v)), int(np.argmax(row))
            shift = row[c] + 0.05
            row[c] -= shift
            row[top] += shift
            p = mx.concatenate([p[:r], mx.array(row)[None], p[r + 1 :]])
        if i == 9 and n:
            q = mx.log(q)
        # One EOS shape for every case (an id outside the vocabulary: none), so the composition
        # compiles once per shape: on a GPU each compile is seconds.
        eos = ids(3 % v) if i % 2 else ids(v + 7)
        cases.append((p.astype(dtype), draft, q.astype(dtype), eos))
    return cases


@on_cuda
@pytest.mark.parametrize(
    ("dtype", "n", "v"),
    [
        (mx.float32, 0, 1),
        (mx.float32, 1, 6),
        (mx.bfloat16, 8, 4099),
        (mx.float32, 16, 152064),
        (mx.bfloat16, 40, 37),
    ],
)
def test_sampled_kernel_equals_the_composition(dtype, n: int, v: int) -> None:
    # Same uniforms, so the same acceptance; `next` may differ only where the two paths' sums
    # round differently around the uniform's quantile (a chance of about 1e-6 per draw).
    same = total = 0
    for probs, draft, q, eos in _sampled_inputs(n, v, dtype, seed=n * 1000 + v):
        for with_q in (q, None):
            for k in range(3):
                key = mx.random.key(100 * k + n)
                got = _raw(accept_sampled(probs, draft, with_q, eos, key, fused=True))
                want = _raw(accept_sampled(probs, draft, with_q, eos, key, fused=False))
                assert got[0] == want[0]
                assert (got[1] >= INVALID_ROW) == (want[1] >= INVALID_ROW)
                same += got == want
                total += 1
    assert same >= total - 1, f"{total - same} of {total} differ"


@on_cuda
@pytest.mark.parametrize("with_q", [True, False])
def test_sampled_kernel_emits_the_target_distribution(with_q: bool) -> None:
    # 20,000 verifications (keys 0..19999, drafts drawn with numpy's seed 0) at V = 6, N = 2: the
    # first emitted token (the draft token when accepted, else `next`) has distribution p_0, also
    # for a deterministic draft (a point mass on whatever token it is). A control: the same
    # counts against p_0 mixed with 10% of q_0 (noncentrality 107) must fail.
    from scipy.stats import chisquare

    samples, v = 20_000, 6
    rng = np.random.default_rng(0)
    p = mx.softmax(mx.array(rng.standard_normal((3, v)).astype(np.float32)), axis=-1)
    q = mx.softmax(mx.array(rng.standard_normal((2, v)).astype(np.float32)), axis=-1)
    p0, q0 = np.array(p[0], np.float64), np.array(q[0], np.float64)
    firsts = rng.choice(v, size=samples, p=q0 / q0.sum())
    counts = np.zeros(v)
    for k in range(samples):
        draft = ids(int(firsts[k]), int(firsts[k]))
        accepted, token, _ = _raw(
            accept_sampled(p, draft, q if with_q else None, None, mx.random.key(k), fused=True)
        )
        counts[firsts[k] if accepted else token] += 1
    assert chisquare(counts, p0 / p0.sum() * samples).pvalue > 1e-3
    wrong = 0.9 * p0 + 0.1 * q0
    assert chisquare(counts, wrong / wrong.sum() * samples).pvalue < 1e-6
