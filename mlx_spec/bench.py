"""Generation benchmark: plain decoding, mlx-lm's speculative decoding and mlx-spec, measured alike.

What ``mlx-spec bench`` and ``mlx-spec demo`` run, and ``benchmarks/generation.py`` builds on. A
:class:`Method` generates through a public API (:func:`plain`, :func:`mlx_lm`, :func:`mlx_spec`).
:func:`measure` runs methods interleaved prompt by prompt, so that load on the machine hits them
alike, each twice in a row: the first run is its first use of the prompt's shapes (on MLX's CUDA
backend each new shape of an attention call first builds a graph), the second the steady state;
repeated passes over the prompts give each method a spread of steady-state runs.
:func:`summarize` sets each against plain decoding, mlx-lm's loop and the best fixed draft length
of the same run; :func:`table` prints that, :func:`noise` and :func:`verdicts` say what it shows,
and :func:`plot` draws tokens/s against tokens per round (with matplotlib, if installed).

Needs mlx-lm (``pip install "mlx-spec[lm]"``).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from . import kernels
from ._demo import DEMO_DIR, GROUNDED, PROMPTS
from ._mlx_lm import lm
from .draft_length import Adaptive, Fixed
from .drafters import Drafter
from .generation import SpeculativeStats, speculative_generate_step
from .mtp import head_of
from .sampling import make_sampler

Generate = Callable[[mx.array, float, int, int], SpeculativeStats]
"""``(prompt, temp, seed, max_tokens) -> counts``: one whole generation."""

PHASES = ("first", "steady")
"""The two runs in a row of each method on each prompt (in the first pass over the prompts)."""

NOISE = 0.1
"""How far plain decoding's tokens/s may spread over the repeats of a measurement, as a share of
their median (``(max - min) / median``), for a verdict (:func:`noise`, :func:`verdicts`): past
it, load on the machine moves the timings as much as the gains the table would show on a CPU."""


@dataclass(frozen=True)
class Method:
    """A way to generate, and what it is compared with.

    Attributes:
        name (str): its label, unique within a run.
        generate (Generate): runs one generation and returns its counts.
        drafter (str): ``"plain"``, ``"mlx-lm"`` (mlx-lm's loop with a draft model), ``"draft"``
            (mlx-spec with a draft model), ``"lookup"`` (mlx-spec with prompt lookup), ``"mtp"``
            (mlx-spec with the target's MTP head), or the label of another drafter.
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
        total = {f.name: _add(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)}
        return Timed(SpeculativeStats(**total), self.seconds + other.seconds)


def _add(a: Any, b: Any) -> Any:
    """Two counts summed; two lists of counts per draft position summed position by position."""
    if isinstance(a, list):
        return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]
    return a + b


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
        sampler = lm.make_sampler(temp=temp)
        steps = generate_step(prompt, target, max_tokens=max_tokens, sampler=sampler)
        tokens = sum(1 for _ in steps)
        return SpeculativeStats(rounds=tokens, generated=tokens)

    return Method("plain", generate)


def mlx_lm_stats(from_draft: Sequence[bool], n: int, max_tokens: int) -> SpeculativeStats:
    """The counts of mlx-lm's loop, per draft position too, from the ``from_draft`` flag of each
    token it yielded.

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
        stats.count(min(n, max_tokens - start), stop - start)
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
        steps = lm.speculative_generate_step(
            prompt,
            target,
            draft,
            num_draft_tokens=n,
            max_tokens=max_tokens,
            sampler=lm.make_sampler(temp=temp),
        )
        return mlx_lm_stats([bool(step[2]) for step in steps], n, max_tokens)

    return Method(f"mlx-lm N={n}", generate, "mlx-lm", n)


#: What a method's drafter label gains with the fused kernels turned off (``"lookup, no kernels"``).
NO_KERNELS = ", no kernels"


def mlx_spec(
    target: nn.Module,
    n: int,
    *,
    draft: nn.Module | None = None,
    drafter: str | Callable[[mx.array], Drafter] | None = None,
    adaptive: bool = False,
    acceptance: str = "coupled",
    fused: bool = True,
) -> Method:
    """mlx-spec's loop with :func:`mlx_spec.sampling.make_sampler` and ``key=mx.random.key(seed)``,
    ``num_draft_tokens=n`` (with ``adaptive``, one :class:`~mlx_spec.draft_length.Adaptive` for
    all its generations), and ``draft`` (a model: ``"draft"``) or ``drafter``
    (``"prompt-lookup"``: ``"lookup"``; ``"mtp"``, the target's MTP head: ``"mtp"``; or a
    function that builds a drafter for a prompt).
    ``acceptance`` other than coupled, or ``fused=False`` (the fused CUDA kernels turned off),
    label the drafter too (``"draft residual"``, ``"lookup, no kernels"``), so that a table
    compares each with its own kind."""
    kind = "draft" if draft is not None else "mtp" if drafter == "mtp" else "lookup"
    kind += f" {acceptance}" if acceptance != "coupled" else ""
    kind += NO_KERNELS if not fused else ""
    # One policy for all of the method's generations, as a caller keeps it: it measures what
    # rounds cost once.
    policy = Adaptive(n) if adaptive else Fixed(n)

    def generate(prompt: mx.array, temp: float, seed: int, max_tokens: int) -> SpeculativeStats:
        stats = SpeculativeStats()
        with kernels.disabled() if not fused else nullcontext():
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
                policy=policy,
                acceptance=acceptance,
            )
            for _ in steps:
                pass
        return stats

    return Method(f"{kind} {'adaptive' if adaptive else f'N={n}'}", generate, kind, n, adaptive)


def methods(
    target: nn.Module,
    draft: nn.Module | None,
    drafts: Sequence[int],
    most: int = 8,
    mtp_drafts: Sequence[int] | None = None,
) -> list[Method]:
    """Plain decoding; with a draft model, mlx-lm's loop and mlx-spec's at each fixed ``N`` in
    ``drafts`` and adaptive up to ``most``; mlx-spec's prompt lookup likewise; and, where the
    target has an MTP head (:func:`mlx_spec.load`), mlx-spec drafting with it at each fixed ``N``
    in ``mtp_drafts`` (default: ``drafts``) and adaptive up to ``most``."""
    out = [plain(target)]
    if draft is not None:
        out += [mlx_lm(target, draft, n) for n in drafts]
        out += [mlx_spec(target, n, draft=draft) for n in drafts]
        out.append(mlx_spec(target, most, draft=draft, adaptive=True))
    out += [mlx_spec(target, n, drafter="prompt-lookup") for n in drafts]
    out.append(mlx_spec(target, most, drafter="prompt-lookup", adaptive=True))
    if head_of(target) is not None:
        out += [mlx_spec(target, n, drafter="mtp") for n in mtp_drafts or drafts]
        out.append(mlx_spec(target, most, drafter="mtp", adaptive=True))
    return out


def variants(target: nn.Module, draft: nn.Module | None, n: int) -> list[Method]:
    """At ``N = n``: the draft model by rejection sampling (and adaptive up to ``n`` by it), and
    each drafter (the residual one too, and the target's MTP head where it has one) with the
    fused CUDA kernels turned off, to set beside :func:`methods`' own."""
    out = []
    if draft is not None:
        out.append(mlx_spec(target, n, draft=draft, acceptance="residual"))
        out.append(mlx_spec(target, n, draft=draft, acceptance="residual", adaptive=True))
        out.append(mlx_spec(target, n, draft=draft, acceptance="residual", fused=False))
        out.append(mlx_spec(target, n, draft=draft, fused=False))
    out.append(mlx_spec(target, n, drafter="prompt-lookup", fused=False))
    if head_of(target) is not None:
        out.append(mlx_spec(target, n, drafter="mtp", fused=False))
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
    *,
    repeats: int = 1,
    on_run: Callable[[int, int, str], None] = lambda *_: None,
) -> list[dict[str, Any]]:
    """Every method on every prompt of every workload at every temperature, interleaved.

    Prompt by prompt (prompt ``i`` with seed ``i``), each method runs twice in a row (the
    :data:`PHASES`); the order of the methods turns by one with each prompt, so that no method
    always meets a prompt first. With ``repeats`` above 1, more passes over the prompts follow,
    each method running once a prompt (the steady state: the shapes are no longer new), the
    order still turning, so that each method's steady state has a tokens/s per pass.
    ``progress`` is called with a label before each workload and temperature, ``on_run`` with
    ``(done, total, label)`` before each method meets a prompt, ``on_row`` with each row as soon
    as it is measured.

    Returns:
        list of dict: per workload, temperature, method and phase, totals over the prompts and
        passes: the method's fields, the counts of :class:`SpeculativeStats`, ``seconds``,
        ``tokens_per_second``, ``tokens_per_round``, ``acceptance_rate``, ``repeats`` (the passes
        totalled: 1 for the first runs) and ``tokens_per_second_by_repeat`` (one per pass).
    """
    rows = []
    total = repeats * len(temps) * len(methods) * sum(len(p) for p in workloads.values())
    done = 0
    for workload, prompts in workloads.items():
        for temp in temps:
            progress(f"{workload}, temperature {temp}")
            passes = {(m, p): [Timed() for _ in range(repeats)] for m in methods for p in PHASES}
            for r in range(repeats):
                phases = PHASES if r == 0 else PHASES[1:]
                for i, prompt in enumerate(prompts):
                    turn = (r * len(prompts) + i) % len(methods)
                    for method in [*methods[turn:], *methods[:turn]]:
                        done += 1
                        label = f"{method.name}, {workload}, t={temp}, repeat {r + 1}/{repeats}"
                        on_run(done, total, label)
                        for phase in phases:
                            passes[method, phase][r] += run(method, prompt, temp, i, max_tokens)
            for (method, phase), timed_passes in passes.items():
                kept = timed_passes if phase == "steady" else timed_passes[:1]
                timed = sum(kept, Timed())
                labels = {k: v for k, v in asdict(method).items() if k != "generate"}
                rows.append(
                    {"workload": workload, "temp": temp, **labels, "phase": phase}
                    | asdict(timed.stats)
                    | {
                        "seconds": timed.seconds,
                        "tokens_per_second": timed.tokens_per_second,
                        "tokens_per_round": timed.stats.tokens_per_round,
                        "acceptance_rate": timed.stats.acceptance_rate,
                        "repeats": len(kept),
                        "tokens_per_second_by_repeat": [t.tokens_per_second for t in kept],
                    }
                )
                on_row(rows[-1])
    return rows


def _by_repeat(row: dict[str, Any]) -> list[float]:
    """A row's tokens/s in each pass over the prompts (its total's alone in results measured
    before passes were kept)."""
    return row.get("tokens_per_second_by_repeat") or [row["tokens_per_second"]]


def _speed(row: dict[str, Any]) -> float:
    """The median of a row's tokens/s over its passes."""
    return statistics.median(_by_repeat(row))


def _fastest(peers: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The peer of the most median tokens/s among those whose fields equal ``match`` (``None``:
    no peer)."""
    return max(
        (p for p in peers if all(p[k] == v for k, v in match.items())), key=_speed, default=None
    )


def _group(row: dict[str, Any]) -> tuple:
    """What rows compared with each other share: workload, temperature and target."""
    return row["workload"], row["temp"], row["model"]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per workload, temperature and method, from the rows of :func:`measure`.

    Returns:
        list of dict: the steady-state row, with ``tokens_per_second_median``, ``_min`` and
        ``_max`` (over its passes), ``first_tokens_per_second``, ``first_over_steady`` (the first
        run's seconds over a steady pass's mean) and the ratios of its median tokens/s:
        ``x_plain`` (to plain decoding of the same target: the median of the ratios pass by
        pass, as the passes interleaved them, with their ``x_plain_min`` and ``x_plain_max``),
        ``x_mlx_lm`` (a draft model at a fixed ``N``: to mlx-lm's loop at that ``N``) and
        ``x_best_fixed`` (adaptive: to the fastest fixed ``N`` of the same drafter); ``None``
        where there is no such method. Rows of a single pass give the ratios of their totals.
    """
    steady = [r for r in rows if r["phase"] == "steady"]
    first = {(*_group(r), r["name"]): r for r in rows if r["phase"] == "first"}
    lines = []
    for r in steady:
        f = first[(*_group(r), r["name"])]
        peers = [p for p in steady if _group(p) == _group(r)]
        speeds = _by_repeat(r)
        fixed_draft = r["drafter"] == "draft" and not r["adaptive"]
        plain = _fastest(peers, drafter="plain")
        bases = {
            "x_mlx_lm": _fastest(peers, drafter="mlx-lm", n=r["n"]) if fixed_draft else None,
            "x_best_fixed": _fastest(peers, drafter=r["drafter"], adaptive=False)
            if r["adaptive"]
            else None,
        }
        x_plain = [a / b for a, b in zip(speeds, _by_repeat(plain), strict=True)] if plain else None
        lines.append(
            {
                **r,
                "tokens_per_second_median": statistics.median(speeds),
                "tokens_per_second_min": min(speeds),
                "tokens_per_second_max": max(speeds),
                "first_tokens_per_second": f["tokens_per_second"],
                "first_over_steady": f["seconds"] / (r["seconds"] / r.get("repeats", 1)),
                "x_plain": statistics.median(x_plain) if x_plain else None,
                "x_plain_min": min(x_plain) if x_plain else None,
                "x_plain_max": max(x_plain) if x_plain else None,
                **{k: _speed(r) / _speed(v) if v else None for k, v in bases.items()},
            }
        )
    return lines


def _spread(line: dict[str, Any], key: str, form: str, unit: str = "") -> str:
    """``line[key]`` (a median over passes) in ``form``; where the line has several passes, then
    the range over them (``line[f"{base}_min"]`` to ``_max``, ``base`` being ``key`` less any
    ``_median``): ``1.42x (1.31x-1.50x)``."""
    text = f"{line[key]:{form}}{unit}"
    if line.get("repeats", 1) == 1:
        return text
    base = key.removesuffix("_median")
    low, high = line[f"{base}_min"], line[f"{base}_max"]
    return f"{text} ({low:{form}}{unit}-{high:{form}}{unit})"


KEPT_AT_SHOWN = 4
"""The draft positions whose acceptance :func:`table` shows (``kept at 1/2/3/4``)."""


def kept_at(line: Mapping[str, Any]) -> str:
    """How often each of the first :data:`KEPT_AT_SHOWN` draft positions of a row of
    :func:`measure` was kept, of the rounds that drafted there
    (:attr:`SpeculativeStats.acceptance_at`), in percent: ``81/64/40/22%``; ``-`` when nothing
    was drafted (or the row predates the counts per position)."""
    counts = SpeculativeStats(
        drafted_at=line.get("drafted_at", []), accepted_at=line.get("accepted_at", [])
    )
    rates = counts.acceptance_at[:KEPT_AT_SHOWN]
    return "/".join(f"{100 * r:.0f}" for r in rates) + "%" if rates else "-"


def table(lines: Sequence[dict[str, Any]]) -> str:
    """Lines of :func:`summarize` as a Markdown table; where they have several passes, tok/s and
    x plain are the median over them and, in brackets, the range (min-max). ``kept at 1/2/3/4``
    is :func:`kept_at`."""
    positions = "/".join(str(i) for i in range(1, KEPT_AT_SHOWN + 1))
    out = [
        "| workload | temp | method | tok/s | first-use time / steady | tok/round | acceptance "
        f"| kept at {positions} | replayed | x plain | x mlx-lm | x best fixed N |",
        "|---" * 12 + "|",
    ]
    for s in lines:
        ratios = [s[k] for k in ("x_mlx_lm", "x_best_fixed")]
        x_plain = "-" if s["x_plain"] is None else _spread(s, "x_plain", ".2f", "x")
        out.append(
            f"| {s['workload']} | {s['temp']:.1f} | {s['name']} | "
            f"{_spread(s, 'tokens_per_second_median', '.1f')} | "
            f"{s['first_over_steady']:.2f}x | {s['tokens_per_round']:.2f} | "
            + (f"{s['acceptance_rate']:.1%}" if s["drafted"] else "-")
            + f" | {kept_at(s)} | {s['replayed']} | {x_plain} | "
            + " | ".join("-" if x is None else f"{x:.2f}x" for x in ratios)
            + " |"
        )
    return "\n".join(out)


DRAFTERS = {
    "plain": "plain decoding",
    "mlx-lm": "mlx-lm",
    "draft": "draft model",
    "lookup": "prompt lookup",
    "mtp": "MTP head",
}
"""How :func:`verdicts` and :func:`plot` name each ``Method.drafter``."""


def _cases(lines: Sequence[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """The lines grouped by workload, temperature and target, in their order."""
    cases: dict[tuple, list[dict[str, Any]]] = {}
    for line in lines:
        cases.setdefault(_group(line), []).append(line)
    return cases


def _plain(case: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The case's plain decoding, when it was measured over several passes."""
    plain = _fastest(case, drafter="plain")
    return plain if plain is not None and plain.get("repeats", 1) > 1 else None


def _plain_spread(plain: dict[str, Any]) -> float:
    """Plain decoding's ``(max - min) / median`` tokens/s over its passes."""
    return (plain["tokens_per_second_max"] - plain["tokens_per_second_min"]) / plain[
        "tokens_per_second_median"
    ]


def noise(lines: Sequence[dict[str, Any]]) -> str | None:
    """One line on whether the machine held still enough for :func:`verdicts`.

    The rule: a case (a workload and temperature of one target) is too noisy for a verdict when
    plain decoding's steady tokens/s spread over the passes by more than :data:`NOISE` of their
    median, ``(max - min) / median > NOISE``. Methods ran interleaved, so the load that moved
    plain decoding moved them too.

    Args:
        lines (list of dict): lines of :func:`summarize`.

    Returns:
        str or None: the line; ``None`` where plain decoding did not run several passes.
    """
    spreads = [_plain_spread(p) for case in _cases(lines).values() if (p := _plain(case))]
    if not spreads:
        return None
    repeats = max(line.get("repeats", 1) for line in lines)
    worst, noisy = max(spreads), sum(x > NOISE for x in spreads)
    if noisy:
        return (
            f"Too noisy for a verdict in {noisy} of {len(spreads)} cases: plain decoding's "
            f"tokens/s spread by up to {worst:.0%} of its median over {repeats} repeats (a "
            f"verdict needs at most {NOISE:.0%}); close other programs, or run again."
        )
    return (
        f"Quiet enough for a verdict: plain decoding's tokens/s spread by at most {worst:.0%} "
        f"of its median over {repeats} repeats (a verdict needs at most {NOISE:.0%})."
    )


def _judge(line: dict[str, Any], plain: dict[str, Any]) -> tuple[str, str]:
    """What a line's ratios to plain decoding say, by the rules of :func:`verdicts`: the
    answer's kind and its words."""
    x, low, high = line["x_plain"], line["x_plain_min"], line["x_plain_max"]
    spread = f"({low:.2f}x-{high:.2f}x)"
    if _plain_spread(plain) > NOISE or (low <= 1 <= high and high - low > 2 * NOISE * x):
        kind, said = "too noisy to tell", "too noisy to tell"
    elif low > 1:
        kind, said = "faster", f"{x:.2f}x {spread}"
    elif high < 1:
        kind, said = "slower", f"slower at {x:.2f}x {spread}"
    else:
        kind, said = "no faster", f"no faster {spread}"
    return kind, said if line["drafted"] else f"{said}, drafted nothing"


def verdicts(lines: Sequence[dict[str, Any]]) -> list[str]:
    """One line per drafter: how it ran against plain decoding, case by case.

    A drafter's adaptive method speaks for it, or each of its methods where none adapts;
    mlx-lm's loop is left to the table. In each case (workload, temperature, target), from the
    ratios of its tokens/s to plain decoding's, pass by pass:

    - ``too noisy to tell``: the case is too noisy (:func:`noise`), or the ratios straddle 1
      over a range wider than ``2 * NOISE`` of their median;
    - ``1.42x (1.31x-1.50x)``: every pass ran faster than plain decoding (the median ratio, then
      the range);
    - ``slower at 0.85x (0.80x-0.90x)``: every pass ran slower;
    - ``no faster (0.97x-1.03x)``: the ratios straddle 1 within the noise.

    ``, drafted nothing`` follows where the method proposed no token (its rounds were plain
    steps, so whatever it gained is the loop's). A drafter for which every case says ``no
    faster`` or every case ``too noisy to tell`` gets it once.

    Args:
        lines (list of dict): lines of :func:`summarize`.

    Returns:
        list of str: ``prompt lookup, adaptive: input-grounded t=0.0 1.62x (1.55x-1.70x), t=0.8
        1.21x (1.10x-1.30x); open t=0.0 no faster (0.98x-1.01x), ...``; empty where plain
        decoding did not run several passes.
    """
    cases = {key: plain for key, case in _cases(lines).items() if (plain := _plain(case))}
    speaking = {}
    for line in lines:
        if line["drafter"] in ("plain", "mlx-lm") or _group(line) not in cases:
            continue
        adapts = any(m["adaptive"] and m["drafter"] == line["drafter"] for m in lines)
        if line["adaptive"] or not adapts:
            speaking.setdefault(line["name"], []).append(line)
    models = len({line["model"] for line in lines}) > 1
    out = []
    for measured in speaking.values():
        first = measured[0]
        kinds, said = set(), {}
        for line in measured:
            kind, words = _judge(line, cases[_group(line)])
            kinds.add(kind)
            where = f"{line['model']} {line['workload']}" if models else line["workload"]
            said.setdefault(where, []).append(f"t={line['temp']:.1f} {words}")
        length = "adaptive" if first["adaptive"] else f"N={first['n']}"
        label = f"{DRAFTERS.get(first['drafter'], first['drafter'])}, {length}"
        if kinds == {"too noisy to tell"}:
            out.append(f"{label}: too noisy to tell")
        elif kinds == {"no faster"}:
            out.append(f"{label}: no faster than plain decoding here")
        else:
            out.append(f"{label}: " + "; ".join(f"{w} {', '.join(p)}" for w, p in said.items()))
    return out


def report(lines: Sequence[dict[str, Any]]) -> str:
    """What a measurement of several passes says: the :func:`noise` line, then the
    :func:`verdicts`, one a line; empty where plain decoding ran a single pass."""
    said = noise(lines)
    if said is None:
        return ""
    head = "Against plain decoding (x plain: the median, and the range over the repeats):"
    return "\n".join([said, head, *(f"- {verdict}" for verdict in verdicts(lines))])


COLORS = {
    "plain": "0.35",
    "mlx-lm": "tab:orange",
    "draft": "tab:blue",
    "lookup": "tab:green",
    "mtp": "tab:red",
}


def plot(lines: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Draws tokens/s against tokens per round, one panel per case, into a PNG.

    Each method is a point at its tokens per round (x) and median tokens/s (y), with a bar over
    the range of its passes, coloured by drafter and labelled with its draft length; plain
    decoding's median is a dashed line across the panel, and its range a band. A row of panels
    per workload (and target), a column per temperature. Drawn with matplotlib's Agg canvas: no
    window, no global backend.

    Args:
        lines (list of dict): lines of :func:`summarize`.
        path (Path): the PNG to write.
        title (str): the figure's title.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    cases = _cases(lines)
    temps = sorted({temp for _, temp, _ in cases})
    rows = list(dict.fromkeys((model, workload) for workload, _, model in cases))
    figure = Figure(figsize=(5.2 * len(temps), 3.8 * len(rows) + 0.9), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(rows), len(temps), squeeze=False)
    for (workload, temp, model), case in cases.items():
        ax = axes[rows.index((model, workload)), temps.index(temp)]
        for line in case:
            y = line["tokens_per_second_median"]
            low, high = line["tokens_per_second_min"], line["tokens_per_second_max"]
            color = COLORS.get(line["drafter"], "tab:purple")
            if line["drafter"] == "plain":
                ax.axhline(y, color=color, linestyle="--", linewidth=1)
                ax.axhspan(low, high, color=color, alpha=0.12, linewidth=0)
            marker = "*" if line["adaptive"] else "s" if line["drafter"] == "plain" else "o"
            ax.errorbar(
                line["tokens_per_round"],
                y,
                yerr=[[y - low], [high - y]],
                color=color,
                marker=marker,
                markersize=11 if line["adaptive"] else 6,
                capsize=3,
            )
            length = "" if line["drafter"] == "plain" else line["name"].rsplit(" ", 1)[-1]
            # mlx-lm's loop and the draft model at the same N keep the same drafts at
            # temperature 0: their labels go below and above the point.
            below = line["drafter"] == "mlx-lm"
            at, offset = (line["tokens_per_round"], y), (6, -10 if below else 4)
            ax.annotate(length, at, xytext=offset, textcoords="offset points", fontsize=7)
        ax.set_title(f"{model + ' ' if model else ''}{workload}, temperature {temp}", fontsize=10)
        ax.set_xlabel("tokens per round (per target call)")
        ax.set_ylabel("tokens/s (median, bar: range)")
        ax.grid(alpha=0.3)
        ax.margins(x=0.1)  # room for the labels right of the last points
        ax.set_xlim(left=min(0.9, ax.get_xlim()[0]))
    kinds = dict.fromkeys(line["drafter"] for line in lines)
    handles = [
        Line2D(
            [],
            [],
            color=COLORS.get(k, "tab:purple"),
            marker="s" if k == "plain" else "o",
            linestyle="--" if k == "plain" else "",
            label=DRAFTERS.get(k, k),
        )
        for k in kinds
    ]
    star = {"marker": "*", "markersize": 11, "linestyle": ""}
    handles.append(Line2D([], [], color="0.5", label="adaptive draft length", **star))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.savefig(path, dpi=110)


def load_demo_pair() -> tuple[nn.Module, nn.Module, Any]:
    """The shipped pair: ``(target, draft, tokenizer)``, loaded with ``mlx_lm.load``; the target
    with :func:`mlx_spec.load`, which attaches its MTP head."""
    from mlx_lm import load

    from .mtp_convert import load as load_with_head

    target, tokenizer = load_with_head(str(DEMO_DIR / "target"))
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


def recorder(
    path: Path | None, **results: Any
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """A benchmark's results and the function that keeps each of its rows.

    Args:
        path (Path, optional): where the results are rewritten after each row (``--json``).
        **results: what the results hold besides their ``rows`` (the machine, the settings).

    Returns:
        tuple: the results (``results`` and ``"rows"``, a list), and ``keep(row)``, which
        appends ``row`` to them and writes them to ``path`` where given.
    """
    recorded: dict[str, Any] = {**results, "rows": []}

    def keep(row: dict[str, Any]) -> None:
        recorded["rows"].append(row)
        if path is not None:
            write_json(recorded, path)

    return recorded, keep


def write_json(data: dict[str, Any], path: Path) -> None:
    """Writes ``data`` to ``path`` through a file beside it, so that ``path`` always holds a
    whole JSON document: the last one written."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)
