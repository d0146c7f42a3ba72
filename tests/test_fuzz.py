"""Fuzzing of every public function with bad arguments (issue 15): a bad value must end as a
``ValueError`` whose message starts with the function's name and names the argument, or give
the right result; never another exception, a crash or a hang.

Each case replaces one argument of a good call with a value drawn from wrong types (``None``,
strings, bytes, floats, bools, containers, NumPy and MLX arrays, objects, functions, devices),
wrong shapes, ranks and dtypes, empty arrays, out-of-range numbers (negative, zero, ``2**63``,
``10**30``), NaN and infinities, and values near the valid ones. A good value drawn there must
give the result a reference gives: the NumPy oracle (``tests/oracle.py``) for the acceptance ops,
mlx-lm's own filters for the masks, mlx-lm's plain greedy decoding for the generation.

The calls run in a worker process (``tests/fuzz_runner.py``) with a time limit per case, so that
a segmentation fault or a hang fails one case and not the run; the worker is started again after
one. The quick suite draws a few hundred cases; ``--full`` draws ten times as many.

Known bugs not fixed here are not drawn by the properties: :data:`KNOWN_CASES` pins each as a
strict xfail, which fails once it is fixed; then draw it again.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from fuzz_runner import TAKE, VOCAB, Arr, Case, Named
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import first_argmax, oracle_eos_hit, oracle_greedy, oracle_sampled

from mlx_spec import INVALID_ROW
from mlx_spec._checks import MASS_TOLERANCE
from mlx_spec.draft_length import MAX_DRAFT_TOKENS

TESTS = Path(__file__).parent

#: Seconds a case may take: a tiny model's generation of a few tokens takes well under one.
LIMIT = 30.0
#: Seconds the worker may take to start (imports only; models are built on first use).
START_LIMIT = 120.0

QUICK, FULL = 1, 10
"""Examples per property: ``QUICK * n`` in the quick suite, ``FULL * n`` with ``--full``."""

BUDGETS = [
    pytest.param(QUICK, id="quick"),
    pytest.param(FULL, id="full", marks=pytest.mark.slow),
]

GPU = mx.is_available(mx.gpu)


# -- the worker ----------------------------------------------------------------------------------


class Worker:
    """A ``fuzz_runner`` process, started on first use and again after a crash or a hang.

    Args:
        log (Path): file the worker's stderr is appended to (a crash's stack is read from it).
    """

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        paths = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import fuzz_runner; fuzz_runner.main()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                bufsize=0,
            )
        assert self._receive(START_LIMIT) == "ready", self._stderr()

    def call(self, case: Case, limit: float = LIMIT) -> dict[str, Any]:
        """Runs ``case``; returns the worker's reply, or ``{"kind": "crash" | "hang", ...}``."""
        if self.proc is None:
            self.start()
        data = pickle.dumps(case)
        try:
            self.proc.stdin.write(struct.pack(">Q", len(data)) + data)
            reply = self._receive(limit)
        except BrokenPipeError:
            reply = _CRASH
        if reply is _HANG:
            self.stop()
            return {"kind": "hang", "limit": limit}
        if reply is _CRASH:
            code = self.proc.wait()
            self.proc = None
            return {"kind": "crash", "returncode": code, "stderr": self._stderr()}
        return reply

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.stop()
            self.proc = None

    def _receive(self, limit: float) -> Any:
        deadline = time.monotonic() + limit
        fd = self.proc.stdout.fileno()
        data = b""
        while len(data) < 8 or len(data) < 8 + struct.unpack(">Q", data[:8])[0]:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return _HANG
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return _CRASH
            data += chunk
        return pickle.loads(data[8:])

    def _stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


_HANG, _CRASH = object(), object()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("fuzz") / "worker.log")
    yield w
    w.close()


def test_worker_reports_a_crash_and_starts_again(worker):
    assert worker.call(Case("crash"))["kind"] == "crash"
    assert worker.call(Case("sleep", {"seconds": 0}))["kind"] == "ok"


def test_worker_reports_a_hang_and_starts_again(worker):
    assert worker.call(Case("sleep", {"seconds": 60}), limit=1)["kind"] == "hang"
    assert worker.call(Case("sleep", {"seconds": 0}))["kind"] == "ok"


# -- judging -------------------------------------------------------------------------------------

#: Arguments a message may name instead of the bad one: those whose shape it must agree with.
PARTNERS = {
    "logits": {"draft"},
    "probs": {"draft", "draft_probs"},
    "draft": {"logits", "probs", "draft_probs"},
}

#: Functions whose errors may come from the function they pass their arguments to.
DELEGATES = {
    "stream_generate": ("stream_generate", "speculative_generate_step"),
    "generate": ("generate", "stream_generate", "speculative_generate_step"),
    "own_drafter": ("speculative_generate_step",),
}


def names(message: str, argument: str) -> bool:
    return re.search(rf"(`{argument}`|\b{argument}\b)", message) is not None


def assert_refusal(case: Case, message: str) -> None:
    """The message starts with the function's name and names a bad argument (or a partner)."""
    prefixes = DELEGATES.get(case.function, (case.function,))
    assert message.startswith(tuple(f"{p}: " for p in prefixes)), (case, message)
    arguments = set(case.bad) | {p for b in case.bad for p in PARTNERS.get(b, ())}
    assert any(names(message, a) for a in arguments), (case, message)


def judge(case: Case, outcome: dict[str, Any], expect: str | None = None) -> None:
    """Fails unless ``outcome`` is a refusal that names the argument or the right result.

    Args:
        case (Case): what was called.
        outcome (dict): the worker's reply.
        expect (str, optional): ``"refused"`` or ``"right"`` to allow only that, ``"flagged"``
            for a right result that :func:`mlx_spec.read` flags as invalid. Default: either.
    """
    kind = outcome["kind"]
    if kind == "hang":
        pytest.fail(f"hang: no reply within {outcome['limit']} s\n{case}")
    if kind == "crash":
        pytest.fail(f"crash (exit {outcome['returncode']})\n{case}\n{outcome['stderr']}")
    if kind == "error":
        pytest.fail(f"{outcome['type']}: {outcome['message']}\n{case}\n{outcome['traceback']}")
    if kind == "ValueError":
        assert expect != "right", (case, outcome["message"])
        if case.function == "own_drafter":
            assert proposal_problem(case) is not None, (case, outcome["message"])
        if case.function == "read" and "verification row" in outcome["message"]:
            assert_read_flag(case, outcome["message"])
        else:
            assert_refusal(case, outcome["message"])
        return
    assert expect != "refused", (case, outcome["facts"])
    JUDGES[case.function](case, outcome["facts"])
    if expect == "flagged":
        assert "read_error" in outcome["facts"], (case, outcome["facts"])


def assert_flag(message: str, position: int) -> None:
    assert message.startswith(f"read: the verification row at position {position} "), message


def judge_greedy(case: Case, facts: dict[str, Any]) -> None:
    rows, draft, eos = facts["logits"], facts["draft"], facts["eos"]
    n = draft.shape[0]
    # A row decides only when its maximum is finite (docs/acceptance.md): the first other row
    # rejects its draft token and, when the draft reaches it, is flagged.
    invalid = ~np.isfinite(rows.max(axis=1))
    first = int(np.argmax(invalid)) if invalid.any() else n + 1
    if first <= n:
        clean = np.where(invalid[:, None], 0.0, rows)[: first + 1]
        if oracle_greedy(clean, draft[:first], eos)[0] == first:
            assert "read_error" in facts, (case, facts)
            assert_flag(facts["read_error"], first)
            return
    assert facts["verdict"] == oracle_greedy(rows, draft, eos), (case, facts)


def is_distribution(rows: np.ndarray | None) -> bool:
    """Finite, non-negative rows summing to 1 (to float32 rounding): what no check may flag."""
    if rows is None:
        return True
    sums = rows.astype(np.float64).sum(axis=-1)
    return bool(np.isfinite(rows).all() and (rows >= 0).all() and np.all(abs(sums - 1) < 1e-6))


def judge_sampled(case: Case, facts: dict[str, Any]) -> None:
    p, draft, q, eos, u = (facts[k] for k in ("probs", "draft", "draft_probs", "eos", "uniforms"))
    n, v = draft.shape[0], p.shape[1]
    if not (is_distribution(p) and is_distribution(q)):
        # Values that are no distribution: flagged, or some verdict (what is checked of them is
        # in docs/acceptance.md).
        if "read_error" in facts:
            assert facts["read_error"].startswith("read: the verification row at position ")
        else:
            accepted, token, _ = facts["verdict"]
            assert 0 <= accepted <= n and 0 <= token < v, (case, facts)
        return
    assert "verdict" in facts, (case, facts)
    accepted, token, eos_hit = facts["verdict"]
    expected = oracle_sampled(p, draft, q, eos, u[:n])
    tests = [
        (u[i] * (1.0 if q is None else q[i, t]), p[i, t])
        for i, t in enumerate(draft[: expected.accepted + 1])
        if 0 <= t < v
    ]
    if any(abs(a - b) <= 1e-6 * max(b, 1e-30) for a, b in tests):
        return  # a ratio test too close to call in float32 and float64 alike
    assert accepted == expected.accepted, (case, facts, expected)
    assert 0 <= token < v and expected.row[token] > 0, (case, facts, expected)
    assert eos_hit == oracle_eos_hit(draft, accepted, token, eos), (case, facts)


def verdicts(values: np.ndarray) -> Any:
    if values.ndim == 1:
        return int(values[0]), int(values[1]), bool(values[2])
    return [verdicts(v) for v in values]


def judge_read(case: Case, facts: dict[str, Any]) -> None:
    values = facts["result"]
    assert not (values[..., 1] >= INVALID_ROW).any(), (case, facts)
    assert facts["verdict"] == verdicts(values), (case, facts)


def assert_read_flag(case: Case, message: str) -> None:
    values = case.arguments["result"].values
    flagged = values[..., 1] >= INVALID_ROW
    where = np.unravel_index(np.argmax(flagged), flagged.shape)
    assert flagged.any(), (case, message)
    assert_flag(message, int(values[where][1]) - INVALID_ROW)


def decided(rows: np.ndarray) -> np.ndarray:
    """Per row of ``[..., V]``: whether its values are ones the filters are specified for (no NaN
    or +inf, some finite value)."""
    return ~np.isnan(rows).any(-1) & ~(rows == np.inf).any(-1) & np.isfinite(rows).any(-1)


def judge_mask(case: Case, facts: dict[str, Any]) -> None:
    logprobs, mask = facts["logprobs"], facts["mask"]
    assert facts["mask_dtype"] == "mlx.core.bool" and mask.shape == logprobs.shape, (case, facts)
    rows = decided(logprobs)
    assert (mask[rows] == facts["reference"][rows]).all(), (case, facts)


def assert_distributions(probs: np.ndarray, logprobs: np.ndarray, greedy: bool) -> None:
    """Rows of ``probs`` with ``logprobs`` they are specified for are distributions (one-hot
    on the first maximum when greedy); other rows are distributions or all NaN."""
    rows = decided(logprobs)
    sums = probs.sum(axis=-1)
    good = np.isfinite(probs).all(-1) & (probs >= 0).all(-1) & (abs(sums - 1) < 1e-5)
    assert good[rows].all(), (probs, logprobs)
    assert (good | np.isnan(probs).all(-1)).all(), (probs, logprobs)
    if greedy:
        for row, p in zip(logprobs[rows], probs[rows], strict=True):
            assert p[first_argmax(row)] == 1.0, (probs, logprobs)


def judge_sampler(case: Case, facts: dict[str, Any]) -> None:
    given = case.arguments
    for k, value in facts["fields"].items():
        assert value == given[k] or (math.isnan(value) and math.isnan(given[k])), (case, facts)
    probs, tokens = facts["probs"], facts["tokens"]
    assert facts["probs_dtype"] == "mlx.core.float32", facts
    assert_distributions(probs, facts["logprobs"], facts["greedy"])
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens)), (case, facts)


def judge_sampler_call(case: Case, facts: dict[str, Any]) -> None:
    logprobs, tokens, probs = facts["logprobs"], facts["out"], facts["probs"]
    assert facts["out_dtype"] == "mlx.core.uint32", facts
    assert tokens.shape == logprobs.shape[:-1], (case, facts)
    assert ((tokens >= 0) & (tokens < logprobs.shape[-1])).all(), (case, facts)
    rows = decided(logprobs)
    flat_tokens, flat_probs = tokens.reshape(-1), probs.reshape(-1, probs.shape[-1])
    for i in np.flatnonzero(rows.reshape(-1)):
        assert flat_probs[i, flat_tokens[i]] > 0, (case, facts)


def judge_sampler_probs(case: Case, facts: dict[str, Any]) -> None:
    logprobs, probs = facts["logprobs"], facts["out"]
    assert facts["out_dtype"] == "mlx.core.float32" and probs.shape == logprobs.shape, facts
    assert_distributions(probs, logprobs, facts["greedy"])


def expected_tokens(plain: list[int], eos: list[int], max_tokens: int) -> list[int]:
    """What a generation yields first: ``plain`` cut after its first EOS and at ``max_tokens``."""
    out = []
    for token in plain:
        out.append(token)
        if token in eos:
            break
    return out[: max_tokens if 0 <= max_tokens else None]


def judge_generation(case: Case, facts: dict[str, Any]) -> None:
    expected = expected_tokens(facts["plain"], facts["eos"], facts["max_tokens"])
    assert facts["tokens"] == expected, (case, facts)


def judge_lookup(case: Case, facts: dict[str, Any]) -> None:
    judge_generation(case, facts)
    assert facts["fields"] == case.arguments, (case, facts)


def judge_plain(case: Case, facts: dict[str, Any]) -> None:
    assert facts["tokens"] == facts["plain"], (case, facts)


def judge_text(case: Case, facts: dict[str, Any]) -> None:
    assert facts["text"] == facts["plain"], (case, facts)


def judge_patch(case: Case, facts: dict[str, Any]) -> None:
    assert facts["patched"] and facts["prompt_lookup"] == case.arguments["prompt_lookup"], facts


JUDGES: dict[str, Callable[[Case, dict[str, Any]], None]] = {
    "accept_greedy": judge_greedy,
    "accept_sampled": judge_sampled,
    "read": judge_read,
    "top_p_mask": judge_mask,
    "min_p_mask": judge_mask,
    "top_k_mask": judge_mask,
    "make_sampler": judge_sampler,
    "SpecSampler": judge_sampler,
    "SpecSampler.__call__": judge_sampler_call,
    "SpecSampler.probs": judge_sampler_probs,
    "speculative_generate_step": judge_generation,
    "stream_generate": judge_plain,
    "generate": judge_text,
    "PromptLookupDrafter": judge_lookup,
    "patch_mlx_lm": judge_patch,
}


# -- values --------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")

INTS = [0, 1, 2, 3, 7, -1, -2, -5, 255, VOCAB, VOCAB + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32]
INTS += [2**32 + 3, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**31), -(2**63)]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, -1.0, 1e-5, 1e-39, 5e-324, 1e30, 1e308, NAN, INF, -INF]
OTHERS = [None, True, False, "", "0", "12", "cpu", "greedy", "prompt-lookup", b"", b"12"]
OTHERS += [[], [1], [-1], [1.5], [[1]], ["a"], [None], (), (3,), {}, {"a": 1}, {3: 4}]
OTHERS += [frozenset({1}), np.int64(3), np.int64(-1), np.uint64(2**64 - 1), np.float32(NAN)]
OTHERS += [np.float64(0.5), np.bool_(True), np.array(2), np.array([1, 2])]
OBJECTS = [Named(n) for n in ("object", "class", "cpu", "cpu-stream", "stats", "lookup")]
OBJECTS += [Named(n) for n in ("tokenizer", "target", "fresh-caches")]
CALLABLE_OBJECTS = {"class", "target"}
if not GPU:
    OBJECTS += [Named("gpu-device")]

INT_TYPES = ["uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"]
FLOAT_TYPES = ["float16", "bfloat16", "float32", "float64"]
ALL_TYPES = ["bool_", *INT_TYPES, *FLOAT_TYPES, "complex64"]
NUMPY_OF = {"bool_": np.bool_, "bfloat16": np.float32, "complex64": np.complex64}


def fits(value: int, dtype: str) -> bool:
    info = np.iinfo(getattr(np, dtype))
    return info.min <= value <= info.max


def pool(dtype: str, ints: list[int] = INTS, floats: list[float] = FLOATS) -> list[Any]:
    """Elements an array of ``dtype`` can hold exactly, from ``ints`` or ``floats``."""
    if dtype == "bool_":
        return [True, False]
    if dtype in INT_TYPES:
        return [i for i in ints if fits(i, dtype)]
    return floats


@st.composite
def arrays(
    draw: st.DrawFn,
    dtypes: list[str] = ALL_TYPES,
    shape: tuple[int, ...] | None = None,
    ints: list[int] = INTS,
    floats: st.SearchStrategy[float] | None = None,
    numpy: bool = True,
    view: bool = False,
) -> Arr:
    """An array of one of ``dtypes``, of ``shape`` (or any of rank 0 to 3), as an ``mx.array``
    or, when ``numpy``, sometimes as a NumPy array; with ``view``, 2-d ones sometimes strided."""
    dtype = draw(st.sampled_from(dtypes))
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    elements = st.sampled_from(pool(dtype, ints))
    if floats is not None and dtype in FLOAT_TYPES:
        elements = st.one_of(floats, elements)
    values = draw(st.lists(elements, min_size=math.prod(shape), max_size=math.prod(shape)))
    with np.errstate(over="ignore"):
        values = np.array(values, dtype=NUMPY_OF.get(dtype, dtype)).reshape(shape)
    as_numpy = numpy and draw(st.integers(0, 9)) == 0 and dtype != "bfloat16"
    layout = draw(st.sampled_from([None, "T", "step"])) if view and len(shape) == 2 else None
    return Arr(values, dtype, numpy=as_numpy, view=layout)


def anything(callables: bool = True) -> st.SearchStrategy[Any]:
    """Bad values of every type: numbers of every size, NaN and infinities, strings, bytes,
    containers, NumPy and MLX arrays, objects; without ``callables``, none that is callable
    (for arguments that take a callable: one that breaks its contract is the caller's bug)."""
    objects = OBJECTS if callables else [o for o in OBJECTS if o.name not in CALLABLE_OBJECTS]
    values = [*INTS, *FLOATS, *OTHERS, *objects]
    return st.one_of(
        st.sampled_from(values),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=4),
        arrays(),
    )


def bad_case(
    function: str, good: dict[str, Any], bad: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Case]:
    """``function`` on ``good`` arguments with one of them, a key of ``bad``, drawn from its
    strategy."""

    @st.composite
    def case(draw: st.DrawFn) -> Case:
        name = draw(st.sampled_from(sorted(bad)))
        return Case(function, {**good, name: draw(bad[name])}, (name,))

    return case()


def run_property(worker: Worker, cases: st.SearchStrategy[Case], examples: int) -> None:
    @settings(max_examples=examples)
    @given(case=cases)
    def check(case: Case) -> None:
        judge(case, worker.call(case))

    check()


# -- the acceptance ops --------------------------------------------------------------------------

ID_TYPES = ["uint32", "int32"]
ROW_TYPES = ["float32", "float16", "bfloat16"]
STREAMS = [None, 0, Named("cpu"), Named("cpu-device"), Named("cpu-stream")]
STREAMS += [Named("gpu"), Named("gpu-device"), "cpu"]


def edge_ids(v: int) -> list[int]:
    return [0, 1, v - 1, v, v + 1, -1, -(2**31), 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 1]


def often(near: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``near`` three times in four, else ``wild``: most drawn values then reach the work.
    (``st.one_of`` would flatten nested choices into one uniform choice of their branches.)"""
    return st.integers(0, 3).flatmap(lambda i: near if i else wild)


def ids(n: int, v: int) -> st.SearchStrategy[Arr]:
    """Near-valid ``[n]`` ids: any value; other lengths, ranks and dtypes."""
    good = arrays(ID_TYPES, (n,), ints=edge_ids(v), numpy=False)
    return often(
        good,
        st.one_of(
            arrays(INT_TYPES, (n,), ints=edge_ids(v)),
            arrays(ID_TYPES, (n + 1,), ints=edge_ids(v)),
            arrays(ID_TYPES, (1, n), ints=edge_ids(v)),
            arrays(ALL_TYPES, (n,), ints=edge_ids(v)),
        ),
    )


ROW_VALUES = st.floats(-8, 8, width=32)


def rows(shape: tuple[int, int], probabilities: bool = False) -> st.SearchStrategy[Arr]:
    """Near-valid ``shape`` rows: any values (NaN, infinities, huge), dtypes, ranks, strides."""
    r, v = shape
    values = st.floats(0, 1, width=32) if probabilities else ROW_VALUES
    return often(
        arrays(ROW_TYPES, shape, floats=values, numpy=False, view=True),
        st.one_of(
            arrays(ROW_TYPES, (r + 1, v), floats=values),
            arrays(ROW_TYPES, (r, v + 1), floats=values),
            arrays(ROW_TYPES, (v,), floats=values),
            arrays(ROW_TYPES, (1, r, v), floats=values),
            arrays(ROW_TYPES, (r, 0)),
            arrays(ALL_TYPES, shape, floats=values),
        ),
    )


def eos_arrays(v: int) -> st.SearchStrategy[Any]:
    lengths = st.integers(0, 3).map(lambda e: (e,))
    good = lengths.flatmap(lambda e: arrays(ID_TYPES, e, ints=edge_ids(v), numpy=False))
    return often(good, arrays(ALL_TYPES, None, ints=edge_ids(v)))


def keys() -> st.SearchStrategy[Arr]:
    any_uint32 = [0, 1, 7, 2**31, 2**32 - 1]
    return often(
        arrays(["uint32"], (2,), ints=any_uint32, numpy=False),
        st.one_of(
            arrays(ALL_TYPES, (2,), ints=any_uint32), arrays(["uint32"], None, ints=any_uint32)
        ),
    )


@st.composite
def greedy_rows(draw: st.DrawFn, n: int, v: int) -> tuple[Arr, Arr]:
    """Finite ``[n + 1, v]`` logits with frequent ties, and a draft that follows their argmax
    for a drawn prefix (so acceptance runs past the first token)."""
    logits = np.array(
        draw(st.lists(st.integers(0, 3), min_size=(n + 1) * v, max_size=(n + 1) * v)),
        dtype=np.float32,
    ).reshape(n + 1, v)
    follow = draw(st.integers(0, n))
    draft = [
        first_argmax(logits[i]) if i < follow else draw(st.integers(0, v - 1)) for i in range(n)
    ]
    return Arr(logits, "float32"), Arr(np.array(draft, dtype=np.uint32), "uint32")


@st.composite
def greedy_cases(draw: st.DrawFn) -> Case:
    n, v = draw(st.integers(0, 3)), draw(st.integers(1, 6))
    logits, draft = draw(greedy_rows(n, v))
    good = {"logits": logits, "draft": draft, "eos": None, "fused": False, "stream": None}
    return draw(
        bad_case(
            "accept_greedy",
            good,
            {
                "logits": often(rows((n + 1, v)), anything()),
                "draft": often(ids(n, v), anything()),
                "eos": often(eos_arrays(v), anything()),
                "fused": often(st.booleans(), anything()),
                "stream": often(st.sampled_from(STREAMS), anything()),
            },
        )
    )


def distributions(r: int, v: int) -> st.SearchStrategy[Arr]:
    """Valid ``[r, v]`` float32 distributions: drawn weights, normalised."""
    weights = st.lists(st.integers(0, 4), min_size=v, max_size=v).filter(any)

    def normalised(w: list[list[int]]) -> Arr:
        w = np.array(w, np.float32).reshape(r, v)
        return Arr(w / w.sum(axis=1, keepdims=True), "float32")

    return st.lists(weights, min_size=r, max_size=r).map(normalised)


@st.composite
def sampled_cases(draw: st.DrawFn) -> Case:
    n, v = draw(st.integers(0, 3)), draw(st.integers(1, 6))
    draft = draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    good = {
        "probs": draw(distributions(n + 1, v)),
        "draft": Arr(np.array(draft, dtype=np.uint32), "uint32"),
        "draft_probs": draw(st.one_of(st.none(), distributions(n, v))),
        "eos": None,
        "key": Arr(np.array([0, draw(st.integers(0, 99))], dtype=np.uint32), "uint32"),
        "fused": False,
        "stream": None,
    }
    return draw(
        bad_case(
            "accept_sampled",
            good,
            {
                "probs": often(rows((n + 1, v), probabilities=True), anything()),
                "draft": often(ids(n, v), anything()),
                "draft_probs": often(rows((n, v), probabilities=True), anything()),
                "eos": often(eos_arrays(v), anything()),
                "key": often(keys(), anything()),
                "fused": often(st.booleans(), anything()),
                "stream": often(st.sampled_from(STREAMS), anything()),
            },
        )
    )


def read_cases() -> st.SearchStrategy[Case]:
    flags = [0, 1, 2, INVALID_ROW, INVALID_ROW + 3, 2**32 - 1]
    results = st.one_of(
        arrays(["uint32"], (3,), ints=flags, numpy=False),
        *(arrays(["uint32"], shape, ints=flags) for shape in [(2, 3), (0, 3), (2, 1, 3)]),
        arrays(ALL_TYPES, None, ints=flags),
        anything(),
    )
    return results.map(lambda r: Case("read", {"result": r}, ("result",)))


# -- the samplers --------------------------------------------------------------------------------


def logprobs_arrays() -> st.SearchStrategy[Arr]:
    """Near-valid ``[..., V]`` log-probabilities: any values (NaN, infinities) and dtypes, any
    leading axes, empty ones, ``V = 0``."""
    shapes = st.sampled_from([(5,), (2, 5), (2, 2, 5), (0, 5), (1,), (2, 0), ()])
    values = st.floats(-20, 0, width=32)
    return often(
        shapes.flatmap(lambda shape: arrays(ROW_TYPES, shape, floats=values, numpy=False)),
        arrays(ALL_TYPES, None, floats=values),
    )


def fractions() -> st.SearchStrategy[Any]:
    return often(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0, 1 - 1e-7, 1e-39]), anything())


def counts(*good: int) -> st.SearchStrategy[Any]:
    return often(st.sampled_from([*good, 2**63, 10**30, -1, True]), anything())


def temperatures() -> st.SearchStrategy[Any]:
    # A temperature so large that 1 / temp is 0 in float32 makes a row with -inf entries NaN
    # (-inf * 0): pinned in KNOWN_CASES, not drawn here.
    def moderate(t: Any) -> bool:
        return not (isinstance(t, float) and 1e38 < t < INF)

    near = st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e-5, 2.0**-126, 1e-39, 1e30, INF, NAN, -1.0])
    return often(near, anything().filter(moderate))


SAMPLER_ARGUMENTS = {
    "temp": temperatures(),
    "top_p": fractions(),
    "min_p": fractions(),
    "min_tokens_to_keep": counts(1, 2, 8, 9),
    "top_k": counts(0, 1, 3, 8, 9),
}
GOOD_SAMPLERS = [
    {"temp": 0.0},
    {"temp": 1.0},
    {"temp": 0.7, "top_p": 0.9},
    {"temp": 1.0, "min_p": 0.1, "min_tokens_to_keep": 2},
    {"temp": 1.0, "top_k": 3},
]


def sampler_cases(function: str) -> st.SearchStrategy[Case]:
    good = {"temp": 1.0, "top_p": 0.0, "min_p": 0.0, "min_tokens_to_keep": 1, "top_k": 0}
    return bad_case(function, good, SAMPLER_ARGUMENTS)


def argmax_of_nothing(method: str, c: tuple[dict[str, Any], Any]) -> bool:
    """Whether ``method`` takes an argmax (a draw, or a greedy sampler's distribution) of a
    ``[..., 0, ..., V]`` array: MLX's argmax refuses those (sampling.py):
    pinned in KNOWN_CASES, not drawn here."""
    sampler, logprobs = c
    shape = logprobs.values.shape if isinstance(logprobs, Arr) else ()
    argmax = method == "SpecSampler.__call__" or sampler["temp"] == 0
    return argmax and 0 in shape[:-1]


def sampler_method_cases(method: str) -> st.SearchStrategy[Case]:
    return (
        st.tuples(st.sampled_from(GOOD_SAMPLERS), logprobs_arrays())
        .filter(lambda c: not argmax_of_nothing(method, c))
        .map(lambda c: Case(method, {"sampler": c[0], "logprobs": c[1]}, ("logprobs",)))
    )


@st.composite
def mask_cases(draw: st.DrawFn, function: str) -> Case:
    logprobs = draw(logprobs_arrays())
    good = {
        "top_p_mask": {"top_p": 0.5},
        "min_p_mask": {"min_p": 0.2, "min_tokens_to_keep": 1},
        "top_k_mask": {"top_k": 2},
    }[function]
    bad = {
        "top_p": fractions(),
        "min_p": fractions(),
        "min_tokens_to_keep": counts(1, 2, 5, 6),
        "top_k": counts(0, 1, 2, 5, 6),
    }
    good = {"logprobs": logprobs, **good, "stream": None}
    bad["stream"] = often(st.sampled_from(STREAMS), anything())
    # logprobs is drawn near-valid always: it is the argument the filters work on.
    bad = {name: bad[name] for name in good if name in bad}
    case = draw(bad_case(function, good, bad))
    return Case(function, case.arguments, ("logprobs", *case.bad))


# -- the generation ------------------------------------------------------------------------------

PROMPT = Arr(np.array([1, 2, 3, 4, 5], dtype=np.int32), "int32")


def prompts() -> st.SearchStrategy[Any]:
    """Near-valid ``[L]`` prompts: ids of every integer dtype, inside the vocabulary and not
    (negative, ``>= V``, ``2**32 + t``), empty, of other ranks and dtypes."""
    good = [1, 2, 3, 0, VOCAB - 1]
    ids = [*good, VOCAB, -1, -5, 2**32 + 3, 2**63 - 1, 2**64 - 1, 2**31]
    lengths = st.integers(1, 6).map(lambda n: (n,))
    return often(
        st.one_of(
            lengths.flatmap(lambda n: arrays(INT_TYPES, n, ints=good, numpy=False)),
            lengths.flatmap(lambda n: arrays(INT_TYPES, n, ints=ids, numpy=False)),
        ),
        arrays(ALL_TYPES, None, ints=ids),
    )


def model_values() -> st.SearchStrategy[Any]:
    names = ["target", "draft", "unrelated", "big-draft"]
    return often(st.sampled_from([Named(n) for n in names]), anything())


def callables(*good: str) -> st.SearchStrategy[Any]:
    return often(st.sampled_from([None, *(Named(n) for n in good)]), anything(callables=False))


def zero_dimensional(value: Any) -> bool:
    return (isinstance(value, Arr) and value.values.ndim == 0) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    )


def eos_ids() -> st.SearchStrategy[Any]:
    ids = st.sampled_from([0, 3, 250, 255, VOCAB, 2**32 - 1, 2**32, -1, True, 2.0, NAN, "1"])
    # A 0-d array ends in Python's TypeError (_checks.py): pinned in KNOWN_CASES, not drawn here.
    wild = st.one_of(anything(), arrays(ALL_TYPES, None, ints=edge_ids(VOCAB)))
    return often(
        st.one_of(
            st.lists(ids, max_size=3),
            st.lists(ids, max_size=3).map(tuple),
            st.sampled_from([0, -1, "12", b"12", Named("object")]),
        ),
        wild.filter(lambda v: not zero_dimensional(v)),
    )


def caches() -> st.SearchStrategy[Any]:
    # Caches of another kind or of another model end in mlx-lm's or MLX's own errors (the
    # generation code): pinned in KNOWN_CASES, not drawn here.
    names = ["fresh-caches", "target-caches", "caches-of-strings"]
    return often(st.sampled_from([None, [], [None], *(Named(n) for n in names)]), anything())


def near_ints(*good: int) -> st.SearchStrategy[Any]:
    return often(st.sampled_from([*good, -1, -2, 2**63, 10**30, True, 0.5, 3.0, NAN]), anything())


def generation_arguments() -> dict[str, st.SearchStrategy[Any]]:
    """For each argument of ``speculative_generate_step``: values near the valid ones, and
    anything."""
    streams = [Named(n) for n in ("cpu-device", "cpu-stream", "cpu", "gpu", "gpu-device")]
    return {
        "prompt": prompts(),
        "model": model_values(),
        "draft_model": model_values(),
        "stream": often(st.sampled_from([*streams, 0, "cpu"]), anything()),
        "num_draft_tokens": near_ints(0, 1, 3, 8, MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS + 1),
        "max_tokens": near_ints(-1, 0, 1, 2, TAKE, 256, 2**31, 2**63 - 1),
        "sampler": callables("argmax", "mlx-lm-greedy", "spec-greedy"),
        "logits_processors": often(
            st.sampled_from(
                [
                    [],
                    [Named("identity-processor")],
                    (Named("identity-processor"),),
                    Named("identity-processor"),
                    [Named("identity-processor"), 3],
                    "ab",
                    Named("fn"),
                ]
            ),
            anything(callables=False),
        ),
        "prompt_cache": caches(),
        "prefill_step_size": near_ints(1, 2, 512, 2**63 - 1),
        "kv_bits": near_ints(2, 3, 4, 5, 6, 7, 8, 16),
        "kv_group_size": near_ints(32, 48, 64, 128, 256),
        "quantized_kv_start": near_ints(0, 5000, 2**63),
        "prompt_progress_callback": callables("progress"),
        "key": often(keys(), anything()),
        "eos_token_ids": eos_ids(),
        "stats": often(st.sampled_from([None, Named("stats"), {}]), anything()),
        "drafter": often(
            st.sampled_from(
                [None, "prompt-lookup", "lookup", *map(Named, ["lookup", "huge-ids", "class"])]
            ),
            anything(),
        ),
        "adaptive": often(st.booleans(), anything()),
    }


def drafting(name: str) -> dict[str, Any]:
    """The good drafting arguments for a case that draws ``name``: a draft model, except when
    the drafter is drawn."""
    if name == "drafter":
        return {"draft_model": None}
    if name == "draft_model":
        return {}
    return {"draft_model": Named("draft")}


@st.composite
def generation_cases(draw: st.DrawFn) -> Case:
    arguments = generation_arguments()
    name = draw(st.sampled_from(sorted(arguments)))
    good = {"prompt": PROMPT, "model": Named("target"), **drafting(name)}
    if name == "kv_bits":
        good["kv_group_size"] = 32  # the tiny models' heads have 16 dimensions: 64 is too many
    return Case("speculative_generate_step", {**good, name: draw(arguments[name])}, (name,))


@st.composite
def stream_generate_cases(draw: st.DrawFn) -> Case:
    arguments = generation_arguments()
    text_prompts = st.sampled_from(["hi", "", "\x00", [1, 2, 3], [], [[1]], [-1], [2**64], b"hi"])
    own = {
        "tokenizer": often(st.sampled_from([Named("tokenizer")]), anything()),
        "prompt": often(st.one_of(text_prompts, prompts()), anything()),
        "max_tokens": near_ints(-1, 0, 1, 2, TAKE, 2**63 - 1),
        "max_kv_size": near_ints(1, 4, 2**31),
        "input_embeddings": anything(),
    }
    passed = ["num_draft_tokens", "sampler", "key", "stats", "drafter", "adaptive", "stream"]
    bad = {**own, "draft_model": arguments["draft_model"], **{k: arguments[k] for k in passed}}
    name = draw(st.sampled_from(sorted(bad)))
    good = {"model": Named("target"), "tokenizer": Named("tokenizer"), "prompt": "hi"}
    good.update(max_tokens=TAKE, **drafting(name))
    return Case("stream_generate", {**good, name: draw(bad[name])}, (name,))


@st.composite
def generate_cases(draw: st.DrawFn) -> Case:
    bad = {
        "verbose": often(st.booleans(), anything()),
        "prompt": often(st.sampled_from(["hi", [1, 2, 3], [-1], [2**64], None, 3]), anything()),
        "max_tokens": near_ints(1, 3),
        "tokenizer": often(st.sampled_from([Named("tokenizer")]), anything()),
        "drafter": generation_arguments()["drafter"],
    }
    name = draw(st.sampled_from(sorted(bad)))
    good = {"model": Named("target"), "tokenizer": Named("tokenizer"), "prompt": "hi"}
    good.update(max_tokens=3, **drafting(name))
    return Case("generate", {**good, name: draw(bad[name])}, (name,))


def drafter_cases() -> st.SearchStrategy[Case]:
    # Huge n-gram sizes make the index loop over every size up to them (drafters.py):
    # pinned in KNOWN_CASES, not drawn here.
    def small(value: Any) -> bool:
        return not (isinstance(value, int) and value > 2**16)

    sizes = often(st.sampled_from([1, 2, 3, 8, 0, -1, True, 2.0]), anything().filter(small))
    good = {"max_ngram": 3, "min_ngram": 1, "distribution": False}
    bad = {"max_ngram": sizes, "min_ngram": sizes, "distribution": often(st.booleans(), anything())}
    return bad_case("PromptLookupDrafter", good, bad)


def patch_cases() -> st.SearchStrategy[Case]:
    return bad_case("patch_mlx_lm", {}, {"prompt_lookup": often(st.booleans(), anything())})


# -- a drafter of one's own, and the caches' settings -------------------------------------------


def asked(case: Case) -> int:
    """The ``n`` the loop asks an own drafter's first proposal for: a free drafter is asked for
    as many as the round may take (``TAKE - 1`` of ``TAKE`` tokens), a model drafter for
    ``num_draft_tokens`` of them; ``0``: never asked."""
    a = case.arguments
    return TAKE - 1 if a["free"] else min(a["num_draft_tokens"], TAKE - 1)


def stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` as float64, rounded as an array of ``dtype`` holds them."""
    if dtype == "bfloat16":
        bits = np.asarray(values, np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return np.where(np.isnan(values), np.nan, rounded.astype(np.uint32).view(np.float32))
    return np.asarray(values, dtype).astype(np.float64)


def proposal_problem(case: Case) -> str | None:
    """What the loop must refuse in an own drafter's proposal (``None``: nothing), from the
    contract of :class:`mlx_spec.drafters.Draft`, worked out here from the values. Its fields are
    checked when it comes; its rows when a round verifies them: of a free drafter's proposal,
    a round verifies the first ``num_draft_tokens``."""
    a, n = case.arguments, asked(case)
    if n == 0:
        return None
    if not a["draft"]:
        return "not a Draft"
    tokens, probs, label = (a["proposal"][k] for k in ("tokens", "probs", "label"))
    if not isinstance(tokens, Arr) or tokens.numpy or tokens.dtype not in ID_TYPES:
        return "tokens of another type"
    if tokens.values.ndim != 1 or tokens.values.size > n:
        return "tokens of another shape"
    if probs is not None:
        if not isinstance(probs, Arr) or probs.numpy or probs.dtype not in ROW_TYPES:
            return "probs of another type"
        q = stored(probs.values, probs.dtype)
        if q.ndim != 2 or q.shape[0] != tokens.values.size:
            return "probs of another shape"
        own = tokens.values.astype(np.int64) % 2**32  # int32 ids as the uint32 they read as
        if own.size and q.shape[1] == 0:
            return "probs of no token"
        verified = min(own.size, a["num_draft_tokens"])
        q, own = q[:verified], own[:verified]
        with np.errstate(invalid="ignore", over="ignore"):
            inside = own < q.shape[1]
            mass = q[np.arange(own.size), np.minimum(own, q.shape[1] - 1)] if own.size else own
            rows_ok = inside & (mass > 0) & (abs(q.sum(axis=1) - 1) <= MASS_TOLERANCE)
            rows_ok &= q.min(axis=1, initial=0.0) >= 0
        if not rows_ok.all():
            return "a row that is no distribution of its token"
    if isinstance(label, bool) or not isinstance(label, int):
        return "a label that is no int"
    return None


def judge_own_drafter(case: Case, facts: dict[str, Any]) -> None:
    assert proposal_problem(case) is None, (case, facts)
    assert facts["tokens"] == facts["plain"], (case, facts)
    assert facts["asked"][:1] == ([asked(case)] if asked(case) else []), (case, facts)


def proposal_rows(size: int) -> st.SearchStrategy[Any]:
    """``[size, V_d]`` rows near a drafter's distributions: one-hot or spread on its tokens, with
    a row's mass moved, made negative, taken from its token or NaN; other shapes and types."""

    @st.composite
    def near(draw: st.DrawFn) -> Arr:
        v = draw(st.sampled_from([0, 1, 3, VOCAB, VOCAB + 64]))
        q = np.zeros((size, v), np.float32)
        q[:, : min(v, 4)] = 1.0 / max(min(v, 4), 1)
        if size and v and draw(st.booleans()):
            i, how = draw(st.integers(0, size - 1)), draw(st.sampled_from(["mass", "neg", "nan"]))
            q[i, 0] = {"mass": 0.8, "neg": -0.1, "nan": NAN}[how]
        return Arr(q, draw(st.sampled_from(ROW_TYPES)), numpy=draw(st.integers(0, 9)) == 0)

    shapes = st.sampled_from([(size + 1, 3), (size,), (1, size, 3)])
    return st.one_of(st.none(), near(), shapes.flatmap(lambda s: arrays(ALL_TYPES, s)))


@st.composite
def own_drafter_cases(draw: st.DrawFn) -> Case:
    n = draw(st.sampled_from([0, 1, 3, 8]))
    free = draw(st.booleans())
    most = TAKE - 1 if free else min(n, TAKE - 1)
    size = draw(st.sampled_from(sorted({0, 1, most, most + 1})))
    # Ids the target emits here at times (a draft then kept), or any ids:
    tokens = often(arrays(ID_TYPES, (size,), ints=[0, 1, 7, 250, VOCAB - 1], numpy=False),
                   often(ids(size, VOCAB), anything()))  # fmt: skip
    proposal = {
        "tokens": draw(tokens),
        "probs": draw(often(proposal_rows(size), anything())),
        "label": draw(often(st.integers(0, 5), anything())),
    }
    draft = draw(often(st.just(True), st.just(False)))
    arguments = {
        "prompt": PROMPT,
        "proposal": proposal if draft else draw(anything()),
        "draft": draft,
        "free": free,
        "num_draft_tokens": n,
        "temp": draw(st.sampled_from([0.0, 0.8])),
        "seed": draw(st.integers(0, 3)),
    }
    return Case("own_drafter", arguments, ("propose",))


def judge_cache_settings(case: Case, facts: dict[str, Any]) -> None:
    """Where mlx-lm's greedy decoding runs, the same tokens in every turn, or one of two
    refusals made before any work: a rotating cache that keeps its whole window (``max_kv_size``
    at most its 4 kept tokens), or one that ``kv_bits`` would quantize (mlx-lm has no quantized
    rotating cache, and fails once it reaches ``quantized_kv_start``)."""
    a = case.arguments
    if "refusal" in facts:
        message = facts["refusal"]
        assert message.startswith(tuple(f"{p}: " for p in DELEGATES["stream_generate"])), facts
        rotating = a["model"] == "qwen2" and a["max_kv_size"] is not None
        assert (
            "plain_error" in facts
            or (rotating and a["max_kv_size"] <= 4 and names(message, "max_kv_size"))
            or (rotating and a["kv_bits"] is not None and names(message, "kv_bits"))
        ), (case, facts)
    elif "plain_error" not in facts:
        assert facts["tokens"] == facts["plain"], (case, facts)


@st.composite
def cache_settings_cases(draw: st.DrawFn) -> Case:
    prompt = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12)
    arguments = {
        "model": draw(st.sampled_from(["narrow-heads", "qwen2"])),
        "kv_bits": draw(st.sampled_from([None, 2, 3, 4, 8])),
        "quantized_kv_start": draw(st.sampled_from([None, 0, 1, 2, 5, 9, 20])),
        "max_kv_size": draw(st.sampled_from([None, 1, 2, 4, 5, 8, 16, 64])),
        "drafter": draw(st.sampled_from(["draft", "lookup"])),
        "num_draft_tokens": draw(st.integers(1, 5)),
        "tokens": draw(st.integers(4, 14)),
        "turns": draw(st.lists(prompt, min_size=1, max_size=2)),
    }
    return Case("cache_settings", arguments, ("kv_bits", "quantized_kv_start", "max_kv_size"))


JUDGES.update(own_drafter=judge_own_drafter, cache_settings=judge_cache_settings)


# -- the properties -----------------------------------------------------------------------------

#: Each function's cases, and how many of them the quick suite draws.
PROPERTIES: dict[str, tuple[Callable[[], st.SearchStrategy[Case]], int]] = {
    "accept_greedy": (greedy_cases, 60),
    "accept_sampled": (sampled_cases, 60),
    "read": (read_cases, 30),
    **{f: (lambda f=f: sampler_cases(f), 40) for f in ("make_sampler", "SpecSampler")},
    **{
        m: (lambda m=m: sampler_method_cases(m), 30)
        for m in ("SpecSampler.__call__", "SpecSampler.probs")
    },
    **{f: (lambda f=f: mask_cases(f), 30) for f in ("top_p_mask", "min_p_mask", "top_k_mask")},
    "speculative_generate_step": (generation_cases, 100),
    "stream_generate": (stream_generate_cases, 50),
    "generate": (generate_cases, 20),
    "PromptLookupDrafter": (drafter_cases, 20),
    "patch_mlx_lm": (patch_cases, 10),
    "own_drafter": (own_drafter_cases, 40),
    "cache_settings": (cache_settings_cases, 20),
}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("function", list(PROPERTIES))
def test_bad_arguments(worker, function, budget):
    """One bad argument at a time: refused by name, or the right result."""
    cases, examples = PROPERTIES[function]
    run_property(worker, cases(), examples * budget)


# -- known cases: issue 15's examples and what the fuzz found --------------------------------------


def sgs(**arguments: Any) -> Case:
    """``speculative_generate_step`` on the prompt, the target and its draft, but
    ``arguments``; every one of ``arguments`` counts as drawn."""
    good = {"prompt": PROMPT, "model": Named("target"), "draft_model": Named("draft")}
    return Case("speculative_generate_step", {**good, **arguments}, tuple(arguments))


def streamed(**arguments: Any) -> Case:
    good = {"model": Named("target"), "tokenizer": Named("tokenizer"), "prompt": "hi"}
    good.update(max_tokens=TAKE, draft_model=Named("draft"))
    return Case("stream_generate", {**good, **arguments}, tuple(arguments))


def id_array(*ids: int, dtype: str = "int32") -> Arr:
    return Arr(np.array(ids, dtype=dtype), dtype)


LOGITS = Arr(np.array([[0, 0, 9], [9, 0, 0], [0, 9, 0]], dtype=np.float32), "float32")
DRAFT = id_array(2, 1, dtype="uint32")
Q = np.array([[0.5, 0.25, 0.25], [0.25, 0.25, 0.5]], dtype=np.float32)
PROBS = Arr(np.array([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]], np.float32), "float32")


def greedy(**arguments: Any) -> Case:
    good = {"logits": LOGITS, "draft": DRAFT, "eos": None, "fused": False, "stream": None}
    return Case("accept_greedy", {**good, **arguments}, tuple(arguments))


def sampled(**arguments: Any) -> Case:
    good = {"probs": PROBS, "draft": DRAFT, "draft_probs": None, "eos": None}
    good.update(key=Arr(np.array([0, 7], np.uint32), "uint32"), fused=False, stream=None)
    return Case("accept_sampled", {**good, **arguments}, tuple(arguments))


def mask(function: str, **arguments: Any) -> Case:
    good = {"logprobs": Arr(np.log(PROBS.values), "float32"), "stream": None}
    good.update({"top_p_mask": {"top_p": 0.5}, "min_p_mask": {"min_p": 0.2}}.get(function, {}))
    good.update({"top_k_mask": {"top_k": 2}}.get(function, {}))
    return Case(function, {**good, **arguments}, tuple(arguments))


def sampler_call(method: str, sampler: dict[str, Any], logprobs: Arr) -> Case:
    return Case(method, {"sampler": sampler, "logprobs": logprobs}, ("logprobs",))


def xfail(reason: str, condition: bool = True) -> pytest.MarkDecorator:
    return pytest.mark.xfail(condition, strict=True, reason=reason)


FLOAT16_LOGPROBS = Arr(np.log(PROBS.values).astype(np.float16), "float16")
EMPTY_BATCH = Arr(np.zeros((0, 5), np.float32), "float32")

KNOWN_CASES = [
    # Class 1: token ids the target cannot embed.
    pytest.param(sgs(prompt=id_array(-5, 3)), "refused", id="prompt-negative"),
    pytest.param(sgs(prompt=id_array(2**32 + 3, 3, dtype="int64")), "refused", id="prompt-2**32+t"),
    pytest.param(sgs(prompt=id_array(VOCAB, 3)), "refused", id="prompt-vocab"),
    pytest.param(sgs(prompt=id_array(2**64 - 1, dtype="uint64")), "refused", id="prompt-uint64"),
    pytest.param(streamed(prompt=[-5, 3]), "refused", id="stream-prompt-negative"),
    pytest.param(streamed(prompt=[2**64]), "refused", id="stream-prompt-2**64"),
    pytest.param(sgs(draft_model=Named("big-draft")), "right", id="draft-larger-vocab"),
    pytest.param(sgs(draft_model=None, drafter=Named("huge-ids")), "right", id="drafter-huge-ids"),
    # Class 2: the draft length.
    pytest.param(
        sgs(num_draft_tokens=MAX_DRAFT_TOKENS + 1), "refused", id="num_draft_tokens-above-max"
    ),
    pytest.param(
        sgs(num_draft_tokens=MAX_DRAFT_TOKENS, max_tokens=2**63 - 1),
        "right",
        id="max_tokens-2**63-1",
    ),
    pytest.param(sgs(max_tokens=10**30), "right", id="max_tokens-10**30"),
    # Class 4: arguments of the generation API.
    pytest.param(sgs(eos_token_ids=0), "refused", id="eos-0"),
    pytest.param(sgs(eos_token_ids=[-1]), "refused", id="eos-[-1]"),
    pytest.param(sgs(eos_token_ids="12"), "refused", id="eos-'12'"),
    pytest.param(sgs(sampler="greedy"), "refused", id="sampler-'greedy'"),
    pytest.param(sgs(prefill_step_size=0), "refused", id="prefill_step_size-0"),
    pytest.param(sgs(prefill_step_size=-2), "refused", id="prefill_step_size--2"),
    pytest.param(sgs(prefill_step_size=0.5), "refused", id="prefill_step_size-0.5"),
    pytest.param(sgs(prompt_cache=Named("target-caches")), "refused", id="caches-too-few"),
    pytest.param(sgs(prompt_cache=Named("caches-of-strings")), "refused", id="caches-strings"),
    pytest.param(
        sgs(prompt_cache=Named("caches-of-another-kind")), "refused", id="caches-another-kind"
    ),
    pytest.param(
        sgs(prompt_cache=Named("caches-of-another-model")),
        "refused",
        id="caches-another-model",
        marks=xfail("caches of other head sizes: MLX's own '[broadcast_shapes]' (generation.py)"),
    ),
    pytest.param(sgs(stats={}), "refused", id="stats-{}"),
    pytest.param(streamed(stats={}), "refused", id="stream-stats-{}"),
    pytest.param(sgs(logits_processors=Named("identity-processor")), "refused", id="processors"),
    pytest.param(sgs(stream="cpu"), "refused", id="stream-'cpu'"),
    pytest.param(sgs(stream=0), "refused", id="stream-0"),
    pytest.param(sgs(num_draft_tokens=2**63), "refused", id="num_draft_tokens-2**63"),
    pytest.param(sgs(num_draft_tokens=-1), "refused", id="num_draft_tokens--1"),
    pytest.param(sgs(num_draft_tokens=True), "refused", id="num_draft_tokens-True"),
    pytest.param(sgs(max_tokens=-2), "refused", id="max_tokens--2"),
    pytest.param(sgs(max_tokens=5.0), "refused", id="max_tokens-5.0"),
    pytest.param(sgs(key=id_array(1, 2, 3, dtype="uint32")), "refused", id="key-[3]"),
    pytest.param(sgs(key=id_array(1, 2)), "refused", id="key-int32"),
    pytest.param(sgs(draft_model=None, drafter=3), "refused", id="drafter-3"),
    pytest.param(sgs(draft_model=None, drafter=Named("class")), "refused", id="drafter-class"),
    pytest.param(sgs(adaptive=1), "refused", id="adaptive-1"),
    pytest.param(sgs(kv_bits=7), "refused", id="kv_bits-7"),
    pytest.param(sgs(kv_group_size=48), "refused", id="kv_group_size-48"),
    pytest.param(
        sgs(kv_bits=4, quantized_kv_start=0),
        "refused",
        id="kv_group_size-above-head-dim",
        marks=xfail(
            "64 > the heads' 16 dimensions: MLX's own '[quantize]', mid-way (generation.py)"
        ),
    ),
    pytest.param(
        Case("PromptLookupDrafter", {"max_ngram": 2**63}, ("max_ngram",)),
        "refused",
        id="max_ngram-2**63",
    ),
    pytest.param(
        sgs(eos_token_ids=Arr(np.array(3, np.int32), "int32")), "refused", id="eos-0-d-array"
    ),
    # Class 4: `stream` of the ops and the masks, `fused`.
    *(
        pytest.param(case, "refused", id=f"{case.function}-stream-{name}")
        for name, value in [("'cpu'", "cpu"), ("-1", -1), ("str", Named("object"))]
        for case in (greedy(stream=value), sampled(stream=value))
    ),
    # MLX takes 0 for its DeviceType cpu.
    pytest.param(greedy(stream=0), None, id="accept_greedy-stream-0"),
    pytest.param(sampled(stream=0), None, id="accept_sampled-stream-0"),
    *(
        pytest.param(mask(f, stream=value), "refused", id=f"{f}-stream-{name}")
        for f in ("top_p_mask", "min_p_mask", "top_k_mask")
        for name, value in [("'cpu'", "cpu"), ("gpu", Named("gpu"))]
        if name != "gpu" or not GPU
    ),
    pytest.param(greedy(fused=np.array([], dtype=bool)), "refused", id="fused-empty-array"),
    pytest.param(sampled(fused="yes"), "refused", id="fused-'yes'"),
    # Class 3: rows that are no distribution, or have no finite maximum.
    pytest.param(
        greedy(logits=Arr(np.full((3, 3), -np.inf, np.float32), "float32")),
        "flagged",
        id="greedy-all--inf",
    ),
    pytest.param(sampled(probs=Arr(2 * PROBS.values, "float32")), "flagged", id="probs-sum-2"),
    pytest.param(
        sampled(probs=Arr(PROBS.values - 0.15, "float32")), "flagged", id="probs-negative"
    ),
    pytest.param(sampled(draft_probs=Arr(np.log(Q), "float32")), "flagged", id="draft_probs-log"),
    # Class 5 and empty batches.
    pytest.param(Case("make_sampler", {"temp": 1e-39}, ("temp",)), "refused", id="temp-1e-39"),
    pytest.param(Case("make_sampler", {"temp": 1e308}, ("temp",)), "refused", id="temp-1e308"),
    pytest.param(
        sampler_call("SpecSampler.probs", {"temp": 1e-5}, FLOAT16_LOGPROBS),
        "right",
        id="temp-1e-5-float16",
    ),
    *(
        pytest.param(
            sampler_call(m, {"temp": temp}, EMPTY_BATCH), "refused", id=f"{m}-temp-{temp}-[0, V]"
        )
        for m, temp in [
            ("SpecSampler.__call__", 0.0),
            ("SpecSampler.__call__", 1.0),
            ("SpecSampler.probs", 0.0),
        ]
    ),
]


@pytest.mark.parametrize(("case", "expect"), KNOWN_CASES)
def test_known_case(worker, case, expect):
    judge(case, worker.call(case, LIMIT), expect)


def test_large_vocabulary_draft_proposes_ids_the_target_lacks(worker):
    # Guards the case "draft-larger-vocab": its draft must propose such ids.
    outcome = worker.call(Case("plain", {"model": "big-draft", "prompt": PROMPT.values.tolist()}))
    assert max(outcome["facts"]["tokens"]) >= VOCAB, outcome


def test_a_round_drafts_no_more_than_the_tokens_left(worker):
    # Issue 15, class 2: the most draft tokens a round for 2 tokens in all: one draft at most.
    case = sgs(num_draft_tokens=MAX_DRAFT_TOKENS, max_tokens=2, stats=Named("stats"))
    outcome = worker.call(case)
    judge(case, outcome, "right")
    assert outcome["facts"]["drafted"] <= 1, outcome


# -- the judge fails what it must ------------------------------------------------------------------

FAILS = (AssertionError, pytest.fail.Exception)


@pytest.mark.parametrize(
    "message",
    [
        "bad value",  # names no function
        "accept_greedy: `draft` must be [n] uint32 or int32",  # names another argument
        "accept_sampled: `eos` must be an mx.array",  # names another function
    ],
)
def test_judge_fails_a_refusal_that_does_not_name_the_function_and_argument(message):
    with pytest.raises(FAILS):
        judge(greedy(eos=3), {"kind": "ValueError", "message": message})


@pytest.mark.parametrize(
    "outcome",
    [
        {"kind": "error", "type": "TypeError", "message": "", "traceback": ""},
        {"kind": "crash", "returncode": -11, "stderr": ""},
        {"kind": "hang", "limit": LIMIT},
    ],
)
def test_judge_fails_another_exception_a_crash_and_a_hang(outcome):
    with pytest.raises(FAILS):
        judge(greedy(eos=3), outcome)


def test_judge_fails_a_wrong_acceptance(worker):
    case = greedy(eos=id_array(1))
    outcome = worker.call(case)
    judge(case, outcome, "right")
    accepted, token, eos_hit = outcome["facts"]["verdict"]
    outcome["facts"]["verdict"] = (accepted, token + 1, eos_hit)
    with pytest.raises(FAILS):
        judge(case, outcome)


def test_judge_fails_a_wrong_generation(worker):
    case = sgs(max_tokens=3)
    outcome = worker.call(case)
    judge(case, outcome, "right")
    outcome["facts"]["tokens"][-1] += 1
    with pytest.raises(FAILS):
        judge(case, outcome)


# -- interrupts ----------------------------------------------------------------------------------

#: Generations cut short by SIGINTs: a few in the quick suite, many with --full (the same setups
#: in turn and the same draws of delays, continued).
INTERRUPTS = [
    pytest.param(12, id="quick", marks=pytest.mark.quick_only),
    pytest.param(80, id="full", marks=pytest.mark.slow),
]


def interrupted_generations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Runs ``tests/interrupt_runner.py`` for ``count`` generations, sending a SIGINT at a
    random moment of each (fixed seed: a delay drawn in ``[0, 0.8 t)`` after it starts, where
    ``t`` is the time the worker measured for an uninterrupted generation of the same setup, so
    that the signals land during the generations however fast the machine); returns what it
    reported for each."""
    import json
    import random
    import signal

    paths = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "interrupt_runner.py"), str(count)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    delays = random.Random(seed)
    reports = []
    deadline = time.monotonic() + START_LIMIT + 20 * count
    try:
        for line in proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                seconds = message["seconds"]
            elif "go" in message:
                time.sleep(delays.uniform(0.0, 0.8 * seconds[message["go"]]))
                proc.send_signal(signal.SIGINT)
            elif "setup" in message:
                reports.append(message)
            assert time.monotonic() < deadline, "the interrupted generations took too long"
        code = proc.wait(timeout=30)
        assert code == 0, f"the worker ended with {code}: {proc.stderr.read()[-4000:]}"
    finally:
        proc.kill()
    return reports


@pytest.mark.parametrize("count", INTERRUPTS)
def test_interrupts_leave_the_prompt_and_yielded_tokens_in_every_cache(count):
    # Issue 32: Ctrl-C inside the target's forward pass left unverified tokens in the caller's
    # prompt_cache. A SIGINT wherever it lands must leave every cache holding the prompt and the
    # tokens yielded, and the next turn on them continuing plain greedy decoding.
    reports = interrupted_generations(count)
    assert len(reports) == count
    for report in reports:
        assert report["text ok"] and report["continues"], report
        assert report["offsets"] == [report["expected offset"]], report
    # The signals landed at many moments: most generations were cut short, at many lengths.
    cut_short = [r["yielded"] for r in reports if r["interrupted"]]
    assert len(cut_short) >= count // 2 and len(set(cut_short)) >= count // 4, reports
