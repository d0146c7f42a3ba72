"""Tiny mlx-lm models with fixed random weights, built here (nothing is downloaded).

Each builder makes a real mlx-lm model class with float32 weights drawn from a seed and scaled so
that its text is varied and its distributions peaked, as a trained model's are. Layers after the
first two weigh ``late`` times as much as those, so :func:`cut` to two layers makes a draft that
agrees with the model on most tokens. The llama, qwen3-next and LFM2 builders also take a width,
for the larger random models of ``benchmarks/generation.py``.

- :func:`tiny_llama`: attention only (``KVCache``).
- :func:`tiny_qwen2`: attention only, without a ``make_cache`` of its own.
- :func:`tiny_qwen3_next`: a hybrid of gated delta-net layers (``ArraysCache``) and attention.
- :func:`tiny_qwen3_5`: Qwen3.5's hybrid of gated delta-net layers and attention.
- :func:`tiny_lfm2`: a hybrid of short convolutions (``ArraysCache``) and attention.
- :func:`tiny_gemma3`: sliding-window attention (``RotatingKVCache``) and global attention.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models import gemma3_text, lfm2, llama, qwen2, qwen3_5, qwen3_next


def _scaled(model: nn.Module, layer_scale: Callable[[int], float], head: float) -> nn.Module:
    """Scales layer ``i``'s matrices by ``layer_scale(i)`` and the output layer by ``head``."""

    def scale(path: str, w: mx.array) -> mx.array:
        parts = path.split(".")
        if "layers" in parts and "norm" not in path:
            return w * layer_scale(int(parts[parts.index("layers") + 1]))
        return w * head if parts[0] == "lm_head" else w

    model.update(tree_map_with_path(scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_llama(
    seed: int,
    *,
    vocab: int = 256,
    layers: int = 2,
    scales: tuple[float, ...] = (3.0, 1.5),
    head: float = 8.0,
    heads: int = 4,
    hidden: int = 64,
    intermediate: int = 128,
) -> llama.Model:
    """A llama whose layer ``i``'s matrices are scaled by ``scales[i]`` and whose (untied) output
    layer is scaled by ``head``; ``heads`` attention heads over ``hidden`` dimensions."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    return _scaled(llama.Model(args), lambda i: scales[i], head)


def tiny_qwen2(seed: int, *, vocab: int = 256, layers: int = 2, head: float = 8.0) -> qwen2.Model:
    """A qwen2, whose class has no ``make_cache``: mlx-lm's ``max_kv_size`` gives it rotating
    caches that keep the first 4 tokens. Two heads of 32: cache quantization groups 32 values."""
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    return _scaled(qwen2.Model(args), lambda i: 3.0 if i == 0 else 1.0, head)


def tiny_qwen3_next(
    seed: int,
    *,
    vocab: int = 256,
    layers: int = 4,
    head: float = 4.0,
    late: float = 0.5,
    early: float = 1.0,
    hidden: int = 64,
):
    """A qwen3-next hybrid: gated delta-net layers, every second layer full attention. The first
    two layers' matrices are scaled by ``early``, the later ones' by ``late``, the output layer by
    ``head``; four heads (two key heads in the delta-net layers) of ``hidden // 4`` dimensions."""
    width = hidden // 4
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=width,
        linear_value_head_dim=width,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=list(range(layers)),
        moe_intermediate_size=0,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=4096,
        head_dim=width,
        full_attention_interval=2,
    )
    mx.random.seed(seed)
    return _scaled(qwen3_next.Model(args), lambda i: early if i < 2 else late, head)


def tiny_qwen3_5(seed: int, *, vocab: int = 256, layers: int = 4, head: float = 4.0):
    """A Qwen3.5 text model: gated delta-net layers, every second layer full attention; the later
    layers weigh half as much as the first two."""
    width = 16
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": width,
        "linear_value_head_dim": width,
        "head_dim": width,
        "vocab_size": vocab,
        "full_attention_interval": 2,
        "max_position_embeddings": 4096,
    }
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    return _scaled(model, lambda i: 1.0 if i < 2 else 0.5, head)


def tiny_lfm2(
    seed: int,
    *,
    vocab: int = 256,
    layers: int = 4,
    head: float = 4.0,
    late: float = 0.5,
    hidden: int = 64,
):
    """An LFM2 hybrid: short-convolution layers, every second layer full attention; four heads
    over ``hidden`` dimensions, an MLP twice as wide."""
    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=hidden,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        intermediate_size=2 * hidden,
        layer_types=["conv", "full_attention"] * (layers // 2),
    )
    mx.random.seed(seed)
    return _scaled(lfm2.Model(args), lambda i: 2.0 if i < 2 else 2.0 * late, head)


def tiny_gemma3(
    seed: int,
    *,
    vocab: int = 256,
    layers: int = 4,
    window: int = 8,
    head: float = 1.0,
    late: float = 0.3,
):
    """A gemma3 text model: sliding-window layers of ``window`` tokens (``RotatingKVCache``),
    every second layer global attention. Its blocks end in norms, so the later layers are
    weighed through those norms' scales."""
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=2,
        sliding_window=window,
        sliding_window_pattern=2,
    )
    mx.random.seed(seed)
    model = _scaled(gemma3_text.Model(args), lambda i: 1.0, head)
    for layer in model.model.layers[2:]:
        # Gemma's norms scale by 1 + weight (2 at initialisation).
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight = mx.full(norm.weight.shape, 2 * late - 1)
    mx.eval(model.parameters())
    return model


def cut(model: nn.Module, layers: int) -> nn.Module:
    """``model`` with its first ``layers`` layers (and its embeddings and output layer)."""
    if isinstance(model, qwen3_5.Model):
        text = {**model.args.text_config, "num_hidden_layers": layers}
        args = dataclasses.replace(model.args, text_config=text)
    else:
        args = dataclasses.replace(model.args, num_hidden_layers=layers)
    if hasattr(args, "layer_types") and args.layer_types is not None:
        args.layer_types = args.layer_types[:layers]
    if isinstance(model, lfm2.Model):
        args.full_attn_idxs = None
        args.__post_init__()
    small = type(model)(args)
    small.load_weights(
        [
            (k, v)
            for k, v in tree_flatten(model.parameters())
            if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers
        ]
    )
    mx.eval(small.parameters())
    return small


def save_model_folder(model: nn.Module, folder: Path, tokenizer_from: Path) -> None:
    """Writes ``model`` as an mlx-lm model folder, with the tokenizer files of ``tokenizer_from``
    (a model folder whose tokenizer has at most the model's vocabulary)."""
    from mlx_lm.utils import save_config, save_model

    save_model(folder, model)
    save_config(dataclasses.asdict(model.args), folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
