"""MTP heads from the files users have: the original checkpoint's MTP layers, prepared as mlx-lm
prepares the main model, quantized like the target and saved beside it; and loading a model with
its head.

mlx-lm's ``sanitize`` drops the MTP layers of Qwen3-Next, Qwen3.5 / 3.6, DeepSeek-V3 and GLM-4.5,
and the mlx-community conversions lack them. The original Hugging Face checkpoint has them:

- Qwen3-Next and Qwen3.5 / 3.6 (``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``): ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.{i}.*`` and
  ``mtp.norm`` (under a prefix in some uploads, ``model.language_model.mtp.*`` say), counted by
  the config's ``mtp_num_hidden_layers`` (in ``text_config`` for Qwen3.5). Their norms are stored
  zero-centred, like the main model's.
- DeepSeek-V3 and GLM-4.5 (``deepseek_v3``, ``glm4_moe``): the layers at
  ``model.layers.{num_hidden_layers + i}``: ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm`` and a decoder layer's own weights, counted by ``num_nextn_predict_layers``
  (their ``embed_tokens`` and ``shared_head.head`` are the target's, and are not read).

The MTP weights are prepared by the model class's own ``sanitize``, as the main model's are: each
MTP layer is put in the place of a main layer of the same kind (the last full-attention layer of a
Qwen hybrid, the last layer of a DeepSeek or GLM model), its shared norms in the places of a
layer's two norms and the final norm, among the rest of the checkpoint (read lazily: only the MTP
weights are ever read from disk), so that ``sanitize`` decides from the same checkpoint what it
decides for the main model, and the results are taken back. So the Qwen norms are shifted by 1
exactly once, and only where mlx-lm shifts the main model's; experts are stacked as mlx-lm stacks
them (``switch_mlp``); DeepSeek's FP8 weights are dequantized and its ``kv_b_proj`` split as
mlx-lm does. Qwen's ``mtp.fc`` is taken as stored: mlx-lm's Qwen sanitize changes no projection.
Experts that an upload keeps one by one where the family's sanitize stacks only fused ones (a
Qwen3.5 MoE MTP layer, say) are stacked as mlx-lm stacks experts.

:func:`convert_mtp` (the command ``mlx-spec convert-mtp HF_DIR MLX_DIR``) then casts the head to
the target's dtype and quantizes it as the target's ``config.json`` says (see
:func:`convert_mtp`), and writes it into the MLX folder as :data:`FILE` (:func:`save_head`, which
also saves a head of one's own). :func:`load` is ``mlx_lm.load`` plus the head, from that file or
from the MTP weights of a Hugging Face folder that holds the whole model; it attaches the head
(:func:`mlx_spec.mtp.attach`) for ``drafter="mtp"``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import _mlx_lm
from .mtp import Layout, MTPHead, attach, own_names

__all__ = ["FAMILIES", "FILE", "convert_mtp", "load", "save_head"]

#: The file :func:`convert_mtp` writes into an MLX model folder: the head's weights under its own
#: parameter names, with metadata (see :func:`convert_mtp`).
FILE = "mtp.safetensors"

#: The model types whose MTP layers are read, and their layouts (:data:`mlx_spec.mtp.LAYOUTS`).
FAMILIES: dict[str, Layout] = {
    "qwen3_next": "qwen",
    "qwen3_5": "qwen",
    "qwen3_5_moe": "qwen",
    "deepseek_v3": "deepseek",
    "glm4_moe": "deepseek",
}

_FORMAT = "mlx-spec-mtp"
_QWEN_KEY = re.compile(
    r"^(?:model\.language_model\.|language_model\.model\.|language_model\.|model\.)?mtp\."
)
_LAYER_KEY = re.compile(r"^(.*?layers\.)(\d+)\.(.+)$")
_SHARED = ("embed_tokens.", "shared_head.head.")

Progress = Callable[[int, int, str], None]
"""``on_progress(done, total, label)``: step ``done`` of ``total`` (from 1) is starting."""


# -- reading a checkpoint ---------------------------------------------------------------------


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (Qwen3.5 nests it in ``text_config``)."""
    return {**config, **config.get("text_config", {})}


def _files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, or ``model*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return sorted(folder.glob("model*.safetensors"))


def _is_mtp(key: str, layout: Layout, first: int) -> bool:
    """Whether ``key`` is an MTP weight to read (not a copy of the target's embedding or head)."""
    if layout == "qwen":
        return _QWEN_KEY.match(key) is not None
    match = re.match(r"model\.layers\.(\d+)\.(.+)", key)
    return match is not None and int(match[1]) >= first and not match[2].startswith(_SHARED)


def _read(
    folder: Path, layout: Layout, first: int, on_progress: Progress | None, steps: int
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """Every weight of the checkpoint in ``folder`` (lazy: nothing read yet), and its MTP weights
    (read from disk here, file by file: a progress step of ``len(files) + steps`` for each file
    that holds some)."""
    weights, files = {}, {}
    for file in _files(folder):
        arrays = mx.load(str(file))
        weights.update(arrays)
        mine = [key for key in arrays if _is_mtp(key, layout, first)]
        if mine:
            files[file.name] = mine
    mtp = {}
    for done, (name, keys) in enumerate(files.items(), start=1):
        if on_progress is not None:
            on_progress(done, len(files) + steps, f"reading {len(keys)} MTP weights from {name}")
        mx.eval([weights[key] for key in keys])
        mtp.update({key: weights[key] for key in keys})
    return weights, mtp


def _count(layout: Layout, config: dict[str, Any], mtp: dict[str, mx.array]) -> int:
    """The number of MTP layers: as the config counts them, else as the weights do."""
    text = _text(config)
    first = text["num_hidden_layers"]
    if layout == "qwen":
        found = {
            int(m[1]) for k in mtp if (m := re.match(r"layers\.(\d+)\.", _QWEN_KEY.sub("", k)))
        }
        counted = text.get("mtp_num_hidden_layers")
    else:
        found = {int(k.split(".")[2]) - first for k in mtp}
        counted = text.get("num_nextn_predict_layers")
    return len(found) if counted is None else min(counted, len(found))


# -- preparing the weights as mlx-lm prepares the main model's --------------------------------


def _layer_prefix(keys: Any, skip: Callable[[str], bool] = lambda key: False) -> str:
    """The most common prefix of numbered layers among ``keys`` (``model.layers.``, say)."""
    found = Counter(m[1] for key in keys if not skip(key) and (m := _LAYER_KEY.match(key)))
    if not found:
        raise ValueError("no numbered layers among the weights")
    return found.most_common(1)[0][0]


def _slot(text: dict[str, Any], layout: Layout) -> int:
    """The main layer whose place each MTP layer takes in ``sanitize``: one of its kind (the last
    full-attention layer of a Qwen hybrid; the last layer of a DeepSeek or GLM model)."""
    layers = text["num_hidden_layers"]
    if layout == "deepseek":
        return layers - 1
    interval = text.get("full_attention_interval", 4)
    full = [i for i in range(layers) if (i + 1) % interval == 0]
    if not full:
        raise ValueError(f"no full-attention layer among {layers} (one in {interval})")
    return full[-1]


def _sanitized(
    model: nn.Module,
    weights: dict[str, mx.array],
    drop: Callable[[str], bool],
    placed: dict[str, mx.array],
    taken: dict[str, str],
) -> dict[str, mx.array]:
    """``model.sanitize`` of the checkpoint ``weights`` with the keys ``drop`` names replaced by
    ``placed``; returns the results whose names start with a key of ``taken``, renamed to start
    with its value instead."""
    given = {k: w for k, w in weights.items() if not drop(k)}
    given.update(placed)
    out = {}
    for key, value in model.sanitize(given).items():
        for theirs, ours in taken.items():
            if key.startswith(theirs):
                out[ours + key[len(theirs) :]] = value
    return out


def _own_layer_prefix(model: nn.Module) -> str:
    """Where ``model`` keeps its layers, in its own parameter names (``model.layers.``)."""
    return _layer_prefix(k for k, _ in tree_flatten(model.parameters()))


def _prepare(
    model: nn.Module,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    mtp: dict[str, mx.array],
    layers: int,
) -> dict[str, mx.array]:
    """The MTP weights ``mtp`` (the checkpoint's names) prepared by ``model.sanitize`` (see the
    module's description), under the head's own names."""
    layout = FAMILIES[config["model_type"]]
    text = _text(config)
    first, slot = text["num_hidden_layers"], _slot(text, layout)
    theirs = _layer_prefix(weights, lambda key: key in mtp or _is_mtp(key, layout, first))
    ours = _own_layer_prefix(model)

    def main_layer(key: str) -> bool:
        return key.startswith(f"{theirs}{slot}.")

    if layout == "deepseek":

        def beyond(key: str) -> bool:  # the MTP layers, with their copies of the target's weights
            match = re.match(r"model\.layers\.(\d+)\.", key)
            return match is not None and int(match[1]) >= first

        prepared = {}
        for depth in range(layers):
            block = f"model.layers.{first + depth}."
            placed = {
                f"{theirs}{slot}.{k[len(block) :]}": w
                for k, w in mtp.items()
                if k.startswith(block)
            }
            prepared |= _sanitized(
                model,
                weights,
                lambda k: main_layer(k) or beyond(k),
                placed,
                {f"{ours}{slot}.": block},
            )
        return own_names(prepared, "deepseek", first)
    named = {_QWEN_KEY.sub("mtp.", k): w for k, w in mtp.items()}
    shared = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    missing = [f"mtp.{name}" for name in shared if f"mtp.{name}.weight" not in named]
    if missing:
        raise ValueError(f"no {', '.join(missing)} among them")
    prepared = {"mtp.fc.weight": named["mtp.fc.weight"]}
    for depth in range(layers):
        block = f"mtp.layers.{depth}."
        placed = {
            f"{theirs}{slot}.{k[len(block) :]}": w for k, w in named.items() if k.startswith(block)
        }
        prepared |= _sanitized(
            model,
            weights,
            lambda k: main_layer(k) or k in mtp,
            placed,
            {f"{ours}{slot}.": block},
        )
    # The shared norms in the places of a layer's two norms and of the final norm.
    final, own_final = f"{theirs.removesuffix('layers.')}norm.weight", _final_norm(model)
    norms = {
        f"{theirs}{slot}.input_layernorm.weight": named["mtp.pre_fc_norm_embedding.weight"],
        f"{theirs}{slot}.post_attention_layernorm.weight": named["mtp.pre_fc_norm_hidden.weight"],
        final: named["mtp.norm.weight"],
    }
    prepared |= _sanitized(
        model,
        weights,
        lambda k: main_layer(k) or k in mtp or k == final,
        norms,
        {
            f"{ours}{slot}.input_layernorm.weight": "mtp.pre_fc_norm_embedding.weight",
            f"{ours}{slot}.post_attention_layernorm.weight": "mtp.pre_fc_norm_hidden.weight",
            own_final: "mtp.norm.weight",
        },
    )
    return own_names(prepared, "qwen", first)


def _final_norm(model: nn.Module) -> str:
    """The name of ``model``'s final norm weight, in its own parameter names."""
    ours = _own_layer_prefix(model)
    return f"{ours.removesuffix('layers.')}norm.weight"


# -- the head ---------------------------------------------------------------------------------


def _empty_head(model: nn.Module, layout: Layout, layers: int) -> MTPHead:
    """An MTP head of ``layers`` layers of ``model``'s kind, its weights as initialized (unlike
    :func:`mlx_spec.mtp.new_head`, it does not run ``model``, which may be loaded lazily)."""
    text = getattr(model, "language_model", model)
    eps = getattr(text.args, "rms_norm_eps", 1e-6)
    blocks = [_mlx_lm.decoder_layer(model) for _ in range(layers)]
    return MTPHead(layout, blocks, text.args.hidden_size, eps)


def _main_path(path: str, layout: Layout, slot: int, own: str, first: int) -> str:
    """The name under which the target's ``config.json`` and ``quant_predicate`` know the head's
    module at ``path``: the slot layer's module for a decoder layer's, the checkpoint's name for
    the projection (``mtp.fc``, ``model.layers.{L}.eh_proj``)."""
    kind, depth, rest = [*path.split(".", 2), ""][:3]
    if kind == "layers":
        return f"{own}{slot}.{rest}".rstrip(".")
    if layout == "qwen":
        return "mtp.fc"
    return f"model.layers.{first + int(depth)}.eh_proj"


def _quantization(
    model: nn.Module, config: dict[str, Any], head: MTPHead
) -> dict[str, dict[str, Any]]:
    """How to quantize each module of ``head``, as mlx-lm quantized the target: the per-layer
    entry of ``config["quantization"]`` for the module's place in the target where there is one;
    else none when the module's input size is not a multiple of the group size or the model's
    ``quant_predicate`` refuses it; else the predicate's parameters, or the config's defaults."""
    quantization = config.get("quantization")
    if not quantization:
        return {}
    layout = head.layout
    text = _text(config)
    first, slot, own = text["num_hidden_layers"], _slot(text, layout), _own_layer_prefix(model)
    defaults = {
        "group_size": quantization.get("group_size", 64),
        "bits": quantization.get("bits", 4),
        "mode": quantization.get("mode", "affine"),
    }
    predicate = getattr(model, "quant_predicate", None)
    chosen = {}
    for path, module in head.named_modules():
        if not path or not hasattr(module, "to_quantized"):
            continue
        main = _main_path(path, layout, slot, own, first)
        params: Any = quantization.get(main, None)
        if params is None:
            if module.weight.shape[-1] % defaults["group_size"] != 0:
                continue
            params = predicate(main, module) if predicate is not None else True
        if params is True:
            params = defaults
        if isinstance(params, dict):
            chosen[path] = {**defaults, **params}
    return chosen


def _quantize(head: MTPHead, chosen: dict[str, dict[str, Any]]) -> None:
    if chosen:
        nn.quantize(head, class_predicate=lambda path, module: chosen.get(path, False))


def _dtype(model: nn.Module) -> mx.Dtype | None:
    """``model``'s dtype: the most common among its floating-point weights (``None``: none)."""
    floats = Counter(
        w.dtype for _, w in tree_flatten(model.parameters()) if mx.issubdtype(w.dtype, mx.floating)
    )
    return floats.most_common(1)[0][0] if floats else None


def _cast(head: MTPHead, model: nn.Module) -> None:
    """Casts ``head``'s floating-point weights to ``model``'s dtype (:func:`_dtype`), as
    ``mlx_lm.convert`` casts the target's (``cast_predicate`` permitting)."""
    dtype = _dtype(model)
    if dtype is None:
        return
    keep = getattr(model, "cast_predicate", lambda path: True)
    head.update(
        tree_unflatten(
            [
                (k, w.astype(dtype) if keep(k) and mx.issubdtype(w.dtype, mx.floating) else w)
                for k, w in tree_flatten(head.parameters())
            ]
        )
    )


def _stacked(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts that ``sanitize`` left one by one (``...experts.{e}.gate_proj.weight``: a Qwen3.5
    MoE upload that does not fuse them), stacked as mlx-lm stacks experts (``switch_mlp``)."""
    found: dict[str, dict[int, mx.array]] = {}
    out = {}
    for key, w in weights.items():
        match = re.match(r"(.*)\.experts\.(\d+)\.(\w+\.\w+)$", key)
        if match is None:
            out[key] = w
        else:
            found.setdefault(f"{match[1]}.switch_mlp.{match[3]}", {})[int(match[2])] = w
    for key, experts in found.items():
        out[key] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def _fill(op: str, head: MTPHead, weights: dict[str, mx.array], source: Path) -> None:
    """Loads ``weights`` (the head's own names) into ``head``; a ``ValueError`` says what does not
    fit."""
    try:
        head.load_weights(list(_stacked(weights).items()), strict=True)
    except ValueError as error:
        detail = " ".join(str(error).split())  # mlx lists the names, one a line
        raise ValueError(
            f"{op}: the MTP weights of {source} do not fit an MTP head of this model "
            f"({detail if len(detail) <= 300 else detail[:300] + '...'})"
        ) from None


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    """What two configs of one model share: its type and its text model's sizes."""
    text = _text(config)
    return {
        "model_type": config.get("model_type"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "num_hidden_layers": text.get("num_hidden_layers"),
    }


def _shown(identity: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in identity.items())


def _head_from_checkpoint(
    op: str,
    model: nn.Module,
    config: dict[str, Any],
    folder: Path,
    on_progress: Progress | None = None,
    steps: int = 0,
) -> MTPHead | None:
    """The MTP head in the original checkpoint in ``folder``, prepared for ``model`` (not yet cast
    nor quantized); ``None`` where it has no MTP weights. Reading a file counts as a step of
    ``on_progress``, ``steps`` more follow."""
    layout = FAMILIES[config["model_type"]]
    first = _text(config)["num_hidden_layers"]
    weights, mtp = _read(folder, layout, first, on_progress, steps)
    layers = _count(layout, config, mtp)
    if layers == 0:
        return None
    try:
        prepared = _prepare(model, config, weights, mtp, layers)
    except ValueError as error:
        raise ValueError(
            f"{op}: the MTP weights of {folder} cannot be prepared ({error})"
        ) from None
    head = _empty_head(model, layout, layers)
    _fill(op, head, prepared, folder)
    return head


def _no_mtp(op: str, folder: Path, config: dict[str, Any]) -> str:
    layout = FAMILIES[config["model_type"]]
    where = (
        "no mtp.* weights"
        if layout == "qwen"
        else f"no layer model.layers.{_text(config)['num_hidden_layers']}"
    )
    return (
        f"{op}: {folder} holds no MTP weights ({where}); mlx-community conversions and some "
        "uploads strip them: give the folder of the model's original Hugging Face checkpoint"
    )


# -- converting -------------------------------------------------------------------------------


def _folder(op: str, name: str, value: object) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise ValueError(f"{op}: `{name}` must be a folder path, got {type(value).__name__}")
    folder = Path(value).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{op}: `{name}` must be a model folder with a config.json, got {str(value)!r}"
            + ("" if folder.is_dir() else " (no such folder)")
        )
    return folder


def _ours(file: Path) -> dict[str, str] | None:
    """The metadata of ``file`` when :func:`convert_mtp` wrote it, else ``None``."""
    _, metadata = mx.load(str(file), return_metadata=True)
    return metadata if metadata.get("format") == _FORMAT else None


def convert_mtp(
    hf_dir: str | os.PathLike, mlx_dir: str | os.PathLike, *, on_progress: Progress | None = None
) -> Path:
    """Writes the MTP head of an original Hugging Face checkpoint into the MLX folder of the same
    model, as :data:`FILE`.

    The head's weights are read from ``hf_dir`` (safetensors shards named by their
    ``model.safetensors.index.json``, or ``model*.safetensors``; only the MTP weights are read)
    and prepared by the model class's own ``sanitize`` (see the module's description). They are
    then cast to the target's dtype, as ``mlx_lm.convert`` casts the target, and quantized as
    ``mlx_dir``'s ``config.json`` says: a decoder layer's module as the entry of
    ``"quantization"`` for the same module of the target's last layer of its kind (a per-layer
    override), else as the model's ``quant_predicate`` says for that module, else with the
    config's bits, group size and mode; the projection (``mtp.fc``, ``eh_proj``) likewise under
    its checkpoint name. Modules whose input size is not a multiple of the group size stay as
    they are, as mlx-lm leaves them. The head is written by :func:`save_head`; an earlier file of
    this function's is replaced.

    Args:
        hf_dir (str or PathLike): the original checkpoint's folder: ``config.json`` and
            safetensors weights, of a ``model_type`` in :data:`FAMILIES`.
        mlx_dir (str or PathLike): the MLX conversion of the same model (``mlx_lm.convert``, or an
            mlx-community folder), quantized or not.
        on_progress (callable, optional): ``on_progress(done, total, label)`` at the start of each
            step (reading each shard that holds MTP weights, preparing, writing). Default: none.

    Returns:
        Path: the file written, ``mlx_dir / FILE``.

    Raises:
        ValueError: a folder is missing or not a model folder; ``hf_dir``'s model type has no MTP
            head known here; the two folders are not the same model (type, hidden size,
            vocabulary or layer count; the message names both folders); ``hf_dir`` holds no MTP
            weights, or weights that do not fit the head; ``mlx_dir`` holds a :data:`FILE` that
            this function did not write.
    """
    op = "convert_mtp"
    hf = _folder(op, "hf_dir", hf_dir)
    mlx = _folder(op, "mlx_dir", mlx_dir)
    if on_progress is not None and not callable(on_progress):
        raise ValueError(f"{op}: `on_progress` must be callable, got {type(on_progress).__name__}")
    hf_config, mlx_config = _config(hf), _config(mlx)
    family = hf_config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"{op}: {hf} holds a {family} model; MTP heads are read for "
            f"{', '.join(FAMILIES)} models"
        )
    theirs, ours = _identity(hf_config), _identity(mlx_config)
    if theirs != ours:
        raise ValueError(
            f"{op}: {hf} ({_shown(theirs)}) and {mlx} ({_shown(ours)}) are not the same model; "
            "give the MLX conversion of this checkpoint"
        )
    files = _files(hf)
    if not files:
        raise ValueError(f"{op}: {hf} holds no safetensors weights; give the original checkpoint")
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise ValueError(
            f"{op}: {hf} lacks {len(missing)} of the {len(files)} files its index names "
            f"({missing[0]}, ...); download the whole checkpoint: mlx-lm's sanitize tells from "
            "the other weights how the MTP weights are stored (only the MTP weights are read)"
        )
    target = mlx / FILE
    if target.exists() and _ours(target) is None:
        raise ValueError(
            f"{op}: {target} was not written by mlx-spec; move it out of the folder and run again"
        )
    from mlx_lm.utils import load_model

    # Lazily: the target's weights are never read, only its class, config and structure.
    model, config = load_model(mlx, lazy=True)
    reports: list[tuple[int, int, str]] = []

    def progress(done: int, total: int, label: str) -> None:
        reports.append((done, total, label))
        if on_progress is not None:
            on_progress(done, total, label)

    head = _head_from_checkpoint(op, model, hf_config, hf, progress, steps=2)
    if head is None:
        raise ValueError(_no_mtp(op, hf, hf_config))
    steps = reports[-1][1] if reports else 2
    progress(steps - 1, steps, "preparing and quantizing the head")
    _cast(head, model)
    _quantize(head, _quantization(model, config, head))
    progress(steps, steps, f"writing {target}")
    return save_head(head, mlx)


def save_head(head: MTPHead, mlx_dir: str | os.PathLike) -> Path:
    """Writes ``head`` into the model folder ``mlx_dir`` as :data:`FILE`, which :func:`load`
    reads: its weights under their own names (:class:`mlx_spec.mtp.MTPHead`), and metadata: the
    layout, the layer count, the parameters of each quantized module (JSON), and the model's
    type and sizes from the folder's ``config.json`` (a head is loaded for that model only). For
    a head of one's own (one trained for a model, say); :func:`convert_mtp` writes a
    checkpoint's with it. A file of this function's is replaced.

    Args:
        head (MTPHead): the head, quantized or not, of the model in ``mlx_dir``.
        mlx_dir (str or PathLike): the model's folder (with its ``config.json``).

    Returns:
        Path: the file written, ``mlx_dir / FILE``.

    Raises:
        ValueError: ``head`` is not an :class:`~mlx_spec.mtp.MTPHead`; ``mlx_dir`` is not a model
            folder, or holds a :data:`FILE` that this function did not write.
    """
    op = "save_head"
    if not isinstance(head, MTPHead):
        raise ValueError(f"{op}: `head` must be an MTPHead, got {type(head).__name__}")
    folder = _folder(op, "mlx_dir", mlx_dir)
    target = folder / FILE
    if target.exists() and _ours(target) is None:
        raise ValueError(
            f"{op}: {target} was not written by mlx-spec; move it out of the folder and run again"
        )
    quantized = {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        for path, m in head.named_modules()
        if path and hasattr(m, "bits") and hasattr(m, "group_size")
    }
    metadata = {
        "format": _FORMAT,
        "layout": head.layout,
        "layers": str(len(head.layers)),
        "quantization": json.dumps(quantized, sort_keys=True),
        **{k: str(v) for k, v in _identity(_config(folder)).items()},
    }
    arrays = dict(tree_flatten(head.parameters()))
    for w in arrays.values():  # one at a time: a layer's experts dequantized at once at most
        mx.eval(w)
    partial = folder / f".{FILE}.partial.safetensors"
    mx.save_safetensors(str(partial), arrays, metadata=metadata)
    os.replace(partial, target)
    return target


# -- loading ----------------------------------------------------------------------------------


def _dequantize(head: MTPHead, dtype: mx.Dtype) -> None:
    """Replaces each quantized linear layer of ``head`` by a linear layer of its dequantized
    weights in ``dtype``."""
    plain = []
    for path, m in head.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            mode = getattr(m, "mode", "affine")
            weight = mx.dequantize(
                m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=mode
            ).astype(dtype)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            linear.weight = weight
            if "bias" in m:
                linear.bias = m.bias
            plain.append((path, linear))
    if plain:
        head.update_modules(tree_unflatten(plain))


def _head_from_file(model: nn.Module, config: dict[str, Any], file: Path) -> MTPHead | None:
    """The head :func:`convert_mtp` wrote into ``file``, for ``model``."""
    arrays, metadata = mx.load(str(file), return_metadata=True)
    if metadata.get("format") != _FORMAT:
        warnings.warn(
            f"load: {file} was not written by mlx-spec: the model is loaded without "
            f"an MTP head (move the file away, and run mlx-spec convert-mtp HF_DIR {file.parent})",
            stacklevel=3,
        )
        return None
    mine = {k: str(v) for k, v in _identity(config).items()}
    differ = [k for k in mine if metadata.get(k) != mine[k]]
    if differ:
        raise ValueError(
            f"load: {file} holds the MTP head of another model ({differ[0]} "
            f"{metadata.get(differ[0])}, the model's {mine[differ[0]]}); run mlx-spec "
            f"convert-mtp with this model's original checkpoint"
        )
    layout = metadata["layout"]
    head = _empty_head(model, layout, int(metadata["layers"]))
    quantization = json.loads(metadata["quantization"])
    _quantize(head, quantization)
    _fill("load", head, arrays, file)
    dtype = _dtype(model)
    if quantization and dtype is not None and not any(_is_quantized(m) for m in model.modules()):
        # Quantized to ship small: beside a target of floating-point layers it runs as they do
        # (MLX's CPU backend runs quantized layers far slower than floating-point ones).
        _dequantize(head, dtype)
    return head


def _is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "bits") and hasattr(module, "group_size")


def _has_mtp(folder: Path, config: dict[str, Any]) -> bool:
    """Whether the checkpoint in ``folder`` holds MTP weights (its index, or its files' names)."""
    layout = FAMILIES[config["model_type"]]
    first = _text(config)["num_hidden_layers"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        keys = json.loads(index.read_text())["weight_map"]
    else:
        keys = [k for file in _files(folder) for k in mx.load(str(file))]
    return any(_is_mtp(k, layout, first) for k in keys)


def _local(path_or_hf_repo: str, revision: str | None) -> Path | None:
    """The local folder of a model: the path, or the snapshot mlx-lm downloaded (with
    :data:`FILE` where the repository has one); ``None`` when it cannot be found."""
    path = Path(path_or_hf_repo).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(path_or_hf_repo, revision=revision, allow_patterns=[FILE, "*.json"])
        )
    except Exception as error:  # offline, say: the model was loaded; its head cannot be
        warnings.warn(f"load: no MTP head looked for ({error})", stacklevel=3)
        return None


def load(
    path_or_hf_repo: str | os.PathLike,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, ...]:
    """``mlx_lm.load``, plus the model's MTP head where its folder has one, attached with
    :func:`mlx_spec.mtp.attach` (``drafter="mtp"`` then drafts with it).

    The head comes from the folder's :data:`FILE` (an MLX folder after
    ``mlx-spec convert-mtp``), or, for a Hugging Face folder that holds the whole original
    checkpoint, from its MTP weights, prepared in memory as :func:`convert_mtp` prepares them
    (and, like the rest of the model, neither cast nor quantized). A quantized head beside a
    model with no quantized layer (one quantized only to be small on disk, as the demo target's
    is) is dequantized to the model's dtype, to run as the model's own layers do. A folder
    without either loads as mlx-lm loads it, with no head; a :data:`FILE` that another tool wrote
    is left aside with a warning.

    Args:
        path_or_hf_repo (str or PathLike): a local model folder, or a repository name mlx-lm
            downloads.
        tokenizer_config (dict, optional): as ``mlx_lm.load`` takes it.
        model_config (dict, optional): likewise.
        adapter_path (str, optional): likewise.
        lazy (bool): likewise; the head's weights too are then read when first used.
        return_config (bool): likewise.
        revision (str, optional): likewise.
        trust_remote_code (bool): likewise.

    Returns:
        tuple: ``(model, tokenizer)``, or ``(model, tokenizer, config)`` with ``return_config``,
        as ``mlx_lm.load`` returns them.

    Raises:
        ValueError: ``path_or_hf_repo`` is not a path or a name; the folder's :data:`FILE` was
            made for another model, or its weights do not fit the model; what ``mlx_lm.load``
            raises.
    """
    op = "load"
    if not isinstance(path_or_hf_repo, str | os.PathLike):
        raise ValueError(
            f"{op}: `path_or_hf_repo` must be a folder or a repository name, got "
            f"{type(path_or_hf_repo).__name__}"
        )
    # mlx-lm's own: patch_mlx_lm(mtp=True) puts this function in the place of mlx_lm.load.
    model, tokenizer, config = _mlx_lm.lm.load(
        str(path_or_hf_repo),
        tokenizer_config=tokenizer_config,
        model_config=model_config,
        adapter_path=adapter_path,
        lazy=lazy,
        return_config=True,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )
    folder = _local(str(path_or_hf_repo), revision)
    head = None
    if folder is not None and (folder / FILE).is_file():
        head = _head_from_file(model, config, folder / FILE)
    elif folder is not None and config.get("model_type") in FAMILIES and _has_mtp(folder, config):
        try:
            head = _head_from_checkpoint(op, model, config, folder)
        except ValueError as error:  # weights of another tool's layout: the model still loads
            warnings.warn(f"{error}; the model is loaded without an MTP head", stacklevel=2)
        if head is not None:
            _quantize(head, _quantization(model, config, head))
    if head is not None:
        head.eval()
        if not lazy:
            mx.eval(head.parameters())
        attach(model, head)
    return (model, tokenizer, config) if return_config else (model, tokenizer)
