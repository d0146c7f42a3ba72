"""Do the fused CUDA acceptance kernels pay in generation? Each drafter with them and without.

For every drafter of the pair (its draft model, prompt lookup and, where the target has one, its MTP
head), at each fixed ``N`` of ``--drafts`` and adaptive up to 8, mlx-spec's generation runs with the
fused kernels (:mod:`mlx_spec.kernels`, the loop's default on CUDA) and with them turned off
(:func:`mlx_spec.kernels.disabled`: the composition of MLX ops decides), everything else equal. At
temperature 0 the greedy kernels decide every round; above it, the sampled kernel runs only with
``--acceptance residual`` (the default coupled rule compares the target's own draws with the draft,
with no kernel, so its rows there show what two identical methods differ by). All methods run
interleaved on every prompt (:func:`mlx_spec.bench.measure`), ``--passes`` times: the table gives
each one's median tokens/s over the passes with its range, and the median of the pass-by-pass ratios
(with kernels over without) with theirs. The verdict is ``gain`` where every pass's ratio is above
1, ``loss`` where every one is below, and ``noise`` otherwise.

On a machine without CUDA both run the composition: the ratios show the benchmark's own noise.

Usage: ``python benchmarks/fused_generation.py [--pair demo|16x2048|...] [--workload ...]
[--temps 0 0.8] [--drafts 4] [--prompts P] [--tokens T] [--passes R]
[--acceptance coupled|residual] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import ADAPTIVE_MOST, PAIRS, WORKLOADS, build_pair, describe

from mlx_spec import bench
from mlx_spec.mtp import head_of


def methods(
    target: Any, draft: Any, drafts: list[int], acceptance: str = "coupled"
) -> list[bench.Method]:
    """Each drafter at each of ``drafts`` and adaptive, with the kernels and without, deciding
    sampled rounds by ``acceptance``."""
    kinds: list[dict[str, Any]] = [{"draft": draft}, {"drafter": "prompt-lookup"}]
    if head_of(target) is not None:
        kinds.append({"drafter": "mtp"})
    out = []
    for kind in kinds:
        for n, adaptive in [*((n, False) for n in drafts), (ADAPTIVE_MOST, True)]:
            for fused in (True, False):
                out.append(
                    bench.mlx_spec(
                        target, n, adaptive=adaptive, fused=fused, acceptance=acceptance, **kind
                    )
                )
    return out


def compare(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each method with the kernels beside its twin without: tokens/s of both (median, range
    over passes) and the pass-by-pass ratios."""
    by_name = {(s["workload"], s["temp"], s["name"]): s for s in lines}
    out = []
    for (workload, temp, name), on in by_name.items():
        if bench.NO_KERNELS in name:
            continue
        kind, _, setting = name.rpartition(" ")
        off = by_name[(workload, temp, f"{kind}{bench.NO_KERNELS} {setting}")]
        ratios = [
            a / b
            for a, b in zip(
                on["tokens_per_second_by_repeat"], off["tokens_per_second_by_repeat"], strict=True
            )
        ]
        verdict = "gain" if min(ratios) > 1 else "loss" if max(ratios) < 1 else "noise"
        out.append(
            {
                "workload": workload,
                "temp": temp,
                "method": name,
                "tokens_per_round": on["tokens_per_round"],
                "with": on["tokens_per_second_by_repeat"],
                "without": off["tokens_per_second_by_repeat"],
                "ratios": ratios,
                "verdict": verdict,
            }
        )
    return out


def _range(values: list[float], form: str) -> str:
    return f"{statistics.median(values):{form}} ({min(values):{form}}-{max(values):{form}})"


def table(rows: list[dict[str, Any]]) -> str:
    """Rows of :func:`compare` as a Markdown table."""
    out = [
        "| workload | temp | method | tok/round | tok/s with kernels | tok/s without "
        "| with / without | verdict |",
        "|---" * 8 + "|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['temp']} | {r['method']} | {r['tokens_per_round']:.2f} | "
            f"{_range(r['with'], '.1f')} | {_range(r['without'], '.1f')} | "
            f"{_range(r['ratios'], '.2f')} | {r['verdict']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", choices=PAIRS, default="demo")
    parser.add_argument("--workload", choices=WORKLOADS, nargs="+", default=list(WORKLOADS))
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[4], help="fixed N (default 4)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload (default 2)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per generation")
    parser.add_argument("--passes", type=int, default=5, help="passes over the prompts")
    parser.add_argument(
        "--acceptance",
        choices=("coupled", "residual"),
        default="coupled",
        help="the rule of sampled rounds (default coupled, which runs no kernel: its rows at a "
        "temperature above 0 measure the benchmark's noise; residual runs the sampled kernel)",
    )
    parser.add_argument("--json", type=Path, help="the machine, settings and rows")
    args = parser.parse_args(argv)
    pair = build_pair(args.pair, args.prompts)
    chosen = methods(pair.target, pair.draft, args.drafts, args.acceptance)
    results: dict[str, Any] = {
        "machine": bench.machine(),
        "settings": vars(args) | {"json": None},
        "pair": describe(pair),
    }
    m = results["machine"]
    print(
        f"# fused kernels in generation: {m['date']}, {m['system']}, MLX {m['mlx']} "
        f"({m['device']}); {results['pair']}; {args.prompts} prompt(s) per workload x "
        f"{args.tokens} tokens, {args.passes} passes\n",
        flush=True,
    )
    bench.warm_up(chosen, pair.warm, args.temps)
    workloads = {k: pair.workloads[k] for k in args.workload}
    rows = bench.measure(
        chosen,
        workloads,
        args.temps,
        args.tokens,
        progress=lambda label: print(f"[{label}] ...", file=sys.stderr, flush=True),
        repeats=args.passes,
    )
    results["rows"] = compare(bench.summarize(rows))
    if args.json:
        bench.write_json(results, args.json)
    print(table(results["rows"]), flush=True)
    return results


if __name__ == "__main__":
    main()
