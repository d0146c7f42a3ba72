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

With ``--ablate`` (batch 1), four more methods split a stretch's cost over mlx-lm's into its
parts. Three are loops of pipelined plain steps written as mlx-lm's ``generate_step`` runs them
(the next step built on the lazy token and started before the token is read):

- ``loop``: mlx-lm's operations (its cache, ``logits - logsumexp``, its sampler): it should cost
  what ``plain`` costs;
- ``+draw``: the token drawn as a stretch draws it (:meth:`mlx_spec.rules.Rule.step`, with the
  position's key from :class:`mlx_spec.keys.KeyChain`);
- ``+cache``: ``+draw`` with the model fed as a stretch feeds it (:meth:`mlx_spec.loop.Target.step`:
  the checkpoints and bookkeeping of :class:`mlx_spec.caches.ModelCache`).

``+draw`` over ``loop`` and ``+cache`` over ``+draw`` are those parts' costs, and ``stretch`` over
``+cache`` the loop's own host work each step (the text, the counts, asking the drafter). Two more
methods keep one :class:`mlx_spec.draft_length.Adaptive` over their runs, as a caller that keeps
it: ``lookup, one policy`` is ``lookup`` whose policy measures what rounds cost in its first run
only; ``stretch, policy asked`` is ``stretch`` with a drafter that is not free, so that the loop
asks the policy before every step (as with a draft model), given costs under which it always
answers a plain step: over ``stretch``, what asking costs.

Pairs: those of ``benchmarks/generation.py`` (their first open prompt), and ``host``: a model with
next to no device work (an embedding and its transpose), whose time per token is the loops' own
host work and synchronisation.

Prints the median milliseconds a token (of the whole batch) of each method and
``plain / method`` (above 1: faster than mlx-lm's plain decoding). On MLX's CUDA backend, cuDNN
attention is left off (``MLX_CUDA_USE_CUDNN_SDPA=0``, as ``mlx-spec`` sets it) unless the
environment sets it, so no method pays for building attention graphs of new shapes.

Usage: ``python benchmarks/plain_steps.py [--pair host demo 16x2048 ...] [--temps 0 0.8]
[--tokens 256] [--repeats 7] [--batch 1] [--ablate]``.
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
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler as lm_make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import build_pair

from mlx_spec import _mlx_lm
from mlx_spec.batch import SpeculativeBatch
from mlx_spec.batch_length import BatchAdaptive
from mlx_spec.caches import ModelCache
from mlx_spec.draft_length import Adaptive, Calibration
from mlx_spec.drafters import Draft, Drafter, PromptLookupDrafter
from mlx_spec.generation import generation_stream, speculative_generate_step
from mlx_spec.keys import KeyChain
from mlx_spec.loop import Target, Text, vocab_size
from mlx_spec.rules import make_rule
from mlx_spec.sampling import make_sampler


class Silent(Drafter):
    """A free drafter that never proposes anything: every token is a plain step."""

    free = True
    reads_keys = False

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        return Draft(mx.array([], dtype=mx.uint32))


class Unasked(Silent):
    """A drafter that is not free and proposes nothing: the loop asks the policy before every
    plain step (as with a draft model), and never for a proposal."""

    free = False


# Costs under which drafting never pays and no test round falls due (a round costs a million
# plain steps): the policy it is given answers "a plain step" every time.
NEVER = Calibration(plain=1.0, round=1e6, token=1.0)


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
    target: nn.Module, prompt: mx.array, tokens: int, temp: float, ablate: bool = False
) -> dict[str, Callable[[], None]]:
    def plain() -> None:
        mx.random.seed(0)
        sampler = lm_make_sampler(temp=temp)
        for _ in generate_step(prompt, target, max_tokens=tokens, sampler=sampler):
            pass

    def adaptive(drafter: Drafter | str, policy: Adaptive | None = None) -> Callable[[], None]:
        def run() -> None:
            steps = speculative_generate_step(
                prompt,
                target,
                drafter=drafter,
                adaptive=policy is None,
                max_tokens=tokens,
                sampler=make_sampler(temp=temp),
                key=mx.random.key(0),
                policy=policy,
            )
            for _ in steps:
                pass

        return run

    methods = {"stretch": adaptive(Silent()), "lookup": adaptive("prompt-lookup")}
    if ablate:
        # Kept over the runs: it measures what rounds cost in its first run only.
        methods["lookup, one policy"] = adaptive("prompt-lookup", Adaptive())
        methods["stretch, policy asked"] = adaptive(Unasked(), Adaptive(calibration=NEVER))
    return {"plain": plain, **methods}


def _ablation(
    target: nn.Module, prompt: mx.array, tokens: int, temp: float
) -> dict[str, Callable[[], list[int]]]:
    """The loops of ``--ablate`` (see the module's description); each returns its tokens, those
    of mlx-lm's ``generate_step`` with ``mx.random.seed(0)``."""
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    vocab = vocab_size(target)

    def lm_draw() -> Callable[[mx.array, int], tuple[mx.array, mx.array]]:
        mx.random.seed(0)
        sampler = lm_make_sampler(temp=temp)

        def draw(logits: mx.array, position: int) -> tuple[mx.array, mx.array]:
            token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            return token, token

        return draw

    def spec_draw() -> Callable[[mx.array, int], tuple[mx.array, mx.array]]:
        rule = make_rule(make_sampler(temp=temp), vocab=vocab)
        chain = KeyChain(mx.random.key(0), rule.steps) if rule.random else None

        def draw(logits: mx.array, position: int) -> tuple[mx.array, mx.array]:
            key = rule.keys(chain, position, 0, draft=False) if chain is not None else None
            token, fed, _ = rule.step(logits, key, on_cpu=on_cpu)
            return token, fed

        return draw

    def lm_feed() -> Callable[[mx.array], mx.array]:
        cache = make_prompt_cache(target)
        target(prompt[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        return lambda y: target(y[None], cache=cache)[0, -1:]

    def spec_feed() -> Callable[[mx.array], mx.array]:
        model_cache = ModelCache(make_prompt_cache(target), model=target)
        fed = Target(target, model_cache, [], lambda layers: None, None, vocab)
        text = Text(prompt.astype(mx.uint32), prompt.tolist())
        fed.prefill(text, 512)
        return lambda y: fed.step(y, None)

    def loop(make_draw: Callable, make_feed: Callable) -> Callable[[], list[int]]:
        def run() -> list[int]:
            made = []
            with mx.stream(generation_stream):
                draw, feed = make_draw(), make_feed()
                token, fed = draw(feed(prompt[-1:]), 0)
                mx.async_eval(token)
                for position in range(tokens):
                    ahead = None
                    if position + 1 < tokens:
                        ahead = draw(feed(fed), position + 1)
                        mx.async_eval(ahead[0])
                    made.append(token.item())
                    if ahead is not None:
                        token, fed = ahead
            return made

        return run

    return {
        "loop": loop(lm_draw, lm_feed),
        "+draw": loop(spec_draw, lm_feed),
        "+cache": loop(spec_draw, spec_feed),
    }


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
    parser.add_argument("--ablate", action="store_true", help="split a stretch's cost (batch 1)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.ablate and args.batch != 1:
        parser.error("--ablate times single sequences: leave --batch at 1")
    names = ["plain", "stretch", "lookup"]
    ablation = ["lookup, one policy", "stretch, policy asked", "loop", "+draw", "+cache"]
    names += ablation if args.ablate else []
    print(
        f"# plain steps: {mx.default_device()}, MLX {mx.__version__}, batch {args.batch}, "
        f"{args.tokens} tokens a sequence, "
        f"median of {args.repeats} interleaved runs; ms a token "
        "(plain / method: above 1 is faster than mlx-lm's plain decoding)"
    )
    print(
        f"| pair | temp | {' | '.join(names)} | "
        f"{' | '.join(f'plain / {name}' for name in names[1:])} |"
    )
    print("|---|---|" + "---|" * (2 * len(names) - 1))
    for name in args.pair:
        target, prompt = _target_and_prompt(name)
        for temp in args.temps:
            methods = (
                _methods(target, prompt, args.tokens, temp, args.ablate)
                if args.batch == 1
                else _batch_methods(target, prompt, args.tokens, temp, args.batch)
            )
            if args.ablate:
                methods |= _ablation(target, prompt, args.tokens, temp)
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
            cells = [f"{ms[m]:.3f}" for m in names] + [
                f"{ms['plain'] / ms[m]:.2f}x" for m in names[1:]
            ]
            print(f"| {name} | {temp} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
