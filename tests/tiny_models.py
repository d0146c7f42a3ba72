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
- :func:`tiny_mtp_pair`: a Qwen3-Next, Qwen3.5 (dense or mixture of experts), DeepSeek-V3 or
  GLM-4.5 model and an MTP head for it; :func:`save_hf_folder` writes them as their original
  Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models import (
    deepseek_v3,
    gemma3_text,
    glm4_moe,
    lfm2,
    llama,
    qwen2,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
)


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


# -- models with multi-token prediction (MTP) layers, and their Hugging Face checkpoints ----------


def tiny_qwen3_next_moe(seed: int, *, vocab: int = 4096, layers: int = 4, experts: int = 4):
    """A qwen3-next hybrid whose layers are all mixtures of ``experts`` experts (two a token) with
    a shared expert, as Qwen3-Next's are: mlx-lm's sanitize recognizes a Hugging Face checkpoint
    of it by its unstacked experts. Every second layer is full attention."""
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=4096,
        head_dim=16,
        full_attention_interval=2,
        norm_topk_prob=True,
    )
    mx.random.seed(seed)
    return _scaled(qwen3_next.Model(args), lambda i: 1.0 if i < 2 else 0.5, 4.0)


def tiny_qwen3_5_moe(seed: int, *, vocab: int = 4096, layers: int = 4, experts: int = 4):
    """A Qwen3.5 / 3.6 mixture of experts (``qwen3_5_moe``, as Qwen3.6-35B-A3B): gated delta-net
    layers and, every second layer, full attention; each layer a mixture of ``experts`` experts
    (two a token) with a shared expert. Its checkpoint fuses each layer's experts."""
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "head_dim": 16,
        "vocab_size": vocab,
        "full_attention_interval": 2,
        "max_position_embeddings": 4096,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    }
    mx.random.seed(seed)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs(model_type="qwen3_5_moe", text_config=text))
    return _scaled(model, lambda i: 1.0 if i < 2 else 0.5, 4.0)


def tiny_deepseek_v3(seed: int, *, vocab: int = 4096, layers: int = 3, experts: int = 4):
    """A DeepSeek-V3: multi-head latent attention (low-rank queries and keys), a dense first
    layer and mixtures of ``experts`` experts (two a token, sigmoid routing) with a shared
    expert after it."""
    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=experts,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
    )
    mx.random.seed(seed)
    model = deepseek_v3.Model(args)
    _route(model)
    return _scaled(model, lambda i: 1.0 if i < 2 else 0.5, 4.0)


def tiny_glm4_moe(seed: int, *, vocab: int = 4096, layers: int = 3, experts: int = 4):
    """A GLM-4.5 style model: attention with biases and query / key norms, a dense first layer
    and mixtures of ``experts`` experts (two a token) with a shared expert after it."""
    args = glm4_moe.ModelArgs(
        model_type="glm4_moe",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=4096,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        num_attention_heads=4,
        n_group=1,
        head_dim=16,
        topk_group=1,
        n_shared_experts=1,
        n_routed_experts=experts,
        routed_scaling_factor=1.0,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_hidden_layers=layers,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        use_qk_norm=True,
        tie_word_embeddings=False,
        attention_bias=True,
        partial_rotary_factor=0.5,
    )
    mx.random.seed(seed)
    model = glm4_moe.Model(args)
    _route(model)
    return _scaled(model, lambda i: 1.0 if i < 2 else 0.5, 4.0)


def _route(module: nn.Module) -> None:
    """Draws the routers of DeepSeek-style mixtures (initialized to zeros: every expert alike)."""
    module.update(
        tree_map_with_path(
            lambda path, w: mx.random.normal(w.shape) if ".gate." in f"{path}." else w,
            module.parameters(),
        )
    )


def randomize_norms(module: nn.Module, seed: int) -> None:
    """Sets every norm weight of ``module`` to ``1 + k / 64`` for random integers ``|k| <= 16``:
    exact in bfloat16 and float32 with and without the zero-centred checkpoints' ``- 1``, and
    far enough from 1 that a shift applied twice, or not at all, shows."""
    mx.random.seed(seed)

    def draw(path: str, w: mx.array) -> mx.array:
        if any("norm" in part for part in path.split(".")[:-1]) and w.ndim == 1:
            return 1 + mx.random.randint(-16, 17, w.shape).astype(w.dtype) / 64
        return w

    module.update(tree_map_with_path(draw, module.parameters()))
    mx.eval(module.parameters())


FP8_SCALE = 2.0**-7
"""The block scale of :func:`round_to_fp8`: FP8 (e4m3, at most 448) then holds weights up to 3.5."""


def round_to_fp8(module: nn.Module) -> None:
    """Rounds ``module``'s projection matrices to FP8 (e4m3) times :data:`FP8_SCALE`, so that
    an FP8 checkpoint of them dequantizes to exactly these weights."""

    def rounded(path: str, w: mx.array) -> mx.array:
        if path.endswith(("proj.weight", "embed_q.weight", "unembed_out.weight")):
            return (mx.from_fp8(mx.to_fp8(w / FP8_SCALE), dtype=mx.float32) * FP8_SCALE).astype(
                w.dtype
            )
        return w

    module.update(tree_map_with_path(rounded, module.parameters()))
    mx.eval(module.parameters())


_SHIFTED = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
"""The norms mlx-lm's Qwen3-Next / Qwen3.5 sanitize shifts by 1."""


def _unsanitized(family: str, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """``weights`` (main-model names, as mlx-lm keeps them) as the original checkpoint stores
    them: zero-centred norms and conv1d in Hugging Face's shape for the Qwen families, experts
    one by one, DeepSeek's ``kv_b_proj`` whole, Qwen3.5's keys under ``model.language_model``."""
    out = {}
    for original, w in weights.items():
        key = original
        if family.startswith("qwen"):
            if key.endswith(_SHIFTED) and w.ndim == 1:
                w = w - 1
            if key.endswith("conv1d.weight"):
                w = w.moveaxis(2, 1)
        if family.startswith("qwen3_5"):
            key = key.replace("language_model.model.", "model.language_model.")
            key = key.replace("language_model.lm_head.", "lm_head.")
        if family == "qwen3_5_moe" and ".switch_mlp." in key:
            if key.endswith("gate_proj.weight"):
                up = weights[original.replace("gate_proj", "up_proj")]
                fused = mx.concatenate([w, up], axis=-2)
                out[key.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj")] = fused
            elif key.endswith("down_proj.weight"):
                out[key.replace("switch_mlp.down_proj.weight", "experts.down_proj")] = w
            continue
        if ".switch_mlp." in key:
            for e in range(w.shape[0]):
                out[key.replace(".switch_mlp.", f".experts.{e}.")] = w[e]
            continue
        if key.endswith("self_attn.embed_q.weight"):
            wv = weights[key.replace("embed_q", "unembed_out")]
            kv = mx.concatenate([w.swapaxes(-1, -2), wv], axis=1)
            out[key.replace("embed_q", "kv_b_proj")] = kv.reshape(-1, kv.shape[-1])
            continue
        if key.endswith("self_attn.unembed_out.weight"):
            continue
        out[key] = w
    return out


def _family(model: nn.Module) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def hf_checkpoint(
    model: nn.Module, head: nn.Module | None = None, *, fp8: bool = False
) -> dict[str, mx.array]:
    """``model`` and its MTP ``head`` (a :class:`mlx_spec.mtp.MTPHead`) as the family's original
    Hugging Face checkpoint names and stores them (see :func:`_unsanitized`): the MTP layers as
    ``mtp.*`` with zero-centred norms (Qwen), or at ``model.layers.{num_hidden_layers + i}`` with
    copies of ``embed_tokens`` and the LM head as ``shared_head.head`` (DeepSeek, GLM). ``fp8``
    stores the projection matrices in FP8 with a ``weight_scale_inv`` per 128 x 128 block, as
    DeepSeek-V3's checkpoint does (round the weights with :func:`round_to_fp8` first)."""
    out = _hf_checkpoint(model, head)
    if fp8:
        for key in [k for k, w in out.items() if w.ndim == 2 and k.endswith("proj.weight")]:
            w = out[key]
            out[key] = mx.to_fp8(w / FP8_SCALE)
            blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
            out[key.replace("weight", "weight_scale_inv")] = mx.full(blocks, FP8_SCALE)
    return out


def _hf_checkpoint(model: nn.Module, head: nn.Module | None) -> dict[str, mx.array]:
    family = _family(model)
    main = dict(tree_flatten(model.parameters()))
    out = _unsanitized(family, main)
    if head is None:
        return out
    own = dict(tree_flatten(head.parameters()))
    blocks = {k: w for k, w in own.items() if k.startswith("layers.")}
    if head.layout == "qwen":
        for key, w in _unsanitized(family, {f"model.{k}": w for k, w in blocks.items()}).items():
            out[f"mtp.{key.removeprefix('model.')}"] = w
        out["mtp.fc.weight"] = own["projections.0.weight"]
        for ours, theirs in (
            ("embed_norms", "pre_fc_norm_embedding"),
            ("hidden_norms", "pre_fc_norm_hidden"),
            ("norms", "norm"),
        ):
            out[f"mtp.{theirs}.weight"] = own[f"{ours}.0.weight"] - 1
        return out
    first = model.args.num_hidden_layers
    theirs = {"embed_norms": "enorm", "hidden_norms": "hnorm", "projections": "eh_proj"}
    theirs["norms"] = "shared_head.norm"
    renamed = {}
    for key, w in own.items():
        kind, depth, rest = key.split(".", 2)
        name = rest if kind == "layers" else f"{theirs[kind]}.{rest}"
        renamed[f"model.layers.{first + int(depth)}.{name}"] = w
    out.update(_unsanitized(family, renamed))
    for depth in range(len(head.layers)):
        layer = f"model.layers.{first + depth}"
        out[f"{layer}.embed_tokens.weight"] = main["model.embed_tokens.weight"]
        out[f"{layer}.shared_head.head.weight"] = main["lm_head.weight"]
    return out


def save_hf_folder(
    folder: Path,
    model: nn.Module,
    head: nn.Module | None,
    tokenizer_from: Path,
    *,
    fp8: bool = False,
    dtype: str = "float32",
) -> None:
    """Writes ``model`` and its MTP ``head`` as the family's original Hugging Face checkpoint
    (:func:`hf_checkpoint`) in two safetensors shards and their ``model.safetensors.index.json``,
    with a ``config.json`` that counts the MTP layers as the family does and the tokenizer files
    of ``tokenizer_from``; ``fp8`` as :func:`hf_checkpoint` takes it, with the
    ``quantization_config`` of DeepSeek-V3's checkpoint, and ``dtype`` its ``torch_dtype``."""
    import json

    folder.mkdir(parents=True)
    weights = hf_checkpoint(model, head, fp8=fp8)
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, keys in halves.items():
        mx.save_safetensors(str(folder / file), {k: weights[k] for k in keys})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = dataclasses.asdict(model.args)
    count = len(head.layers) if head is not None else 0
    if _family(model).startswith("qwen3_5"):
        config["text_config"] = {**config["text_config"], "mtp_num_hidden_layers": count}
    elif head is None or head.layout == "qwen":
        config["mtp_num_hidden_layers"] = count
    else:
        config["num_nextn_predict_layers"] = count
    config["torch_dtype"] = dtype
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)


MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "glm4_moe")
"""The families whose MTP layers :func:`tiny_mtp_pair` builds."""


def tiny_mtp_pair(family: str, seed: int = 0, *, layers: int | None = None):
    """A tiny ``family`` model (one of :data:`MTP_FAMILIES`) and an MTP head for it
    (:class:`mlx_spec.mtp.MTPHead`, one layer) that agrees with it on about half the draft tokens.

    The model's layers are scaled down, so that its next token depends mostly on the current one;
    the head's projection passes the next token's embedding (and drops the hidden state), and its
    layer's matrices are small, so that it predicts what the model predicts after that token.
    Every norm of the head is drawn by :func:`randomize_norms`; DeepSeek-V3's projections are
    rounded to FP8 (:func:`round_to_fp8`), as its checkpoint stores them. ``layers`` overrides
    the model's layer count.
    """
    from mlx_spec.mtp import new_head

    build = {
        "qwen3_next": tiny_qwen3_next_moe,
        "qwen3_5": lambda s, **kw: tiny_qwen3_5(s, vocab=4096, **kw),
        "qwen3_5_moe": tiny_qwen3_5_moe,
        "deepseek_v3": tiny_deepseek_v3,
        "glm4_moe": tiny_glm4_moe,
    }[family]
    model = build(seed, **({} if layers is None else {"layers": layers}))

    def weaken(module: nn.Module, by: float) -> None:
        module.update(
            tree_map_with_path(
                lambda p, w: w * by if ".layers." in f".{p}" and "norm" not in p else w,
                module.parameters(),
            )
        )

    weaken(model, 0.35)
    mx.random.seed(seed + 1)
    head = new_head(model, "deepseek" if family in ("deepseek_v3", "glm4_moe") else "qwen")
    weaken(head, 0.05)
    hidden = head.projections[0].weight.shape[0]
    for projection in head.projections:
        projection.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    randomize_norms(head, seed + 2)
    if family == "deepseek_v3":
        round_to_fp8(model)
        round_to_fp8(head)
    mx.eval(model.parameters(), head.parameters())
    return model, head
