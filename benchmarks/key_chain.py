"""What a generation's key chain costs a text position, on the host and on the device.

Every sampled decision at text position ``t`` takes its randomness from ``S_t``, the state of
``mx.random``'s key sequence after ``t`` draws (:mod:`mlx_spec.keys`). Each state is a split of
the one before, so the chain is sequential. This times, per position, making the position's
``[1, 2]`` key and starting its evaluation (as a plain step takes it), three ways:

- ``host``: :class:`mlx_spec.keys.KeyChain`, Threefry-2x32 in Python, 32 positions a device array;
- ``device``: the chain on the device, as mlx-spec computed it before: a compiled graph of 16
  splits at a time, concatenated, sliced per position;
- ``split``: one ``mx.random.split`` a position on the device, as mlx-lm's key sequence advances
  for each token it samples (for scale: it keeps no chain).

The three give the same keys (checked). Prints the median microseconds a position of
``--repeats`` runs of ``--positions`` positions each, interleaved, and ``device / host``; and
``hash``, the host chain's own work: its split of each state, in Python, without the device.

Usage: ``python benchmarks/key_chain.py [--positions 512] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import cache

import mlx.core as mx

from mlx_spec.keys import KeyChain, _split

CHUNK = 16


@cache
def _chunk() -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """``state -> (keys, following)``: the draw keys of ``CHUNK`` positions from ``state`` and the
    state after them, compiled once."""

    def chain(state: mx.array) -> tuple[mx.array, mx.array]:
        keys = []
        for _ in range(CHUNK):
            state, key = mx.random.split(state)
            keys.append(key)
        return mx.stack(keys), state

    return mx.compile(chain)


def host(start: mx.array) -> Callable[[int], mx.array]:
    chain = KeyChain(start)
    return lambda position: chain.keys(position, 1)


def device(start: mx.array) -> Callable[[int], mx.array]:
    made = {"keys": mx.zeros((0, 2), dtype=mx.uint32), "next": start}

    def key(position: int) -> mx.array:
        while made["keys"].shape[0] <= position:
            keys, made["next"] = _chunk()(made["next"])
            made["keys"] = mx.concatenate([made["keys"], keys])
            mx.async_eval(made["keys"], made["next"])
        return made["keys"][position : position + 1]

    return key


def split(start: mx.array) -> Callable[[int], mx.array]:
    made = {"state": start}

    def key(position: int) -> mx.array:
        made["state"], drawn = mx.random.split(made["state"])
        return drawn[None]

    return key


METHODS = {"host": host, "device": device, "split": split}


def run(method: str, positions: int) -> tuple[float, list[list[int]]]:
    """Microseconds a position, and the keys made."""
    key = METHODS[method](mx.random.key(3))
    made = []
    start = time.perf_counter()
    for position in range(positions):
        made.append(key(position))
        mx.async_eval(made[-1])
    mx.eval(made)
    seconds = time.perf_counter() - start
    return 1e6 * seconds / positions, mx.concatenate(made).tolist()


def hash_alone(positions: int) -> float:
    """Microseconds a position of the host chain's splits alone."""
    state, split = tuple(mx.random.key(3).tolist()), _split()
    start = time.perf_counter()
    for _ in range(positions):
        state = split(*state)[:2]
    return 1e6 * (time.perf_counter() - start) / positions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.positions < 1 or args.repeats < 1:
        parser.error(
            f"--positions and --repeats must be >= 1, got {args.positions}, {args.repeats}"
        )
    reference = run("split", 100)[1]
    for method in METHODS:
        if run(method, 100)[1] != reference:
            raise SystemExit(f"key_chain.py: the {method} chain gave other keys than mlx-lm's")
    times: dict[str, list[float]] = {method: [] for method in (*METHODS, "hash")}
    for _ in range(args.repeats):
        for method in METHODS:
            times[method].append(run(method, args.positions)[0])
        times["hash"].append(hash_alone(args.positions))
    us = {method: statistics.median(values) for method, values in times.items()}
    print(
        f"# key chain: {mx.default_device()}, MLX {mx.__version__}, {args.positions} positions, "
        f"median of {args.repeats} interleaved runs; us a position"
    )
    print("| host | device | split | device / host | hash |")
    print("|---|---|---|---|---|")
    cells = [f"{us[method]:.1f}" for method in METHODS]
    cells += [f"{us['device'] / us['host']:.2f}x", f"{us['hash']:.1f}"]
    print(f"| {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
