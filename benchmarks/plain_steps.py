"""What a stretch of plain steps costs against mlx-lm's plain decoding.

With adaptive draft lengths, where drafting does not pay, mlx-spec's loop runs stretches of
pipelined plain steps (``Generation.stretch``). They should cost what mlx-lm's ``generate_step``
costs: this times both, interleaved, on the same prompt, at each temperature of ``--temps``:

- ``plain``: ``mlx_lm.generate.generate_step``, with mlx-lm's sampler;
- ``stretch``: ``speculative_generate_step`` with adaptive lengths, mlx-spec's sampler and a
  drafter that never proposes anything, so every token is a stretch's plain step;
- ``lookup``: the same with prompt lookup (``drafter="prompt-lookup"``), which also checks a
  guess each step and drafts where guesses pay.

With ``--batch B`` above 1, a batch of ``B`` copies of the prompt (each sampled with its own key)
is decoded instead:

- ``plain``: mlx-lm's ``BatchGenerator``;
- ``stretch`` and ``lookup``: :class:`mlx_spec.batch.SpeculativeBatch` with the same drafters and
  :class:`mlx_spec.BatchAdaptive` lengths, as the patched server runs it.

Pairs: those of ``benchmarks/generation.py`` (their first open prompt), and ``host``: a model with
next to no device work (an embedding and its transpose), whose time per token is the loops' own
host work and synchronisation.

Prints the median milliseconds a token (of the whole batch) of each method and
``plain / method`` (above 1: faster than mlx-lm's plain decoding). On MLX's CUDA backend, cuDNN
attention is left off (``MLX_CUDA_USE_CUDNN_SDPA=0``, as ``mlx-spec`` sets it) unless the
environment sets it, so no method pays for building attention graphs of new shapes.

Usage: ``python benchmarks/plain_steps.py [--pair host demo 16x2048 ...] [--temps 0 0.8]
[--tokens 256] [--repeats 7] [--batch 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler as lm_make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import build_pair

from mlx_spec import _mlx_lm
from mlx_spec.batch import SpeculativeBatch
from mlx_spec.batch_length import BatchAdaptive
from mlx_spec.drafters import Draft, Drafter, PromptLookupDrafter
from mlx_spec.generation import speculative_generate_step
from mlx_spec.loop import Text
from mlx_spec.sampling import make_sampler


class Silent(Drafter):
    """A free drafter that never proposes anything: every token is a plain step."""

    free = True

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        return Draft(mx.array([], dtype=mx.uint32))


class HostOnly(nn.Module):
    """A model with next to no device work: logits from an embedding and its transpose, and one
    cache that keeps the token count as an attention cache does."""

    def __init__(self, vocab: int = 64, dims: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dims)
        self.layers = [nn.Identity()]

    def make_cache(self) -> list[KVCache]:
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: list[KVCache] | None = None, **_) -> mx.array:
        h = self.embed(inputs)
        if cache is not None:
            cache[0].update_and_fetch(h[:, None], h[:, None])
        return self.embed.as_linear(h)


def _target_and_prompt(name: str) -> tuple[nn.Module, mx.array]:
    if name == "host":
        mx.random.seed(0)
        model = HostOnly()
        mx.eval(model.parameters())
        return model, mx.array([1, 2, 3, 4, 5], mx.uint32)
    pair = build_pair(name, 1)
    return pair.target, pair.workloads["open"][0]


def _methods(
    target: nn.Module, prompt: mx.array, tokens: int, temp: float
) -> dict[str, Callable[[], None]]:
    def plain() -> None:
        mx.random.seed(0)
        sampler = lm_make_sampler(temp=temp)
        for _ in generate_step(prompt, target, max_tokens=tokens, sampler=sampler):
            pass

    def adaptive(drafter: Drafter | str) -> Callable[[], None]:
        def run() -> None:
            steps = speculative_generate_step(
                prompt,
                target,
                drafter=drafter,
                adaptive=True,
                max_tokens=tokens,
                sampler=make_sampler(temp=temp),
                key=mx.random.key(0),
            )
            for _ in steps:
                pass

        return run

    return {"plain": plain, "stretch": adaptive(Silent()), "lookup": adaptive("prompt-lookup")}


def _batch_methods(
    target: nn.Module, prompt: mx.array, tokens: int, temp: float, size: int
) -> dict[str, Callable[[], None]]:
    prompts = [prompt.tolist()] * size

    def plain() -> None:
        mx.random.seed(0)
        sampler = lm_make_sampler(temp=temp)
        generator = BatchGenerator(target, stop_tokens=[], sampler=sampler)
        generator.insert(prompts, [tokens] * size)
        while generator.next_generated():
            pass
        generator.close()

    def adaptive(drafter: Drafter) -> Callable[[], None]:
        policy = BatchAdaptive()  # kept over the runs, as a server keeps its costs

        def run() -> None:
            samplers = [make_sampler(temp=temp) if temp else None] * size
            keys = [mx.random.key(i) if temp else None for i in range(size)]
            with mx.stream(_mlx_lm.lm.generation_stream):
                batch = SpeculativeBatch(
                    target, prompts, [8] * size, [tokens] * size, [], samplers, keys,
                    drafter=drafter, policy=policy,
                )  # fmt: skip
                while len(batch):
                    batch.next()

        return run

    return {
        "plain": plain,
        "stretch": adaptive(Silent()),
        "lookup": adaptive(PromptLookupDrafter()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", nargs="+", default=["host", "demo"])
    parser.add_argument("--temps", type=float, nargs="+", default=[0.0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    print(
        f"# plain steps: {mx.default_device()}, MLX {mx.__version__}, batch {args.batch}, "
        f"{args.tokens} tokens a sequence, "
        f"median of {args.repeats} interleaved runs; ms a token "
        "(plain / method: above 1 is faster than mlx-lm's plain decoding)"
    )
    print("| pair | temp | plain | stretch | lookup | plain / stretch | plain / lookup |")
    print("|---|---|---|---|---|---|---|")
    for name in args.pair:
        target, prompt = _target_and_prompt(name)
        for temp in args.temps:
            methods = (
                _methods(target, prompt, args.tokens, temp)
                if args.batch == 1
                else _batch_methods(target, prompt, args.tokens, temp, args.batch)
            )
            for run in methods.values():  # warm-up: compilation and first-use graphs
                run()
            times: dict[str, list[float]] = {method: [] for method in methods}
            for _ in range(args.repeats):
                for method, run in methods.items():
                    start = time.perf_counter()
                    run()
                    seconds = time.perf_counter() - start
                    times[method].append(1e3 * seconds / (args.tokens * args.batch))
            ms = {method: statistics.median(values) for method, values in times.items()}
            print(
                f"| {name} | {temp} | {ms['plain']:.3f} | {ms['stretch']:.3f} | "
                f"{ms['lookup']:.3f} | {ms['plain'] / ms['stretch']:.2f}x | "
                f"{ms['plain'] / ms['lookup']:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
