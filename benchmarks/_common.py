"""What the acceptance benchmarks share: one verification step's cases, their PyTorch peers, and
their timing (``benchmarks/acceptance.py``, ``overhead.py`` and ``fused_greedy.py`` import it).

The cases time mlx-spec's acceptance (composition and, where MLX runs on CUDA, the fused kernels)
against its floor (a max over the same rows plus a read: no acceptance reads its rows faster),
mlx-lm's verification path, and the same acceptance written the way vLLM writes it in PyTorch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_spec import accept_greedy, accept_sampled, kernels, read

VOCABS = (32000, 152064, 262144)
DRAFTS = (1, 4, 8, 16)
Progress = Callable[[str], None]


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
