"""One rank of ``tests/test_distributed.py`` on the ring backend, started as ``mlx.launch`` would.

For each setting named on the command line the rank builds (or loads) the setting's models,
splits the target over the group, runs the setting's cases and writes what each case gave
(tokens, or the ``ValueError`` it raised) to ``OUT/<setting>-rank<r>.json``. The test process
builds the same models unsplit, from the same seeds, for its references.

Settings:

- ``tensor``: the shipped demo target, loaded with :func:`mlx_spec.distributed.load_sharded`
  (mlx-lm's ``sharded_load``, tensor parallel) and the demo draft, replicated.
- ``pipeline``: a tiny random qwen2 (a class with ``pipeline`` and only KV caches), saved to
  ``OUT/qwen2`` by the test and loaded with ``load_sharded(..., pipeline=True)``, one layer per
  stage, with its first layer as a replicated draft.
- ``hybrid``: a tiny random qwen3_next (attention and gated delta-net layers) as a pipeline, with
  the qwen2 draft; its recurrent caches cannot be trimmed, so today every case raises.

``uncaught`` and ``die`` end the launch instead: every rank raises the error for keys that
differ, or rank 1 exits in the middle of a generation.

Usage: ``python tests/distributed_worker.py OUT SETTING [SETTING ...]``
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen2, qwen3_next

from mlx_spec.distributed import fresh_seed, load_sharded, model_group
from mlx_spec.generation import speculative_generate_step
from mlx_spec.sampling import make_sampler

DEMO = Path(__file__).resolve().parent.parent / "mlx_spec" / "demo"
# The folder under OUT that holds the pipeline setting's target (written by save_qwen2).
QWEN2_FOLDER = "qwen2"
DEMO_PROMPT = "def read_file(path):\n    with open(path) as f:\n"
TINY_PROMPT = [1, 2, 3, 4, 5]
# Tokens per generation: fewer on the demo target, whose every call makes 12 all-sums (at N = 3
# about 6 rounds, with rejections at temperature 1 and at 0 alike).
DEMO_TOKENS = 12
TINY_TOKENS = 40
NUM_DRAFT_TOKENS = 3
TEMP = 1.0
KEY_SEED = 11
# Rank r seeds mx.random with NO_KEY_SEED + r, so the ranks' global states differ: the case
# without a key agrees only if the group takes rank 0's draw.
NO_KEY_SEED = 100

# How each drafter is passed to speculative_generate_step, given the setting's models.
DRAFTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "model": lambda models: {"draft_model": models["draft"]},
    "lookup": lambda models: {"drafter": "prompt-lookup"},
}

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "tie_word_embeddings": False,
}
QWEN3_NEXT = {
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
    "moe_intermediate_size": 64,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 512,
    "head_dim": 16,
    "full_attention_interval": 2,
}


def tiny(module: ModuleType, seed: int, layers: int, scale: bool = True, **extra: Any) -> nn.Module:
    """A float32 model of ``module``'s class with weights drawn from ``seed``.

    With ``scale``, layer 0's matrices are scaled by 3, later layers' by 1.5 and the output layer
    by 8, so that the distributions are peaked and greedy text varies (as a trained model's).
    """
    name = module.__name__.rsplit(".", 1)[-1]
    args = module.ModelArgs(model_type=name, num_hidden_layers=layers, **TINY, **extra)
    mx.random.seed(seed)
    model = module.Model(args)

    def scaled(path: str, w: mx.array) -> mx.array:
        parts = path.split(".")
        if parts[:2] == ["model", "layers"] and "norm" not in path:
            return w * (3.0 if parts[2] == "0" else 1.5)
        return w * 8.0 if parts[0] == "lm_head" else w

    if scale:
        model.update(tree_map_with_path(scaled, model.parameters()))
    mx.eval(model.parameters())
    return model


def first_layers(model: nn.Module, layers: int) -> nn.Module:
    """A model of ``model``'s class keeping its first ``layers`` layers and all else."""
    cut = type(model)(dataclasses.replace(model.args, num_hidden_layers=layers))
    cut.load_weights(
        [
            (k, v)
            for k, v in tree_flatten(model.parameters())
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
        ]
    )
    mx.eval(cut.parameters())
    return cut


def demo_models(group: mx.distributed.Group | None, out: Path | None = None) -> dict[str, Any]:
    """The demo pair, the target split over ``group`` (unsplit for ``None``).

    The target is cast to float32 (exactly): split and summed in bfloat16, its log-probabilities
    move by up to about 0.1, enough to flip a near tie; in float32 by about 1e-5.
    """
    from mlx_lm import load

    if group is None:
        target, tokenizer = load(str(DEMO / "target"))
    else:
        target, tokenizer = load_sharded(DEMO / "target", group)
    target.set_dtype(mx.float32)
    draft, _ = load(str(DEMO / "draft"))
    prompt = mx.array(tokenizer.encode(DEMO_PROMPT))
    return {"target": target, "draft": draft, "prompt": prompt, "max_tokens": DEMO_TOKENS}


def save_qwen2(folder: Path) -> None:
    """The tiny qwen2 target as an mlx-lm model folder (with the demo's tokenizer files), for
    ``sharded_load``; the test process writes it before the launch."""
    from mlx_lm.utils import save_config, save_model

    model = tiny(qwen2, 0, 2)
    save_model(folder, model)
    save_config(dataclasses.asdict(model.args), folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / "target" / name, folder / name)


def tiny_models(
    target_kind: str, group: mx.distributed.Group | None, folder: Path | None = None
) -> dict[str, Any]:
    """The tiny qwen2 or qwen3_next target as a pipeline over ``group`` (whole for ``None``),
    and the first layer of the qwen2 target as draft. With ``folder`` (from :func:`save_qwen2`),
    the qwen2 target is loaded from it with ``load_sharded(..., pipeline=True)``."""
    qwen = tiny(qwen2, 0, 2)
    draft = first_layers(qwen, 1)
    if target_kind == "qwen3_next":
        target = tiny(qwen3_next, 1, 4, scale=False, **QWEN3_NEXT)
    elif folder is not None and group is not None:
        target, _ = load_sharded(folder, group, pipeline=True)
    else:
        target = qwen
    if group is not None and folder is None:
        target.model.pipeline(group)
    return {
        "target": target,
        "draft": draft,
        "prompt": mx.array(TINY_PROMPT),
        "max_tokens": TINY_TOKENS,
    }


# Setting -> its models, given the group (``None``: one process, the target whole) and the
# launch's folder.
SETTINGS: dict[str, Callable[[mx.distributed.Group | None, Path | None], dict[str, Any]]] = {
    "tensor": demo_models,
    "pipeline": lambda group, out: tiny_models("qwen2", group, out / QWEN2_FOLDER if out else None),
    "hybrid": lambda group, out: tiny_models("qwen3_next", group),
}


def generate(models: dict[str, Any], drafter: str, **kwargs: Any) -> list[int]:
    """The tokens of one speculative generation of the setting's length, of its prompt and
    :data:`NUM_DRAFT_TOKENS` a round unless ``kwargs`` say otherwise (``prompt`` too)."""
    arguments = {
        "num_draft_tokens": NUM_DRAFT_TOKENS,
        "max_tokens": models["max_tokens"],
        **DRAFTERS[drafter](models),
        **kwargs,
    }
    prompt = arguments.pop("prompt", models["prompt"])
    steps = speculative_generate_step(prompt, models["target"], **arguments)
    return [token for token, _, _ in steps]


def parameter_count(model: nn.Module) -> int:
    """How many weights ``model`` holds on this rank."""
    return sum(v.size for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array))


def plain(models: dict[str, Any]) -> list[int]:
    """mlx-lm's plain greedy decoding of the setting's length."""
    steps = generate_step(models["prompt"], models["target"], max_tokens=models["max_tokens"])
    return [token for token, _ in steps]


def outcome(models: dict[str, Any], drafter: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`generate`'s tokens, or the ``ValueError`` it raised."""
    try:
        return {"tokens": generate(models, drafter, **kwargs)}
    except ValueError as error:
        return {"error": str(error)}


def differing(
    models: dict[str, Any], other: bool, sampler: Any, key: mx.array
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Cases whose ranks differ in one argument that shapes the rounds: each case's drafter and
    arguments, on rank 1 (``other``) or on the others. Greedy but where the rule differs."""
    prompt = models["prompt"]
    return {
        # The case: rank 0 returned a wrong last token, its target calls out of step.
        "max_tokens": ("model", {"max_tokens": 24 if other else 10}),
        "num_draft_tokens": ("model", {"num_draft_tokens": 5 if other else NUM_DRAFT_TOKENS}),
        "drafter": ("lookup" if other else "model", {}),
        "prompt": ("model", {"prompt": mx.concatenate([prompt, prompt[:1]]) if other else prompt}),
        "policy": ("model", {"adaptive": other}),
        "acceptance": ("model", {"sampler": sampler if other else None, "key": key}),
    }


def run_cases(models: dict[str, Any], rank: int) -> dict[str, Any]:
    """Every case of a setting on this rank; the ranks run them in the same order.

    The calls with keys, or arguments that shape the rounds, that differ come first: the
    generations after them show that a rejected call leaves no collective pending. Each case is
    announced on stdout, so that the output of a launch that hangs shows where.
    """
    sampler = make_sampler(temp=TEMP)
    key = mx.random.key(KEY_SEED)
    results: dict[str, Any] = {}

    def run(name: str, drafter: str, **kwargs: Any) -> None:
        print(f"rank {rank}: {name}", flush=True)
        results[name] = outcome(models, drafter, **kwargs)

    run("keys-differ", "model", sampler=sampler, key=mx.random.key(rank))
    run("key-on-rank-0-only", "model", sampler=sampler, key=key if rank == 0 else None)
    # Arguments that shape the rounds, differing between the ranks (rank 1 has the other).
    other = rank == 1
    for name, (drafter, kwargs) in differing(models, other, sampler, key).items():
        run(f"differ/{name}", drafter, **kwargs)
    # mlx-lm's plain decoding leaves its next step, and its collectives, in flight: the key's
    # agreement in the next case must still pair with the same collective on each rank.
    print(f"rank {rank}: plain", flush=True)
    results["plain"] = {"tokens": plain(models)}
    for drafter in DRAFTERS:
        run(f"sampled/{drafter}", drafter, sampler=sampler, key=key)
        mx.random.seed(NO_KEY_SEED + rank)
        run(f"no-key/{drafter}", drafter, sampler=sampler)
        run(f"greedy/{drafter}", drafter)
    return results


def uncaught(group: mx.distributed.Group, out: Path) -> None:
    """Keys that differ, not caught: every rank notes the error it raises, then exits with it."""
    models = tiny_models("qwen2", group)
    try:
        generate(models, "model", sampler=make_sampler(temp=TEMP), key=mx.random.key(group.rank()))
    except ValueError as error:
        (out / f"uncaught-rank{group.rank()}.txt").write_text(str(error))
        raise
    (out / f"uncaught-rank{group.rank()}-finished.txt").write_text("")


def die(group: mx.distributed.Group, out: Path) -> None:
    """Rank 1 exits in the middle of a generation, as a crashed process does; a rank that gets to
    the end of the generation notes it."""
    models = tiny_models("qwen2", group)
    steps = speculative_generate_step(models["prompt"], models["target"], models["draft"])
    for i, _ in enumerate(steps):
        if group.rank() == 1 and i == 4:
            (out / "die-rank1.txt").write_text("")
            os._exit(3)
    (out / f"die-rank{group.rank()}-finished.txt").write_text("")


# Settings that end the launch early, for the tests of what a failing rank does.
ENDINGS: dict[str, Callable[[mx.distributed.Group, Path], None]] = {
    "uncaught": uncaught,
    "die": die,
}


def main(argv: list[str]) -> None:
    out, settings = Path(argv[1]), argv[2:]
    group = mx.distributed.init(strict=True, backend="ring")
    rank = group.rank()
    for setting in settings:
        if setting in ENDINGS:
            ENDINGS[setting](group, out)
            continue
        models = SETTINGS[setting](group, out)
        found = model_group(models["target"], models["draft"])
        results = {
            "size": group.size(),
            "model_group_size": found.size() if found is not None else None,
            "draft_group": model_group(models["draft"]) is not None,
            "fresh_seed": fresh_seed(group),
            "parameters": parameter_count(models["target"]),
            "cases": run_cases(models, rank),
        }
        (out / f"{setting}-rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv)
