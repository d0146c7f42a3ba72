"""Where a speculative round's time goes: host work against waiting for the device.

Runs mlx-spec's loop and mlx-lm's own speculative loop at temperature 0 on the same pair, prompt
and ``N``, after a warm-up, and splits each loop's time per round into:

- the blocking reads (``tolist``, ``item``, ``mx.eval``, timed by wrapping them): the device
  finishing what the host built, plus the read itself;
- host work: everything else (building the round's graphs in Python, the drafter, the caches).

Work the device does while the host builds the next graph hides in the host's share; a loop
whose host share is larger than its peer's at the same tokens per round has more to save there.

Usage: ``python benchmarks/round_profile.py [--pair demo|random|16x2048|...] [--drafts 2 4]
[--tokens 128]`` (pairs as in ``benchmarks/generation.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import build_pair

from mlx_spec._mlx_lm import lm
from mlx_spec.generation import speculative_generate_step


class Reads:
    """Adds up the time spent in the calls that wait for the device, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals: list[tuple[object, str, Callable]] = []

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        self._originals.append((owner, name, original))
        setattr(owner, name, timed)

    def __enter__(self) -> Reads:
        for name in ("tolist", "item"):
            self._wrap(mx.array, name)
        self._wrap(mx, "eval")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="demo")
    parser.add_argument("--drafts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--adaptive", action="store_true", help="mlx-spec also with adaptive lengths up to N"
    )
    args = parser.parse_args()
    pair = build_pair(args.pair, 1)
    target, draft, prompt = pair.target, pair.draft, pair.workloads["open"][0]
    print(
        f"# round profile: {args.pair} pair, {mx.default_device()}, MLX {mx.__version__}, "
        f"{args.tokens} tokens, temperature 0; milliseconds a round"
    )
    print("| N | loop | rounds | total | waiting on reads | host |")
    print("|---|---|---|---|---|---|")
    for n in args.drafts:
        loops = {
            "mlx-spec": speculative_generate_step,
            "mlx-lm": lm.speculative_generate_step,
        }
        for name, loop in loops.items():

            def run(loop=loop, n=n) -> list:
                return list(loop(prompt, target, draft, num_draft_tokens=n, max_tokens=args.tokens))

            run()  # warm-up: compilation and first-use graphs
            with Reads() as reads:
                start = time.perf_counter()
                steps = run()
                total = time.perf_counter() - start
            # One target token a round (from_draft False), in either loop.
            rounds = max(sum(1 for _, _, from_draft in steps if not from_draft), 1)
            print(
                f"| {n} | {name} | {rounds} | {1e3 * total / rounds:.2f} | "
                f"{1e3 * reads.seconds / rounds:.2f} | "
                f"{1e3 * (total - reads.seconds) / rounds:.2f} |"
            )


if __name__ == "__main__":
    main()
