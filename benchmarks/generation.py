"""Does speculation pay in generation? mlx-spec's loop against mlx-lm's and plain decoding.

For temperatures 0, 0.7 and 1.0 and draft lengths N in {2, 4, 8}, on the same models, prompts and
seeds, the mean tokens per round and the tokens per second of:

- mlx-spec: :func:`mlx_spec.generate.speculative_generate_step` with
  :func:`mlx_spec.sampling.make_sampler` (rejection sampling at temperature > 0);
- mlx-lm: ``mlx_lm.generate.speculative_generate_step`` with mlx-lm's sampler (a draft token is
  kept when the target's own sample equals it);
- plain: ``mlx_lm.generate.generate_step`` (one target call per token).

Rounds of mlx-lm's loop are counted from its yields (one target token per round). Methods run
interleaved prompt by prompt, after a warm-up, so load on the machine affects them alike; the
table gives ratios measured in this one run.

Models (random weights, nothing downloaded, until a shipped demo pair replaces them): a float32
llama target whose first layer dominates the later ones and whose output layer is scaled up, so
its distributions are peaked as a trained model's are; the draft is that target cut to its first
layer (same embeddings and output layer).

Usage: ``python benchmarks/generation.py [--quick] [--tokens T] [--prompts P]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import platform
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

from mlx_spec.generate import SpeculativeStats, speculative_generate_step
from mlx_spec.sampling import make_sampler

# The module: the package exports a function under the same name.
lm_generate = importlib.import_module("mlx_lm.generate")

TEMPS = (0.0, 0.7, 1.0)
DRAFTS = (2, 4, 8)


def make_target(seed: int = 0, *, vocab: int = 4096, hidden: int = 384, layers: int = 8):
    """A float32 llama: layer 0 scaled by 3, the later layers by 0.8, the output layer by 6."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=4 * hidden,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)

    def scale(path: str, w: mx.array) -> mx.array:
        parts = path.split(".")
        if parts[:2] == ["model", "layers"] and "norm" not in path:
            return w * (3.0 if parts[2] == "0" else 0.8)
        return w * 6.0 if parts[0] == "lm_head" else w

    model.update(tree_map_with_path(scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def cut(model, layers: int):
    """``model`` keeping its first ``layers`` layers, embeddings and output layer."""
    small = llama.Model(dataclasses.replace(model.args, num_hidden_layers=layers, layer_types=None))
    small.load_weights(
        [
            (k, v)
            for k, v in tree_flatten(model.parameters())
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
        ]
    )
    mx.eval(small.parameters())
    return small


@dataclasses.dataclass
class Tally:
    tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0

    def add(self, steps: Iterator, rounds: Callable[[list[bool]], int]) -> None:
        tic = time.perf_counter()
        # Speculative loops yield (token, logprobs, from_draft); plain decoding (token, logprobs).
        flags = [len(item) == 3 and bool(item[2]) for item in steps]
        self.seconds += time.perf_counter() - tic
        self.tokens += len(flags)
        self.rounds += rounds(flags)


def _ours(prompt, target, draft, n, temp, seed, max_tokens, tally: Tally) -> None:
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
    )
    tally.add(steps, lambda _: stats.rounds)


def _mlx_lm(prompt, target, draft, n, temp, seed, max_tokens, tally: Tally) -> None:
    mx.random.seed(seed)
    steps = lm_generate.speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=n,
        max_tokens=max_tokens,
        sampler=mlx_lm_make_sampler(temp=temp),
    )
    # One target token per round; a last round cut by max_tokens may end on a draft token.
    tally.add(steps, lambda flags: flags.count(False) + (1 if flags and flags[-1] else 0))


def _plain(prompt, target, temp, seed, max_tokens, tally: Tally) -> None:
    mx.random.seed(seed)
    steps = generate_step(
        prompt, target, max_tokens=max_tokens, sampler=mlx_lm_make_sampler(temp=temp)
    )
    tally.add(steps, len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per generation")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per setting")
    args = parser.parse_args()
    max_tokens = args.tokens or (48 if args.quick else 128)
    n_prompts = args.prompts or (1 if args.quick else 2)

    target = make_target()
    draft = cut(target, 1)
    prompts = [
        mx.random.randint(1, target.args.vocab_size, (24,), key=mx.random.key(100 + i))
        for i in range(n_prompts)
    ]
    # Warm-up: compile kernels and fill MLX's buffer cache.
    _ours(prompts[0], target, draft, 2, 1.0, 0, 16, Tally())
    _mlx_lm(prompts[0], target, draft, 2, 1.0, 0, 16, Tally())
    _plain(prompts[0], target, 1.0, 0, 16, Tally())

    print(
        f"# generation: {platform.system()} {platform.machine()}, MLX {mx.__version__}, "
        f"{mx.default_device()}; target {len(target.layers)} layers, draft 1 layer, "
        f"V = {target.args.vocab_size}; {n_prompts} prompt(s) x {max_tokens} tokens"
    )
    header = (
        "| temp | N | tok/round mlx-spec | tok/round mlx-lm | ratio | tok/s mlx-spec "
        "| tok/s mlx-lm | tok/s plain | mlx-spec/mlx-lm | mlx-spec/plain |"
    )
    print(header)
    print("|---" * 10 + "|")
    for temp in TEMPS:
        for n in DRAFTS:
            ours, theirs, plain = Tally(), Tally(), Tally()
            for i, prompt in enumerate(prompts):
                _ours(prompt, target, draft, n, temp, i, max_tokens, ours)
                _mlx_lm(prompt, target, draft, n, temp, i, max_tokens, theirs)
                _plain(prompt, target, temp, i, max_tokens, plain)
            tpr_ours = ours.tokens / ours.rounds
            tpr_theirs = theirs.tokens / theirs.rounds
            tps = [t.tokens / t.seconds for t in (ours, theirs, plain)]
            print(
                f"| {temp:.1f} | {n} | {tpr_ours:.2f} | {tpr_theirs:.2f} | "
                f"{tpr_ours / tpr_theirs:.2f}x | {tps[0]:.0f} | {tps[1]:.0f} | {tps[2]:.0f} | "
                f"{tps[0] / tps[1]:.2f}x | {tps[0] / tps[2]:.2f}x |"
            )


if __name__ == "__main__":
    main()
