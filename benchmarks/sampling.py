"""Is a sort-free top-p worth using in ``SpecSampler.probs``?

mlx-lm's ``apply_top_p`` sorts the whole vocabulary. This script times, for the ``N + 1 = 9``
rows of a verification round, mlx-lm's filter, our ``top_p_mask`` (what ``probs`` uses) and a
sort-free candidate: a bisection on the probability threshold with a fixed number of passes. It
prints the median time of interleaved repeats as a ratio to mlx-lm's, and for the candidate how
many kept tokens differ from mlx-lm's kept set (it sums the mass in another order, so float32
rounding moves the boundary). Nothing is asserted.

Usage::

    python benchmarks/sampling.py [--repeats 7]
"""

import argparse
import statistics
import time

import mlx.core as mx
import mlx_lm.sample_utils as mlx_lm_sampling

from mlx_spec.sampling import make_sampler, top_p_mask

ROWS = 9
TOP_P = 0.9
TEMP = 0.7


def _ordered_keys(logprobs: mx.array) -> tuple[mx.array, int]:
    """Unsigned integers ordered as the float values are (``-0`` folded onto ``+0``)."""
    bits = 8 * logprobs.dtype.size
    unsigned = {16: mx.uint16, 32: mx.uint32}[bits]
    x = mx.where(logprobs == 0, mx.array(0, logprobs.dtype), logprobs).view(unsigned)
    sign = mx.array(1 << (bits - 1), unsigned)
    return mx.where((x & sign) != 0, ~x, x | sign), bits


def bisect_top_p_mask(logprobs: mx.array, top_p: float) -> mx.array:
    """Sort-free candidate: keep a token when the mass strictly above it is < top_p * total.

    Bisects on the ordered integer keys of the values, one pass per bit, so the threshold it
    finds is exact for the sums it computes; those sums are float32 reductions in MLX's order.
    """
    probs = mx.exp(logprobs.astype(mx.float32))
    bound = top_p * probs.sum(axis=-1, keepdims=True)
    keys, bits = _ordered_keys(logprobs)
    lo = keys.min(axis=-1, keepdims=True)
    hi = keys.max(axis=-1, keepdims=True)
    for _ in range(bits):
        mid = lo + ((hi - lo) >> 1)
        below = mx.where(keys > mid, probs, 0).sum(axis=-1, keepdims=True) < bound
        hi = mx.where(below, mid, hi)
        lo = mx.where(below, lo, mid + 1)
    return keys >= hi


def _median_ms(fns: dict, x: mx.array, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        mx.eval(fn(x))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn(x))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    theirs_sampler = mlx_lm_sampling.make_sampler(temp=TEMP, top_p=TOP_P)
    ours_sampler = make_sampler(temp=TEMP, top_p=TOP_P)
    compiled_bisect = mx.compile(bisect_top_p_mask)
    fns = {
        "mlx-lm apply_top_p": lambda x: mlx_lm_sampling.apply_top_p(x, TOP_P),
        "top_p_mask": lambda x: top_p_mask(x, TOP_P),
        "bisection": lambda x: bisect_top_p_mask(x, TOP_P),
        "bisection compiled": lambda x: compiled_bisect(x, TOP_P),
        "mlx-lm sampler": theirs_sampler,
        "SpecSampler.__call__": ours_sampler,
        "SpecSampler.probs": ours_sampler.probs,
    }
    print(f"{ROWS} rows, top_p = {TOP_P}, temp = {TEMP}, median of {args.repeats} interleaved")
    print(
        f"{'V':>7} {'dtype':>8} {'mlx-lm top-p ms':>15} {'top_p_mask':>10} {'bisection':>9} "
        f"{'compiled':>8} {'differ':>6} {'__call__':>8} {'probs':>6}  (ratios: ours / mlx-lm)"
    )
    for vocab in (32000, 152064):
        for dtype in (mx.float32, mx.bfloat16):
            logits = 3.0 * mx.random.normal((ROWS, vocab), key=mx.random.key(vocab))
            x = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(dtype)
            mx.eval(x)
            kept = mx.isfinite(mlx_lm_sampling.apply_top_p(x, TOP_P))
            differ = mx.sum(bisect_top_p_mask(x, TOP_P) != kept).item()
            ms = _median_ms(fns, x, args.repeats)
            base, sampler_base = ms["mlx-lm apply_top_p"], ms["mlx-lm sampler"]
            print(
                f"{vocab:>7} {str(dtype).split('.')[-1]:>8} {base:>15.1f} "
                f"{ms['top_p_mask'] / base:>10.2f} {ms['bisection'] / base:>9.2f} "
                f"{ms['bisection compiled'] / base:>8.2f} {differ:>6} "
                f"{ms['SpecSampler.__call__'] / sampler_base:>8.2f} "
                f"{ms['SpecSampler.probs'] / sampler_base:>6.2f}"
            )
    print("differ: tokens (of all rows) whose kept/dropped status differs from mlx-lm's top-p.")
    print("__call__, probs: ratio to mlx-lm's make_sampler(temp, top_p) drawing the same rows.")


if __name__ == "__main__":
    main()
