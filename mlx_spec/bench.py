"""The measurements behind ``mlx-spec bench`` and ``mlx-spec demo`` (and ``benchmarks/*.py``).

Two questions, each answered by ratios measured in one run, never by a stored expectation:

- **How fast is one verification step?** :func:`acceptance_cases` builds, for a vocabulary size
  ``V`` and a draft length ``N``, the acceptance of mlx-spec, its floor (a max over the same rows
  plus a read: no acceptance reads its rows faster) and mlx-lm's verification path;
  :func:`time_cases` times them interleaved.
- **Does speculation pay in generation?** :func:`run_mlx_spec`, :func:`run_mlx_lm` and
  :func:`run_plain` generate on the same models, prompt and seed and return a :class:`Tally`;
  :func:`generation_rows` runs them interleaved over temperatures and draft lengths.

Needs mlx-lm (``pip install "mlx-spec[lm]"``); the plots need matplotlib (``[bench]``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generate_step

from . import kernels
from ._demo import DEMO_DIR, PROMPTS
from .acceptance import accept_greedy, accept_sampled, read
from .generation import SpeculativeStats, speculative_generate_step
from .patch import _LM_MAKE_SAMPLER, _LM_SPECULATIVE_STEP
from .sampling import make_sampler

VOCABS = (32000, 152064, 262144)
DRAFTS = (1, 4, 8, 16)
Progress = Callable[[str], None]


# -- acceptance: one verification step ---------------------------------------------------------


def _match(tokens: list[int], draft: list[int]) -> tuple[int, int]:
    n = 0
    while n < len(draft) and tokens[n] == draft[n]:
        n += 1
    return n, tokens[n]


def _mlx_lm_greedy(logits: mx.array, draft: mx.array) -> tuple[int, int]:
    """mlx-lm's verification at temperature 0: log-softmax, argmax, tolist, compare."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.argmax(logprobs, axis=-1)
    mx.eval(tokens, draft)
    return _match(tokens.tolist(), draft.tolist())


def _mlx_lm_sampled(logits: mx.array, draft: mx.array) -> tuple[int, int]:
    """mlx-lm's verification at temperature 1: log-softmax, categorical, tolist, compare."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.random.categorical(logprobs)
    mx.eval(tokens, draft)
    return _match(tokens.tolist(), draft.tolist())


def _torch_on(device: str) -> Any:
    """PyTorch where it is installed and (for ``"cuda"``) sees a CUDA GPU, else ``None``."""
    try:
        import torch
    except ImportError:
        return None
    return torch if device != "cuda" or torch.cuda.is_available() else None


def torch_greedy_peers(
    logits_np: np.ndarray, draft_np: np.ndarray, *, device: str = "cuda"
) -> dict[str, Callable[[], object]]:
    """Greedy acceptance as vLLM writes it in PyTorch (argmax, compare, cumprod), and its floor.

    Args:
        logits_np (np.ndarray): ``[N + 1, V]`` float32 rows, moved to ``device`` as bfloat16.
        draft_np (np.ndarray): ``[N]`` integer draft tokens.
        device (str, optional): PyTorch's device. Default: ``"cuda"``.

    Returns:
        dict: ``torch floor`` (a max over the rows + ``tolist``) and ``torch greedy``
        (``[accepted, next]`` with ``tolist``), or ``{}`` where PyTorch is missing or (for
        ``"cuda"``) sees no CUDA GPU.
    """
    torch = _torch_on(device)
    if torch is None:
        return {}
    logits = torch.from_numpy(logits_np).to(device, torch.bfloat16)
    draft = torch.from_numpy(draft_np.astype(np.int64)).to(device)
    n = draft.shape[0]

    def greedy() -> list[int]:
        choice = logits.argmax(dim=-1)
        ok = (choice[:n] == draft).to(torch.int32)
        accepted = ok.cumprod(0).sum()
        return torch.stack([accepted, choice[accepted]]).tolist()

    return {
        "torch floor": lambda: logits.max(dim=-1).values.float().tolist(),
        "torch greedy": greedy,
    }


def _torch_peers(
    logits_np: np.ndarray, probs_np: np.ndarray, q_np: np.ndarray, draft_np: np.ndarray
) -> dict[str, Callable[[], object]]:
    """vLLM-style acceptance in PyTorch on a CUDA GPU, or ``{}`` where there is none."""
    torch = _torch_on("cuda")
    if torch is None:
        return {}
    dev = torch.device("cuda")
    probs = torch.from_numpy(probs_np).to(dev)
    q = torch.from_numpy(q_np).to(dev)
    draft = torch.from_numpy(draft_np.astype(np.int64)).to(dev)
    n = draft.shape[0]
    gen = torch.Generator(device=dev).manual_seed(0)

    def sampled(with_q: bool) -> list[int]:
        rows = torch.arange(n, device=dev)
        p_d = probs[rows, draft]
        q_d = q[rows, draft] if with_q else torch.ones_like(p_d)
        u = torch.rand(n, device=dev, generator=gen)
        ok = (u * q_d < p_d).to(torch.int32)
        accepted = ok.cumprod(0).sum()
        qn = q if with_q else torch.nn.functional.one_hot(draft, probs.shape[1]).to(probs.dtype)
        residual = torch.cat([(probs[:n] - qn).clamp_min(0), probs[n:]], 0)
        residual = residual / residual.sum(-1, keepdim=True)
        race = torch.empty_like(residual).exponential_(generator=gen)
        choice = (residual / race).argmax(-1)
        return torch.stack([accepted, choice[accepted]]).tolist()

    return {
        **torch_greedy_peers(logits_np, draft_np),
        "torch sampled q": lambda: sampled(True),
        "torch sampled none": lambda: sampled(False),
    }


def acceptance_cases(v: int, n: int) -> dict[str, Callable[[], object]]:
    """The verification steps to time for vocabulary ``v`` and draft length ``n``.

    Inputs: bfloat16 logits as a model hands them over (the last ``n + 1`` rows of a
    ``[1, n + 2, v]`` output), float32 probabilities and draft distributions, and a uint32 draft
    that agrees with the argmax for about half its length.

    Returns:
        dict: name to a function that runs the step and reads its result on the host:
        ``floor bf16``, ``greedy``, ``mlx-lm greedy``, ``floor f32``, ``sampled q`` (with
        ``draft_probs``), ``sampled none`` (deterministic drafts), ``mlx-lm sampled``,
        ``nan check`` (what reporting a NaN row costs ``accept_greedy``: a gather of one value
        per row at its argmax and ``isnan``, + a read), the ``torch ...`` peers where PyTorch
        sees a CUDA GPU and, where MLX runs on CUDA, mlx-spec's fused kernels (``fused ...``,
        ``fused=True``).
    """
    rng = np.random.default_rng(v + n)
    logits_np = (rng.standard_normal((n + 1, v), dtype=np.float32) * 4).astype(np.float32)
    out = mx.array(np.concatenate([logits_np[:1], logits_np])[None]).astype(mx.bfloat16)
    logits = out[0, -(n + 1) :]
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    q = mx.softmax(mx.array(rng.standard_normal((n, v), dtype=np.float32) * 4), axis=-1)
    draft = mx.argmax(logits[:n], axis=-1).astype(mx.uint32)
    draft = mx.where(mx.arange(n) < n // 2, draft, (draft + 1) % v)
    rows32 = logits.astype(mx.float32)
    choice = mx.argmax(rows32, axis=-1)[:, None]
    mx.eval(out, probs, q, draft, rows32, choice)
    key = mx.random.key(0)
    cases: dict[str, Callable[[], object]] = {
        "floor bf16": lambda: mx.max(logits, axis=-1).tolist(),
        "greedy": lambda: read(accept_greedy(logits, draft)),
        "mlx-lm greedy": lambda: _mlx_lm_greedy(logits, draft),
        "nan check": lambda: mx.isnan(mx.take_along_axis(rows32, choice, axis=-1)).tolist(),
        "floor f32": lambda: mx.max(probs, axis=-1).tolist(),
        "sampled q": lambda: read(accept_sampled(probs, draft, q, None, key)),
        "sampled none": lambda: read(accept_sampled(probs, draft, None, None, key)),
        "mlx-lm sampled": lambda: _mlx_lm_sampled(logits, draft),
    }
    if kernels.available():
        cases["fused greedy"] = lambda: read(accept_greedy(logits, draft, fused=True))
        cases["fused sampled q"] = lambda: read(
            accept_sampled(probs, draft, q, None, key, fused=True)
        )
        cases["fused sampled none"] = lambda: read(
            accept_sampled(probs, draft, None, None, key, fused=True)
        )
    cases.update(
        _torch_peers(
            np.array(logits.astype(mx.float32)), np.array(probs), np.array(q), np.array(draft)
        )
    )
    return cases


def time_cases(
    cases: dict[str, Callable[[], object]], repeats: int, *, capped: Iterable[str] = ()
) -> dict[str, float]:
    """Median seconds of each case over ``repeats`` interleaved runs, after two warm-up runs.

    Each timed run follows an untimed run of the same case, so every case meets a warm cache, as
    rows just written by a model's forward pass would be; without it, the case that follows
    another one on the same rows inherits that case's cache and looks faster.

    Args:
        cases (dict): name to a function to time.
        repeats (int): runs of each case, interleaved so that load on the machine hits all.
        capped (iterable of str): slow cases timed three times only.

    Returns:
        dict: name to the median seconds.
    """
    capped = set(capped)
    for fn in cases.values():
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            if name in capped and len(samples[name]) >= 3:
                continue
            fn()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def acceptance_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of :func:`acceptance_rows` as a text table: times in ms, ratios to the floor and
    ``speedup`` = mlx-lm's time / mlx-spec's."""
    head = (
        f"{'V':>7} {'N':>3} | {'floor16':>8} {'greedy':>8} {'x floor':>7} {'mlx-lm':>8} "
        f"{'speedup':>7} | {'floor32':>8} {'samp q':>8} {'x floor':>7} {'samp -':>8} "
        f"{'x floor':>7} {'mlx-lm':>8} {'speedup':>7} | {'nan chk':>8} {'x floor':>7}"
    )
    extra = [k for k in rows[0] if k.startswith(("oracle", "fused", "torch"))]
    head += "".join(f" | {k:>18}" for k in extra)
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = {k: v * 1e3 for k, v in r.items() if isinstance(v, float)}
        line = (
            f"{r['V']:>7} {r['N']:>3} | {ms['floor bf16']:8.3f} {ms['greedy']:8.3f} "
            f"{r['greedy'] / r['floor bf16']:7.2f} {ms['mlx-lm greedy']:8.3f} "
            f"{r['mlx-lm greedy'] / r['greedy']:7.1f} | {ms['floor f32']:8.3f} "
            f"{ms['sampled q']:8.3f} {r['sampled q'] / r['floor f32']:7.2f} "
            f"{ms['sampled none']:8.3f} {r['sampled none'] / r['floor f32']:7.2f} "
            f"{ms['mlx-lm sampled']:8.3f} {r['mlx-lm sampled'] / r['sampled q']:7.1f} | "
            f"{ms['nan check']:8.3f} {r['nan check'] / r['floor bf16']:7.3f}"
        )
        line += "".join(f" | {ms[k]:15.3f} ms" for k in extra)
        lines.append(line)
    return "\n".join(lines)


def acceptance_rows(
    configs: Sequence[tuple[int, int]],
    repeats: int,
    progress: Progress = lambda _: None,
    extra_cases: Callable[[int, int, dict], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Times :func:`acceptance_cases` for each ``(V, N)`` in ``configs``.

    Args:
        configs (sequence): ``(V, N)`` pairs.
        repeats (int): interleaved repeats per case.
        progress (callable): called with a short label before each configuration.
        extra_cases (callable, optional): called with ``(V, N, cases)`` to add cases (the
            benchmark script adds the NumPy oracle, timed three times).
        on_row (callable, optional): called with each row as soon as it is measured.

    Returns:
        list of dict: ``{"V": V, "N": N, case name: median seconds, ...}`` per configuration.
    """
    rows = []
    for i, (v, n) in enumerate(configs, 1):
        progress(f"acceptance {i}/{len(configs)}: V={v} N={n}")
        cases = acceptance_cases(v, n)
        if extra_cases is not None:
            extra_cases(v, n, cases)
        times = time_cases(cases, repeats, capped=[k for k in cases if k.startswith("oracle")])
        rows.append({"V": v, "N": n, **times})
        on_row(rows[-1])
    return rows


# -- generation: does speculation pay ----------------------------------------------------------


@dataclass
class Tally:
    """Totals of one method over one or more generations.

    Attributes:
        tokens (int): tokens generated.
        rounds (int): target calls (plain decoding: one per token).
        drafted (int): draft tokens proposed.
        accepted (int): draft tokens kept.
        seconds (float): wall time of the generations, prefill included.
    """

    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """float: ``tokens / seconds`` (0 before any)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """float: ``tokens / rounds`` (0 before any)."""
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """float or None: ``accepted / drafted``; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    def __iadd__(self, other: Tally) -> Tally:
        for name in ("tokens", "rounds", "drafted", "accepted", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def _drain(steps: Iterator[tuple]) -> tuple[list[bool], float]:
    """Runs a generator of mlx-lm's step tuples; returns each token's ``from_draft`` and the
    seconds taken."""
    tic = time.perf_counter()
    flags = [len(item) == 3 and bool(item[2]) for item in steps]
    return flags, time.perf_counter() - tic


def run_mlx_spec(
    prompt: mx.array,
    target: nn.Module,
    draft: nn.Module,
    num_draft_tokens: int,
    temp: float,
    seed: int,
    max_tokens: int,
) -> Tally:
    """mlx-spec's loop (rejection sampling at ``temp`` > 0) with key ``mx.random.key(seed)``."""
    stats = SpeculativeStats()
    steps = speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temp),
        key=mx.random.key(seed),
        stats=stats,
    )
    flags, seconds = _drain(steps)
    return Tally(len(flags), stats.rounds, stats.drafted, stats.accepted, seconds)


def mlx_lm_rounds(flags: Sequence[bool], num_draft_tokens: int, max_tokens: int) -> Tally:
    """Rounds, drafted and accepted tokens of mlx-lm's loop, from its ``from_draft`` flags.

    Each round of ``mlx_lm.generate.speculative_generate_step`` drafts
    ``min(num_draft_tokens, max_tokens - tokens so far)`` tokens and ends with one target token;
    a last round cut by ``max_tokens`` may end on a draft token.
    """
    tally = Tally(tokens=len(flags))
    start = 0
    while start < len(flags):
        tally.rounds += 1
        tally.drafted += min(num_draft_tokens, max_tokens - start)
        stop = start
        while stop < len(flags) and flags[stop]:
            stop += 1
        tally.accepted += stop - start
        start = stop + 1
    return tally


def run_mlx_lm(
    prompt: mx.array,
    target: nn.Module,
    draft: nn.Module,
    num_draft_tokens: int,
    temp: float,
    seed: int,
    max_tokens: int,
) -> Tally:
    """mlx-lm's own speculative loop with mlx-lm's sampler, after ``mx.random.seed(seed)``; also
    while :func:`mlx_spec.patch_mlx_lm` routes mlx-lm through mlx-spec."""
    mx.random.seed(seed)
    # mlx-lm's loop and sampler factory as they were before any patch: looked up in mlx-lm now,
    # or imported from it after a patch, they would be mlx-spec's.
    steps = _LM_SPECULATIVE_STEP(
        prompt,
        target,
        draft,
        num_draft_tokens=num_draft_tokens,
        max_tokens=max_tokens,
        sampler=_LM_MAKE_SAMPLER(temp=temp),
    )
    flags, seconds = _drain(steps)
    tally = mlx_lm_rounds(flags, num_draft_tokens, max_tokens)
    tally.seconds = seconds
    return tally


def run_plain(
    prompt: mx.array, target: nn.Module, temp: float, seed: int, max_tokens: int
) -> Tally:
    """Plain decoding, ``mlx_lm.generate.generate_step``, after ``mx.random.seed(seed)``."""
    mx.random.seed(seed)
    steps = generate_step(
        prompt, target, max_tokens=max_tokens, sampler=_LM_MAKE_SAMPLER(temp=temp)
    )
    flags, seconds = _drain(steps)
    return Tally(tokens=len(flags), rounds=len(flags), seconds=seconds)


def load_demo_pair() -> tuple[nn.Module, nn.Module, Any]:
    """The shipped pair: ``(target, draft, tokenizer)``, loaded with ``mlx_lm.load``."""
    from mlx_lm import load

    target, tokenizer = load(str(DEMO_DIR / "target"))
    draft, _ = load(str(DEMO_DIR / "draft"))
    return target, draft, tokenizer


def warm_up(target: nn.Module, draft: nn.Module, prompt: mx.array) -> None:
    """Compiles kernels and fills MLX's buffer cache for every method."""
    for temp in (0.0, 1.0):
        run_mlx_spec(prompt, target, draft, 2, temp, 0, 8)
        run_mlx_lm(prompt, target, draft, 2, temp, 0, 8)
        run_plain(prompt, target, temp, 0, 8)


def choose_num_draft_tokens(
    target: nn.Module,
    draft: nn.Module,
    prompts: Sequence[mx.array],
    temps: Sequence[float],
    candidates: Sequence[int] = (1, 2, 3),
    max_tokens: int = 24,
) -> tuple[int, dict[int, float]]:
    """The draft length that generates the most tokens per second on this machine, measured.

    Every candidate runs on every prompt and temperature (seed 100), interleaved; its tokens per
    second are its total tokens over its total time.

    Returns:
        tuple: the best ``N`` and each candidate's tokens per second.
    """
    tallies = {n: Tally() for n in candidates}
    for prompt in prompts:
        for temp in temps:
            for n in candidates:
                tallies[n] += run_mlx_spec(prompt, target, draft, n, temp, 100, max_tokens)
    speeds = {n: t.tokens_per_second for n, t in tallies.items()}
    return max(speeds, key=speeds.__getitem__), speeds


def generation_rows(
    target: nn.Module,
    draft: nn.Module,
    prompts: Sequence[mx.array],
    temps: Sequence[float],
    drafts: Sequence[int],
    max_tokens: int,
    progress: Progress = lambda _: None,
    on_row: Callable[[dict[str, Any]], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """mlx-spec, mlx-lm's speculative loop and plain decoding for each temperature and ``N``.

    The three run interleaved prompt by prompt (prompt ``i`` with seed ``i``); plain decoding
    does not depend on ``N`` and runs once per temperature. ``progress`` is called with a short
    label before each ``(temp, N)``, ``on_row`` with each row as soon as it is measured.

    Returns:
        list of dict: per ``(temp, N)``: ``temp``, ``N``, and for ``mlx-spec``, ``mlx-lm`` and
        ``plain`` a dict with ``tokens``, ``rounds``, ``drafted``, ``accepted``, ``seconds``,
        ``tokens_per_second``, ``tokens_per_round`` and ``acceptance_rate``.
    """
    rows = []
    total = len(temps) * len(drafts)
    for t, temp in enumerate(temps):
        plain = Tally()
        for i, prompt in enumerate(prompts):
            plain += run_plain(prompt, target, temp, i, max_tokens)
        for j, n in enumerate(drafts):
            progress(f"generation {t * len(drafts) + j + 1}/{total}: temp={temp} N={n}")
            ours, theirs = Tally(), Tally()
            for i, prompt in enumerate(prompts):
                ours += run_mlx_spec(prompt, target, draft, n, temp, i, max_tokens)
                theirs += run_mlx_lm(prompt, target, draft, n, temp, i, max_tokens)
            rows.append(
                {
                    "temp": temp,
                    "N": n,
                    **{k: _tally_dict(v) for k, v in [("mlx-spec", ours), ("mlx-lm", theirs)]},
                    "plain": _tally_dict(plain),
                }
            )
            on_row(rows[-1])
    return rows


def _tally_dict(tally: Tally) -> dict[str, Any]:
    return {
        **asdict(tally),
        "tokens_per_second": tally.tokens_per_second,
        "tokens_per_round": tally.tokens_per_round,
        "acceptance_rate": tally.acceptance_rate,
    }


def generation_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of :func:`generation_rows` as a Markdown table of tokens per round and per second."""
    lines = [
        "| temp | N | tok/round mlx-spec | tok/round mlx-lm | ratio | tok/s mlx-spec "
        "| tok/s mlx-lm | tok/s plain | mlx-spec/mlx-lm | mlx-spec/plain |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        ours, theirs, plain = r["mlx-spec"], r["mlx-lm"], r["plain"]
        tps = [m["tokens_per_second"] for m in (ours, theirs, plain)]
        lines.append(
            f"| {r['temp']:.2f} | {r['N']} | {ours['tokens_per_round']:.2f} | "
            f"{theirs['tokens_per_round']:.2f} | "
            f"{ours['tokens_per_round'] / theirs['tokens_per_round']:.2f}x | "
            f"{tps[0]:.0f} | {tps[1]:.0f} | {tps[2]:.0f} | "
            f"{tps[0] / tps[1]:.2f}x | {tps[0] / tps[2]:.2f}x |"
        )
    return "\n".join(lines)


# -- plots and the whole benchmark -------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(rows: Sequence[dict[str, Any]], path: Path, *, subtitle: str = "") -> None:
    """Writes a PNG: latency of one verification step against ``V``, for the largest ``N``
    measured, greedy (left) and sampled (right), beside the floor and the peers."""
    plt = _pyplot()
    n = max(r["N"] for r in rows)
    rows = sorted((r for r in rows if r["N"] == n), key=lambda r: r["V"])
    vocabs = [r["V"] for r in rows]
    panels = {
        "greedy (bfloat16 logits)": [
            ("floor bf16", "floor: max + read", ":", "gray"),
            ("greedy", "mlx-spec accept_greedy", "-", "C0"),
            ("mlx-lm greedy", "mlx-lm verification", "--", "C3"),
            ("torch greedy", "PyTorch (vLLM-style)", "-.", "C2"),
        ],
        "sampled (float32 probabilities)": [
            ("floor f32", "floor: max + read", ":", "gray"),
            ("sampled q", "mlx-spec accept_sampled", "-", "C0"),
            ("sampled none", "mlx-spec, deterministic drafts", "-", "C1"),
            ("mlx-lm sampled", "mlx-lm verification", "--", "C3"),
            ("torch sampled q", "PyTorch (vLLM-style)", "-.", "C2"),
        ],
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, (title, series) in zip(axes, panels.items(), strict=True):
        for key, label, style, color in series:
            if key in rows[0]:
                ms = [r[key] * 1e3 for r in rows]
                ax.plot(vocabs, ms, style, color=color, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(vocabs, [f"{v // 1000}k" for v in vocabs])
        ax.minorticks_off()
        ax.set_xlabel("vocabulary size V")
        ax.set_title(f"{title}, N = {n}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("latency of one step, ms (median)")
    fig.suptitle(f"One verification step, acceptance + host read{subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_generation(rows: Sequence[dict[str, Any]], path: Path, *, subtitle: str = "") -> None:
    """Writes a PNG: tokens per round (left) and tokens per second (right) against temperature,
    mlx-spec against mlx-lm's speculative loop for each ``N``, and plain decoding."""
    plt = _pyplot()
    temps = sorted({r["temp"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, n in enumerate(sorted({r["N"] for r in rows})):
        mine = sorted((r for r in rows if r["N"] == n), key=lambda r: r["temp"])
        color = f"C{k}"
        for metric, ax in zip(("tokens_per_round", "tokens_per_second"), axes, strict=True):
            ax.plot(
                temps,
                [r["mlx-spec"][metric] for r in mine],
                "-o",
                color=color,
                label=f"mlx-spec, N = {n}",
            )
            ax.plot(
                temps,
                [r["mlx-lm"][metric] for r in mine],
                "--s",
                color=color,
                label=f"mlx-lm, N = {n}",
            )
    plain = [next(r for r in rows if r["temp"] == t)["plain"] for t in temps]
    axes[0].axhline(1.0, color="gray", linestyle=":", label="plain decoding")
    axes[1].plot(
        temps,
        [p["tokens_per_second"] for p in plain],
        ":",
        color="gray",
        marker="^",
        label="plain decoding",
    )
    axes[0].set_ylabel("tokens per target call (mean)")
    axes[1].set_ylabel("tokens per second")
    for ax in axes:
        ax.set_xlabel("temperature")
        ax.set_xticks(temps)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("Tokens per round")
    axes[1].set_title("Tokens per second")
    fig.suptitle(f"Speculative generation on the shipped demo pair{subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    """dict: date, OS, CPU, core count, Python, MLX and mlx-lm versions, MLX's device."""
    from importlib.metadata import version

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "system": f"{platform.system()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
    }


def _write_json(data: dict[str, Any], path: Path) -> None:
    """Writes ``data`` to ``path`` through a file beside it, so that ``path`` always holds a
    whole JSON document: the last one written."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)


def run_benchmark(
    out: Path, quick: bool, progress: Callable[[int, int, str], None] = lambda *_: None
) -> dict[str, Any]:
    """Runs both benchmarks, writes ``results.json``, ``acceptance.png`` and ``generation.png``
    into ``out`` (created if needed) and returns the results.

    ``results.json`` is written before the first measurement (the machine and the settings),
    then again after each measured row, so that a run that is interrupted or fails keeps what
    it measured.

    Args:
        out (Path): the output folder.
        quick (bool): fewer configurations, repeats, prompts and tokens (under a minute on two
            CPU cores).
        progress (callable): called with ``(step, steps, label)`` before each of the ``steps``
            measurements.

    Returns:
        dict: ``machine``, ``settings``, ``acceptance`` (rows of :func:`acceptance_rows`) and
        ``generation`` (rows of :func:`generation_rows`).
    """
    out.mkdir(parents=True, exist_ok=True)
    if quick:
        configs, repeats = [(v, 8) for v in VOCABS], 7
        temps, drafts, n_prompts, max_tokens = (0.0, 0.5, 1.0), (2, 4), 2, 48
    else:
        configs, repeats = [(v, n) for v in VOCABS for n in DRAFTS], 25
        temps, drafts, n_prompts, max_tokens = (0.0, 0.25, 0.5, 0.75, 1.0), (1, 2, 4), 4, 128
    settings = {
        "quick": quick,
        "acceptance": {"configs": configs, "repeats": repeats},
        "generation": {
            "models": "shipped demo pair (mlx_spec/demo)",
            "temps": temps,
            "num_draft_tokens": drafts,
            "prompts": PROMPTS[:n_prompts],
            "max_tokens": max_tokens,
        },
    }
    steps = len(configs) + 1 + len(temps) * len(drafts)
    done = 0

    def step(label: str) -> None:
        nonlocal done
        done += 1
        progress(done, steps, label)

    results: dict[str, Any] = {
        "machine": machine(),
        "settings": settings,
        "acceptance": [],
        "generation": [],
    }
    path = out / "results.json"

    def keep(part: str) -> Callable[[dict[str, Any]], None]:
        def add(row: dict[str, Any]) -> None:
            results[part].append(row)
            _write_json(results, path)

        return add

    _write_json(results, path)
    acceptance_rows(configs, repeats, step, on_row=keep("acceptance"))
    step("generation: loading the demo pair, warm-up")
    target, draft, tokenizer = load_demo_pair()
    prompts = [mx.array(tokenizer.encode(p)) for p in PROMPTS[:n_prompts]]
    warm_up(target, draft, prompts[0])
    generation_rows(
        target, draft, prompts, temps, drafts, max_tokens, step, on_row=keep("generation")
    )
    m = results["machine"]
    subtitle = (
        f"\n{m['date'][:10]}, {m['system']}, {m['cpu_count']} cores, MLX {m['mlx']} {m['device']}"
    )
    plot_acceptance(results["acceptance"], out / "acceptance.png", subtitle=subtitle)
    plot_generation(results["generation"], out / "generation.png", subtitle=subtitle)
    return results
