"""Generation benchmark: plain decoding, mlx-lm's speculative decoding and mlx-spec, measured alike.

What ``mlx-spec bench`` and ``mlx-spec demo`` run, and ``benchmarks/generation.py`` builds on. A
:class:`Method` generates through a public API (:func:`plain`, :func:`mlx_lm`, :func:`mlx_spec`).
:func:`measure` runs methods interleaved prompt by prompt, so that load on the machine hits them
alike, each twice in a row: the first run is its first use of the prompt's shapes (on MLX's CUDA
backend each new shape of an attention call first builds a graph), the second the steady state.
:func:`summarize` sets each against plain decoding, mlx-lm's loop and the best fixed draft length
of the same run; :func:`table` prints that.

Needs mlx-lm (``pip install "mlx-spec[lm]"``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from ._demo import DEMO_DIR, GROUNDED, PROMPTS
from .drafters import Drafter
from .generation import SpeculativeStats, speculative_generate_step
from .patch import _LM_MAKE_SAMPLER, _LM_SPECULATIVE_STEP
from .sampling import make_sampler

Generate = Callable[[mx.array, float, int, int], SpeculativeStats]
"""``(prompt, temp, seed, max_tokens) -> counts``: one whole generation."""

PHASES = ("first", "steady")
"""The two runs in a row of each method on each prompt."""


@dataclass(frozen=True)
class Method:
    """A way to generate, and what it is compared with.

    Attributes:
        name (str): its label, unique within a run.
        generate (Generate): runs one generation and returns its counts.
        drafter (str): ``"plain"``, ``"mlx-lm"`` (mlx-lm's loop with a draft model), ``"draft"``
            (mlx-spec with a draft model), ``"lookup"`` (mlx-spec with prompt lookup), or the
            label of another drafter.
        n (int): the most draft tokens a round (0 for plain decoding).
        adaptive (bool): whether each round chooses its draft length.
        model (str): the target it runs on: ratios compare methods of the same target.
    """

    name: str
    generate: Generate
    drafter: str = "plain"
    n: int = 0
    adaptive: bool = False
    model: str = ""


@dataclass
class Timed:
    """Counts of one or more generations, and their wall time (prefill included)."""

    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """float: generated tokens over seconds (0 before any)."""
        return self.stats.generated / self.seconds if self.seconds else 0.0

    def __add__(self, other: Timed) -> Timed:
        a, b = self.stats, other.stats
        total = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)}
        return Timed(SpeculativeStats(**total), self.seconds + other.seconds)


def run(method: Method, prompt: mx.array, temp: float, seed: int, max_tokens: int) -> Timed:
    """One generation of ``method``, timed."""
    start = time.perf_counter()
    stats = method.generate(prompt, temp, seed, max_tokens)
    return Timed(stats, time.perf_counter() - start)


def plain(target: nn.Module) -> Method:
    """Plain decoding: ``mlx_lm.generate.generate_step`` with mlx-lm's sampler, after
    ``mx.random.seed(seed)``; one round per token."""

    def generate(prompt: mx.array, temp: float, seed: int, max_tokens: int) -> SpeculativeStats:
        mx.random.seed(seed)
        sampler = _LM_MAKE_SAMPLER(temp=temp)
        steps = generate_step(prompt, target, max_tokens=max_tokens, sampler=sampler)
        tokens = sum(1 for _ in steps)
        return SpeculativeStats(rounds=tokens, generated=tokens)

    return Method("plain", generate)


def mlx_lm_stats(from_draft: Sequence[bool], n: int, max_tokens: int) -> SpeculativeStats:
    """The counts of mlx-lm's loop, from the ``from_draft`` flag of each token it yielded.

    Each round of ``mlx_lm.generate.speculative_generate_step`` drafts
    ``min(n, max_tokens - tokens so far)`` tokens and ends with one target token; a last round cut
    by ``max_tokens`` may end on a draft token.
    """
    stats = SpeculativeStats(generated=len(from_draft))
    start = 0
    while start < len(from_draft):
        stop = start
        while stop < len(from_draft) and from_draft[stop]:
            stop += 1
        stats.rounds += 1
        stats.drafted += min(n, max_tokens - start)
        stats.accepted += stop - start
        start = stop + 1
    return stats


def mlx_lm(target: nn.Module, draft: nn.Module, n: int) -> Method:
    """mlx-lm's own speculative loop and sampler at ``n`` draft tokens a round, after
    ``mx.random.seed(seed)``; also while :func:`mlx_spec.patch_mlx_lm` routes mlx-lm's through
    mlx-spec's."""

    def generate(prompt: mx.array, temp: float, seed: int, max_tokens: int) -> SpeculativeStats:
        mx.random.seed(seed)
        # mlx-lm's loop and sampler factory as they were before any patch: looked up in mlx-lm
        # now, or imported from it after a patch, they would be mlx-spec's.
        steps = _LM_SPECULATIVE_STEP(
            prompt,
            target,
            draft,
            num_draft_tokens=n,
            max_tokens=max_tokens,
            sampler=_LM_MAKE_SAMPLER(temp=temp),
        )
        return mlx_lm_stats([bool(step[2]) for step in steps], n, max_tokens)

    return Method(f"mlx-lm N={n}", generate, "mlx-lm", n)


def mlx_spec(
    target: nn.Module,
    n: int,
    *,
    draft: nn.Module | None = None,
    drafter: str | Callable[[mx.array], Drafter] | None = None,
    adaptive: bool = False,
) -> Method:
    """mlx-spec's loop with :func:`mlx_spec.sampling.make_sampler` and ``key=mx.random.key(seed)``,
    ``num_draft_tokens=n``, and ``draft`` (a model: ``"draft"``) or ``drafter``
    (``"prompt-lookup"``: ``"lookup"``, or a function that builds a drafter for a prompt)."""
    kind = "draft" if draft is not None else "lookup"

    def generate(prompt: mx.array, temp: float, seed: int, max_tokens: int) -> SpeculativeStats:
        stats = SpeculativeStats()
        steps = speculative_generate_step(
            prompt,
            target,
            draft,
            num_draft_tokens=n,
            max_tokens=max_tokens,
            sampler=make_sampler(temp=temp),
            key=mx.random.key(seed),
            stats=stats,
            drafter=drafter(prompt) if callable(drafter) else drafter,
            adaptive=adaptive,
        )
        for _ in steps:
            pass
        return stats

    return Method(f"{kind} {'adaptive' if adaptive else f'N={n}'}", generate, kind, n, adaptive)


def methods(
    target: nn.Module, draft: nn.Module | None, drafts: Sequence[int], most: int = 8
) -> list[Method]:
    """Plain decoding; with a draft model, mlx-lm's loop and mlx-spec's at each fixed ``N`` in
    ``drafts`` and adaptive up to ``most``; mlx-spec's prompt lookup likewise."""
    out = [plain(target)]
    if draft is not None:
        out += [mlx_lm(target, draft, n) for n in drafts]
        out += [mlx_spec(target, n, draft=draft) for n in drafts]
        out.append(mlx_spec(target, most, draft=draft, adaptive=True))
    out += [mlx_spec(target, n, drafter="prompt-lookup") for n in drafts]
    out.append(mlx_spec(target, most, drafter="prompt-lookup", adaptive=True))
    return out


def warm_up(methods: Sequence[Method], prompt: mx.array, temps: Sequence[float]) -> None:
    """Compiles kernels and fills MLX's buffer cache: 8 tokens of each method at each
    temperature, on a prompt kept apart from the measured ones."""
    for method in methods:
        for temp in temps:
            run(method, prompt, temp, 0, 8)


def measure(
    methods: Sequence[Method],
    workloads: Mapping[str, Sequence[mx.array]],
    temps: Sequence[float],
    max_tokens: int,
    on_row: Callable[[dict[str, Any]], None] = lambda _: None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Every method on every prompt of every workload at every temperature, interleaved.

    Prompt by prompt (prompt ``i`` with seed ``i``), each method runs twice in a row (the
    :data:`PHASES`); the order of the methods turns by one with each prompt, so that no method
    always meets a prompt first. ``progress`` is called with a label before each workload and
    temperature, ``on_row`` with each row as soon as it is measured.

    Returns:
        list of dict: per workload, temperature, method and phase, totals over the prompts: the
        method's fields, the counts of :class:`SpeculativeStats`, ``seconds``,
        ``tokens_per_second``, ``tokens_per_round`` and ``acceptance_rate``.
    """
    rows = []
    for workload, prompts in workloads.items():
        for temp in temps:
            progress(f"{workload}, temperature {temp}")
            totals = {(m, phase): Timed() for m in methods for phase in PHASES}
            for i, prompt in enumerate(prompts):
                turn = i % len(methods)
                for method in [*methods[turn:], *methods[:turn]]:
                    for phase in PHASES:
                        totals[method, phase] += run(method, prompt, temp, i, max_tokens)
            for (method, phase), timed in totals.items():
                labels = {k: v for k, v in asdict(method).items() if k != "generate"}
                rows.append(
                    {"workload": workload, "temp": temp, **labels, "phase": phase}
                    | asdict(timed.stats)
                    | {
                        "seconds": timed.seconds,
                        "tokens_per_second": timed.tokens_per_second,
                        "tokens_per_round": timed.stats.tokens_per_round,
                        "acceptance_rate": timed.stats.acceptance_rate,
                    }
                )
                on_row(rows[-1])
    return rows


def _fastest(peers: Sequence[dict[str, Any]], **match: Any) -> float | None:
    """The most tokens/s among the ``peers`` whose fields equal ``match`` (``None``: no peer)."""
    speeds = [p["tokens_per_second"] for p in peers if all(p[k] == v for k, v in match.items())]
    return max(speeds, default=None)


def _group(row: dict[str, Any]) -> tuple:
    """What rows compared with each other share: workload, temperature and target."""
    return row["workload"], row["temp"], row["model"]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per workload, temperature and method, from the rows of :func:`measure`.

    Returns:
        list of dict: the steady-state row, with ``first_tokens_per_second``,
        ``first_over_steady`` (the first run's seconds over the second's) and the ratios of its
        steady tokens/s: ``x_plain`` (to plain decoding of the same target), ``x_mlx_lm`` (a
        draft model at a fixed ``N``: to mlx-lm's loop at that ``N``) and ``x_best_fixed``
        (adaptive: to the fastest fixed ``N`` of the same drafter); ``None`` where there is no
        such method.
    """
    steady = [r for r in rows if r["phase"] == "steady"]
    first = {(*_group(r), r["name"]): r for r in rows if r["phase"] == "first"}
    lines = []
    for r in steady:
        f = first[(*_group(r), r["name"])]
        peers = [p for p in steady if _group(p) == _group(r)]
        fixed_draft = r["drafter"] == "draft" and not r["adaptive"]
        bases = {
            "x_plain": _fastest(peers, drafter="plain"),
            "x_mlx_lm": _fastest(peers, drafter="mlx-lm", n=r["n"]) if fixed_draft else None,
            "x_best_fixed": _fastest(peers, drafter=r["drafter"], adaptive=False)
            if r["adaptive"]
            else None,
        }
        lines.append(
            {
                **r,
                "first_tokens_per_second": f["tokens_per_second"],
                "first_over_steady": f["seconds"] / r["seconds"],
                **{k: r["tokens_per_second"] / v if v else None for k, v in bases.items()},
            }
        )
    return lines


def table(lines: Sequence[dict[str, Any]]) -> str:
    """Lines of :func:`summarize` as a Markdown table."""
    out = [
        "| workload | temp | method | tok/s | first-use time / steady | tok/round | acceptance "
        "| replayed | x plain | x mlx-lm | x best fixed N |",
        "|---" * 11 + "|",
    ]
    for s in lines:
        ratios = [s[k] for k in ("x_plain", "x_mlx_lm", "x_best_fixed")]
        out.append(
            f"| {s['workload']} | {s['temp']:.1f} | {s['name']} | {s['tokens_per_second']:.1f} | "
            f"{s['first_over_steady']:.2f}x | {s['tokens_per_round']:.2f} | "
            + (f"{s['acceptance_rate']:.1%}" if s["drafted"] else "-")
            + f" | {s['replayed']} | "
            + " | ".join("-" if x is None else f"{x:.2f}x" for x in ratios)
            + " |"
        )
    return "\n".join(out)


def load_demo_pair() -> tuple[nn.Module, nn.Module, Any]:
    """The shipped pair: ``(target, draft, tokenizer)``, loaded with ``mlx_lm.load``."""
    from mlx_lm import load

    target, tokenizer = load(str(DEMO_DIR / "target"))
    draft, _ = load(str(DEMO_DIR / "draft"))
    return target, draft, tokenizer


def demo_workloads(tokenizer: Any, prompts: int) -> dict[str, list[mx.array]]:
    """The demo pair's workloads, their first ``prompts`` prompts (at most 4): ``input-grounded``
    (text that the output repeats) and ``open`` (the demo's prompts)."""
    texts = {"input-grounded": GROUNDED, "open": PROMPTS}
    return {k: [mx.array(tokenizer.encode(t)) for t in v[:prompts]] for k, v in texts.items()}


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


def write_json(data: dict[str, Any], path: Path) -> None:
    """Writes ``data`` to ``path`` through a file beside it, so that ``path`` always holds a
    whole JSON document: the last one written."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)
