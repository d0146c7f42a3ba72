"""Does speculation pay in generation? mlx-spec's loop against mlx-lm's and plain decoding.

For temperatures 0, 0.7 and 1.0 and draft lengths N in {1, 2, 4}, on the same models, prompts
and seeds, the mean tokens per round and the tokens per second of:

- mlx-spec: :func:`mlx_spec.generation.speculative_generate_step` with
  :func:`mlx_spec.sampling.make_sampler` (rejection sampling at temperature > 0);
- mlx-lm: ``mlx_lm.generate.speculative_generate_step`` with mlx-lm's sampler (a draft token is
  kept when the target's own sample equals it);
- plain: ``mlx_lm.generate.generate_step`` (one target call per token).

Rounds of mlx-lm's loop are counted from its yields (one target token per round). Methods run
interleaved prompt by prompt, after a warm-up, so load on the machine affects them alike; the
table gives ratios measured in this one run. The measuring code is in :mod:`mlx_spec.bench`
(``mlx-spec bench`` runs it too, and plots it).

Models: the demo pair shipped in ``mlx_spec/demo`` (a trained 6-layer target and a distilled
1-layer draft, vocabulary 4096), on its code and prose prompts. With ``--random-models``, the
random-weight pair used before the demo pair existed: a float32 llama target whose first layer
dominates the later ones and whose output layer is scaled up, so its distributions are peaked as
a trained model's are, and as draft that target cut to its first layer; random prompts.

Usage: ``python benchmarks/generation.py [--quick] [--tokens T] [--prompts P] [--drafts 1 2 4]
[--random-models]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models import llama

from mlx_spec.bench import PROMPTS, generation_rows, generation_table, load_demo_pair, warm_up

TEMPS = (0.0, 0.7, 1.0)
DRAFTS = (1, 2, 4)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per generation")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per setting")
    parser.add_argument("--drafts", type=int, nargs="+", default=DRAFTS, help="values of N")
    parser.add_argument(
        "--random-models", action="store_true", help="random-weight llamas, not the demo pair"
    )
    args = parser.parse_args()
    max_tokens = args.tokens or (48 if args.quick else 128)
    n_prompts = args.prompts or (2 if args.quick else 4)

    if args.random_models:
        target = make_target()
        draft = cut(target, 1)
        prompts = [
            mx.random.randint(1, target.args.vocab_size, (24,), key=mx.random.key(100 + i))
            for i in range(n_prompts)
        ]
        models = f"random float32 llamas: target {len(target.layers)} layers, draft 1 layer"
    else:
        target, draft, tokenizer = load_demo_pair()
        prompts = [mx.array(tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(n_prompts)]
        models = "the shipped demo pair: target 6 x 384, draft 1 x 192, bfloat16"
    warm_up(target, draft, prompts[0])

    print(
        f"# generation: {platform.system()} {platform.machine()}, MLX {mx.__version__}, "
        f"{mx.default_device()}; {models}, V = {target.args.vocab_size}; "
        f"{n_prompts} prompt(s) x {max_tokens} tokens",
        flush=True,
    )
    rows = generation_rows(target, draft, prompts, TEMPS, args.drafts, max_tokens)
    print(generation_table(rows))


if __name__ == "__main__":
    main()
