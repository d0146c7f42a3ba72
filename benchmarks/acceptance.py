"""How fast is one verification step? Acceptance + read against its floor and its peers.

For each vocabulary size V and draft length N, on bfloat16 logits and float32 probabilities, the
median latency (interleaved repeats, one run) of:

- floor: ``mx.max`` over the same rows + a read (bfloat16 logits for greedy, float32 probs for
  sampled): no acceptance can read its rows faster;
- mlx-spec: ``accept_greedy`` / ``accept_sampled`` (with and without ``draft_probs``) + ``read``;
- mlx-lm: its verification path today (log-softmax and sampler over the N + 1 rows, ``tolist``,
  compare in Python, as ``mlx_lm.generate.speculative_generate_step`` does);
- nan check: what reporting a NaN row costs in ``accept_greedy`` (a gather of one value per row
  at its argmax, and ``isnan``), + a read, beside the floor's pass over the rows;
- oracle: the plain-loop NumPy oracle of the test suite (with ``--oracle``; it is slow);
- torch: where PyTorch sees a CUDA GPU and MLX runs on the GPU, the same acceptance written the
  way vLLM's rejection sampler does it (argmax, compare, cumprod; ratio test, residual,
  exponential-race sampling), on the same GPU.

Usage: ``python benchmarks/acceptance.py [--quick] [--repeats R] [--oracle] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_spec import accept_greedy, accept_sampled, read

VOCABS = (32000, 152064, 262144)
DRAFTS = (1, 4, 8, 16)


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


def _match(tokens: list[int], draft: list[int]) -> tuple[int, int]:
    n = 0
    while n < len(draft) and tokens[n] == draft[n]:
        n += 1
    return n, tokens[n]


def _torch_peers(logits_np: np.ndarray, probs_np: np.ndarray, q_np: np.ndarray, draft_np):
    """vLLM-style acceptance in PyTorch on the GPU, or {} where there is none."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    dev = torch.device("cuda")
    logits = torch.from_numpy(logits_np).to(dev, torch.bfloat16)
    probs = torch.from_numpy(probs_np).to(dev)
    q = torch.from_numpy(q_np).to(dev)
    draft = torch.from_numpy(draft_np.astype(np.int64)).to(dev)
    n = draft.shape[0]
    gen = torch.Generator(device=dev).manual_seed(0)

    def greedy() -> list[int]:
        choice = logits.argmax(dim=-1)
        ok = (choice[:n] == draft).to(torch.int32)
        accepted = ok.cumprod(0).sum()
        return torch.stack([accepted, choice[accepted]]).tolist()

    def sampled(with_q: bool) -> list[int]:
        rows = torch.arange(n, device=dev)
        p_d = probs[rows, draft]
        q_d = q[rows, draft] if with_q else torch.ones_like(p_d)
        u = torch.rand(n, device=dev, generator=gen)
        ok = (u * q_d < p_d).to(torch.int32)
        accepted = ok.cumprod(0).sum()
        qn = q if with_q else torch.nn.functional.one_hot(draft, probs.shape[1]).to(probs.dtype)
        residual = (probs[:n] - qn).clamp_min(0)
        residual = torch.cat([residual, probs[n:]], 0)
        residual = residual / residual.sum(-1, keepdim=True)
        race = torch.empty_like(residual).exponential_(generator=gen)
        choice = (residual / race).argmax(-1)
        return torch.stack([accepted, choice[accepted]]).tolist()

    def floor() -> list[float]:
        return logits.max(dim=-1).values.float().tolist()

    return {
        "torch floor": floor,
        "torch greedy": greedy,
        "torch sampled q": lambda: sampled(True),
        "torch sampled none": lambda: sampled(False),
    }


def _case(v: int, n: int, oracle: bool) -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(v + n)
    logits_np = (rng.standard_normal((n + 1, v), dtype=np.float32) * 4).astype(np.float32)
    # The rows as a model hands them over: a slice of a [1, L, V] bfloat16 output.
    out = mx.array(np.concatenate([logits_np[:1], logits_np])[None]).astype(mx.bfloat16)
    logits = out[0, -(n + 1) :]
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    q = mx.softmax(mx.array(rng.standard_normal((n, v), dtype=np.float32) * 4), axis=-1)
    # A draft that agrees for about half its length, so the accepted count varies.
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
    if oracle:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from oracle import oracle_greedy

        rows_np, draft_np = np.array(logits.astype(mx.float32)), np.array(draft)
        cases["oracle greedy"] = lambda: oracle_greedy(rows_np, draft_np, [])
    torch_cases = _torch_peers(
        np.array(logits.astype(mx.float32)), np.array(probs), np.array(q), np.array(draft)
    )
    cases.update(torch_cases)
    return cases


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(v: int, n: int, repeats: int, oracle: bool) -> dict[str, float]:
    """Median seconds of each case, with the cases interleaved in every repeat."""
    cases = _case(v, n, oracle)
    for fn in cases.values():  # warm up: compilation and first-touch costs
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            if name.startswith("oracle") and len(samples[name]) >= 3:
                continue
            samples[name].append(_time(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def _table(rows: list[dict]) -> str:
    head = (
        f"{'V':>7} {'N':>3} | {'floor16':>8} {'greedy':>8} {'x floor':>7} {'mlx-lm':>8} "
        f"{'speedup':>7} | {'floor32':>8} {'samp q':>8} {'x floor':>7} {'samp -':>8} "
        f"{'x floor':>7} {'mlx-lm':>8} {'speedup':>7} | {'nan chk':>8} {'x floor':>7}"
    )
    extra = [k for k in rows[0] if k.startswith(("oracle", "torch"))]
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


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="V = 152064 and N = 8 only")
    parser.add_argument("--repeats", type=int, default=25, help="interleaved repeats per case")
    parser.add_argument("--oracle", action="store_true", help="also time the NumPy oracle")
    parser.add_argument("--json", type=Path, help="write the raw medians (seconds) here")
    args = parser.parse_args(argv)
    configs = [(152064, 8)] if args.quick else [(v, n) for v in VOCABS for n in DRAFTS]
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, {platform.machine()} "
        f"{platform.system()}; medians of {args.repeats} interleaved repeats; times in ms; "
        "'x floor' = time / floor, 'speedup' = mlx-lm / mlx-spec",
        flush=True,
    )
    rows = []
    for i, (v, n) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] V={v} N={n} ...", file=sys.stderr, flush=True)
        rows.append({"V": v, "N": n, **measure(v, n, args.repeats, args.oracle)})
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
