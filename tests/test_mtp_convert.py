"""MTP heads from the files users have: ``convert_mtp`` / ``mlx-spec convert-mtp`` and
``mlx_spec.load`` (:mod:`mlx_spec.mtp_convert`).

For each family (``qwen3_next``, ``qwen3_5``, ``deepseek_v3``, ``glm4_moe``) a tiny model and its
MTP head (:func:`tiny_models.tiny_mtp_pair`) are written as the original Hugging Face checkpoint
(MTP weights in the family's naming, Qwen norms zero-centred, experts one by one, DeepSeek's
projections in FP8, two shards and their index), and as the MLX folders mlx-lm's own conversion
makes of the checkpoint without its MTP weights, as mlx-community's lack them: ``mlx_lm.convert``,
and ``mlx_lm.convert --quantize`` (4 bits, groups of 32). The head that ``convert_mtp`` and
``load`` give must have exactly the weights the checkpoint encodes, and greedy generation with
it must be plain mlx-lm decoding token for token.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.convert import convert
from mlx_lm.generate import generate_step
from tiny_models import (
    MTP_FAMILIES,
    hf_checkpoint,
    save_hf_folder,
    save_model_folder,
    tiny_llama,
    tiny_mtp_pair,
)

import mlx_spec
from mlx_spec import cli
from mlx_spec.mtp import MTPHead, head_of, new_head
from mlx_spec.mtp_convert import FILE, convert_mtp, load, save_head

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "mlx_spec" / "demo" / "target"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MOE = ("qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe")


@dataclass
class Folders:
    """A family's tiny model, its intended head, and its folders."""

    model: nn.Module
    head: MTPHead
    hf: Path  # the original checkpoint, MTP weights included
    plain: Path  # the same checkpoint without them
    mlx: Path  # mlx_lm.convert of `plain`, with convert_mtp's head
    quantized: Path  # mlx_lm.convert --quantize of `plain`, with convert_mtp's head


def silently(function, *args, **kwargs):
    """``function(*args, **kwargs)`` with mlx-lm's ``[INFO]`` lines kept off the test's output."""
    with contextlib.redirect_stdout(io.StringIO()):
        return function(*args, **kwargs)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``folders(family)``: the family's :class:`Folders`, built once for the module."""
    built: dict[str, Folders] = {}

    def get(family: str) -> Folders:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            model, head = tiny_mtp_pair(family)
            save_hf_folder(root / "hf", model, head, TOKENIZER, fp8=family == "deepseek_v3")
            save_hf_folder(root / "plain", model, None, TOKENIZER, fp8=family == "deepseek_v3")
            silently(convert, str(root / "plain"), str(root / "mlx"))
            silently(
                convert,
                str(root / "plain"),
                str(root / "quantized"),
                quantize=True,
                q_group_size=32,
                q_bits=4,
            )
            for name in ("mlx", "quantized"):
                convert_mtp(root / "hf", root / name)
            built[family] = Folders(
                model, head, root / "hf", root / "plain", root / "mlx", root / "quantized"
            )
        return built[family]

    return get


def weights(module: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(module.parameters()))


def assert_same_weights(got: dict[str, mx.array], want: dict[str, mx.array]) -> None:
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not mx.array_equal(got[k], want[k]).item()]
    assert not differ, f"weights that differ: {differ}"
    dtypes = [k for k in want if got[k].dtype != want[k].dtype]
    assert not dtypes, f"weights of another dtype: {dtypes}"


def loaded_head(folder: Path) -> MTPHead:
    model, _ = load(folder)
    head = head_of(model)
    assert isinstance(head, MTPHead)
    return head


def cli_main(*args: str) -> tuple[int, str, str]:
    """``mlx-spec *args`` in this process: the exit status (a usage error's too, which exits),
    stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(list(args))
        except SystemExit as exit:
            status = exit.code
    return status, out.getvalue(), err.getvalue()


# -- the test's own checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_the_tiny_checkpoints_are_what_mlx_lm_sanitizes_into_the_model(family):
    # The oracle of the tests below: mlx-lm's own sanitize takes the checkpoints they write back
    # to the model's weights exactly (zero-centred norms, conv1d, experts, kv_b_proj, FP8).
    model, _ = tiny_mtp_pair(family)
    want = weights(model)
    sanitized = model.sanitize(hf_checkpoint(model, fp8=family == "deepseek_v3"))
    assert_same_weights({k: v.astype(want[k].dtype) for k, v in sanitized.items()}, want)


# -- the head's weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_converted_head_has_the_weights_the_checkpoint_encodes(family, folders):
    built = folders(family)
    assert_same_weights(weights(loaded_head(built.mlx)), weights(built.head))


@pytest.mark.parametrize("family", QWEN)
def test_norm_shift_is_applied_exactly_once(family, folders):
    # The checkpoint stores each norm as w - 1; the head must hold w: not w - 1 (no shift), not
    # w + 1 (shifted twice), for the MTP's own norms and its layer's alike.
    built = folders(family)
    stored = {k: v for k, v in hf_checkpoint(built.model, built.head).items() if "norm" in k}
    head = weights(loaded_head(built.mlx))
    pairs = {
        "embed_norms.0.weight": "mtp.pre_fc_norm_embedding.weight",
        "hidden_norms.0.weight": "mtp.pre_fc_norm_hidden.weight",
        "norms.0.weight": "mtp.norm.weight",
        "layers.0.input_layernorm.weight": "mtp.layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight": "mtp.layers.0.post_attention_layernorm.weight",
        "layers.0.self_attn.q_norm.weight": "mtp.layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.k_norm.weight": "mtp.layers.0.self_attn.k_norm.weight",
    }
    for ours, theirs in pairs.items():
        assert mx.array_equal(head[ours], stored[theirs] + 1).item(), ours
        for wrong in (stored[theirs], stored[theirs] + 2):  # the test tells these apart
            assert mx.abs(head[ours] - wrong).min().item() >= 0.5, ours


@pytest.mark.parametrize("family", MOE)
def test_experts_are_stacked_as_mlx_lm_stacks_them(family, folders):
    built = folders(family)
    head = weights(loaded_head(built.mlx).layers[0])
    target = weights(built.model.layers[-1])  # the last layer: one of the MTP layer's kind
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"mlp.switch_mlp.{name}.weight"
        assert head[key].shape == target[key].shape
        assert head[key].shape[0] == 4  # experts
    assert not [k for k in head if ".experts." in k]


def test_fp8_weights_are_dequantized_as_mlx_lm_dequantizes_them(folders):
    built = folders("deepseek_v3")
    index = json.loads((built.hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.3.eh_proj.weight_scale_inv" in index
    assert "model.layers.3.self_attn.kv_b_proj.weight_scale_inv" in index
    head = weights(loaded_head(built.mlx))
    want = weights(built.head)
    for key in ("projections.0.weight", "layers.0.self_attn.embed_q.weight"):
        assert head[key].dtype == mx.float32
        assert mx.array_equal(head[key], want[key]).item(), key


def test_head_takes_the_dtype_of_the_mlx_folder(folders, tmp_path):
    built = folders("qwen3_5")
    silently(convert, str(built.plain), str(tmp_path / "bf16"), dtype="bfloat16")
    convert_mtp(built.hf, tmp_path / "bf16")
    want = {k: v.astype(mx.bfloat16) for k, v in weights(built.head).items()}
    assert_same_weights(weights(loaded_head(tmp_path / "bf16")), want)


def quantized_modules(module: nn.Module) -> dict[str, tuple[int, int, str]]:
    """The quantized modules of ``module``: path -> (bits, group size, mode)."""
    return {
        path: (m.bits, m.group_size, m.mode)
        for path, m in module.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size")
    }


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_quantized_like_the_target(family, folders):
    # Each module of the head's layer as the same module of the target's last layer (4 bits,
    # groups of 32, and 8 bits for the Qwen3-Next router as its quant_predicate asks); the
    # projection with the config's defaults; the weights those of the intended head, quantized.
    built = folders(family)
    target, _ = load(built.quantized)
    head = head_of(target)
    slot = len(target.layers) - 1
    ours = quantized_modules(head.layers[0])
    theirs = quantized_modules(target.layers[slot])
    assert ours == theirs
    assert quantized_modules(head)["projections.0"] == (4, 32, "affine")
    if family == "qwen3_next":
        assert ours["mlp.gate"] == (8, 64, "affine")
    intended = weights(built.head)
    got = weights(head)
    for path, (bits, group_size, mode) in quantized_modules(head).items():
        packed, scales, *biases = mx.quantize(
            intended[f"{path}.weight"], group_size=group_size, bits=bits, mode=mode
        )
        assert mx.array_equal(got[f"{path}.weight"], packed).item(), path
        assert mx.array_equal(got[f"{path}.scales"], scales).item(), path
        assert mx.array_equal(got[f"{path}.biases"], biases[0]).item(), path


def test_per_layer_overrides_of_the_config_follow_the_layer_of_the_same_kind(folders, tmp_path):
    # mlx-lm's mixed recipes give each layer its own bits in config.json; the head's layer takes
    # those of the target's last layer (6 bits: a last layer gets more), its projection the
    # defaults.
    built = folders("glm4_moe")
    silently(
        convert,
        str(built.plain),
        str(tmp_path / "mixed"),
        quantize=True,
        q_group_size=32,
        quant_predicate="mixed_3_6",
    )
    overrides = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization"]
    assert overrides["model.layers.2.self_attn.v_proj"]["bits"] == 6
    assert overrides["model.layers.1.self_attn.v_proj"]["bits"] == 3
    convert_mtp(built.hf, tmp_path / "mixed")
    target, _ = load(tmp_path / "mixed")
    ours = quantized_modules(head_of(target).layers[0])
    assert ours == quantized_modules(target.layers[2])
    assert ours["self_attn.v_proj"] == (6, 32, "affine")


def test_experts_stored_one_by_one_are_stacked_too(folders, tmp_path):
    # A Qwen3.5 MoE upload whose MTP layer keeps its experts one by one (vLLM reads both), where
    # mlx-lm's sanitize stacks only fused ones.
    built = folders("qwen3_5_moe")
    shutil.copytree(built.hf, tmp_path / "hf")
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        shard = mx.load(str(file))
        for key in [k for k in shard if k.startswith("mtp.") and ".experts." in k]:
            w = shard.pop(key)
            if key.endswith("gate_up_proj"):
                half = w.shape[-2] // 2
                parts = {"gate_proj": w[..., :half, :], "up_proj": w[..., half:, :]}
            else:
                parts = {"down_proj": w}
            for name, stacked in parts.items():
                for e in range(stacked.shape[0]):
                    shard[key.rsplit(".", 1)[0] + f".{e}.{name}.weight"] = stacked[e]
        mx.save_safetensors(str(file), shard)
    (tmp_path / "hf" / "model.safetensors.index.json").unlink()
    shutil.copytree(built.mlx, tmp_path / "mlx")
    convert_mtp(tmp_path / "hf", tmp_path / "mlx")
    assert_same_weights(weights(loaded_head(tmp_path / "mlx")), weights(built.head))


# -- loading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_a_hugging_face_folder_that_holds_everything_loads_the_same_head(family, folders, tmp_path):
    if family == "deepseek_v3":
        # mlx-lm's DeepSeek-V3 drops the MTP layer by its index in DeepSeek-V3 itself, 61: a
        # checkpoint with its MTP layer elsewhere does not load in mlx-lm.
        model, head = tiny_mtp_pair(family, layers=61)
        save_hf_folder(tmp_path / "hf", model, head, TOKENIZER, fp8=True)
        # mlx-lm loads the FP8 matrices dequantized to bfloat16, the main model's as the head's.
        fp8 = ("proj.weight", "embed_q.weight", "unembed_out.weight", "projections.0.weight")
        want = {
            k: v.astype(mx.bfloat16) if k.endswith(fp8) else v for k, v in weights(head).items()
        }
        folder = tmp_path / "hf"
    else:
        built = folders(family)
        want, folder = weights(loaded_head(built.mlx)), built.hf
    assert_same_weights(weights(loaded_head(folder)), want)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_head_of_ones_own_is_saved_and_loaded(quantized, tmp_path):
    # A head trained for a model mlx-lm runs (a llama here), saved beside it.
    model = tiny_llama(0, vocab=4096)
    save_model_folder(model, tmp_path / "llama", tokenizer_from=TOKENIZER)
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # the tokenizer's loader checks it
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    head = new_head(model, "deepseek", 2)
    if quantized:
        nn.quantize(head, group_size=32, bits=4)
    assert save_head(head, tmp_path / "llama") == tmp_path / "llama" / FILE
    loaded = loaded_head(tmp_path / "llama")
    assert (loaded.layout, len(loaded.layers)) == ("deepseek", 2)
    # A quantized head beside a model of floating-point layers is loaded dequantized, in the
    # model's dtype: the weights its quantized layers compute with.
    assert quantized_modules(loaded) == {}
    want = dequantized(tmp_path / "llama" / FILE) if quantized else weights(head)
    assert_same_weights(weights(loaded), want)


def test_load_is_mlx_lm_load_plus_the_head(folders):
    built = folders("glm4_moe")
    model, tokenizer, config = load(built.mlx, return_config=True)
    assert config["model_type"] == "glm4_moe"
    assert tokenizer.encode("x")
    reference = weights(silently(__import__("mlx_lm").load, str(built.mlx))[0])
    assert_same_weights(weights(model), reference)
    assert head_of(model) is not None


def test_the_public_names():
    from mlx_spec import mtp, mtp_convert

    assert mlx_spec.load is mtp_convert.load
    assert mlx_spec.MTPDrafter is mtp.MTPDrafter
    assert mlx_spec.convert_mtp is mtp_convert.convert_mtp
    with pytest.raises(ValueError, match="save_head: `head` must be an MTPHead, got dict"):
        save_head({}, ROOT)


# -- greedy generation ------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["mlx", "quantized"])
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_mtp_drafts_give_plain_mlx_lm_decoding(family, folder, folders):
    model, _ = load(getattr(folders(family), folder))
    prompt = mx.array(PROMPT, dtype=mx.uint32)
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=200)]
    stats = mlx_spec.SpeculativeStats()
    spec = [
        t
        for t, _, _ in mlx_spec.speculative_generate_step(
            prompt, model, drafter="mtp", num_draft_tokens=3, max_tokens=200, stats=stats
        )
    ]
    assert spec == plain
    # The head agrees often enough that kept and rejected drafts both occur many times.
    assert 20 <= stats.accepted <= stats.drafted - 20, (stats.accepted, stats.drafted)


def dequantized(file: Path) -> dict[str, mx.array]:
    """The weights of the head saved in ``file``, each quantized matrix dequantized as the file's
    metadata says, in the dtype of its norms (the model's)."""
    saved, metadata = mx.load(str(file), return_metadata=True)
    dtype = next(w.dtype for k, w in saved.items() if "norm" in k)
    out = {k: w for k, w in saved.items() if not k.endswith((".scales", ".biases"))}
    for path, q in json.loads(metadata["quantization"]).items():
        out[f"{path}.weight"] = mx.dequantize(
            saved[f"{path}.weight"],
            saved[f"{path}.scales"],
            saved.get(f"{path}.biases"),
            q["group_size"],
            q["bits"],
            mode=q["mode"],
        ).astype(dtype)
    return out


def test_the_demo_targets_shipped_head_drafts_plain_greedy_decoding():
    # The shipped head is quantized beside a bfloat16 target: it loads dequantized, and the text
    # over a few hundred tokens is plain decoding's, with drafts kept and rejected many times.
    from mlx_spec._demo import DEMO_DIR, PROMPTS

    _, metadata = mx.load(str(DEMO_DIR / "target" / FILE), return_metadata=True)
    shipped = json.loads(metadata["quantization"])
    assert shipped and {q["bits"] for q in shipped.values()} == {8}
    model, tokenizer = load(DEMO_DIR / "target")
    head = head_of(model)
    assert head is not None
    assert quantized_modules(head) == {} and quantized_modules(model) == {}
    prompt = mx.array(tokenizer.encode(PROMPTS[1]), dtype=mx.uint32)
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=300)]
    stats = mlx_spec.SpeculativeStats()
    spec = [
        t
        for t, _, _ in mlx_spec.speculative_generate_step(
            prompt, model, drafter="mtp", num_draft_tokens=3, max_tokens=300, stats=stats
        )
    ]
    assert spec == plain
    assert 50 <= stats.accepted <= stats.drafted - 50, (stats.accepted, stats.drafted)


# -- errors -------------------------------------------------------------------------------------


def test_an_mlx_folder_of_another_model_is_refused_naming_both(folders):
    qwen, glm = folders("qwen3_next"), folders("glm4_moe")
    with pytest.raises(ValueError, match="not the same model") as error:
        convert_mtp(qwen.hf, glm.mlx)
    assert str(qwen.hf) in str(error.value)
    assert str(glm.mlx) in str(error.value)
    status, _, err = cli_main("convert-mtp", str(qwen.hf), str(glm.mlx))
    assert status == 2
    assert err.count("\n") == 1 and "not the same model" in err
    assert str(qwen.hf) in err and str(glm.mlx) in err


def test_a_checkpoint_without_mtp_weights_gets_one_line_saying_what_to_give(folders):
    built = folders("qwen3_5")
    with pytest.raises(ValueError, match=r"holds no MTP weights .* original Hugging Face"):
        convert_mtp(built.plain, built.mlx)
    status, out, err = cli_main("convert-mtp", str(built.plain), str(built.mlx))
    assert status == 2 and not out
    assert err.count("\n") == 1 and "original Hugging Face checkpoint" in err


def test_a_model_without_a_head_gets_one_line_saying_how_to_add_one(folders, tmp_path):
    built = folders("qwen3_next")
    shutil.copytree(built.mlx, tmp_path / "bare")
    (tmp_path / "bare" / FILE).unlink()
    model, _ = load(tmp_path / "bare")
    assert head_of(model) is None
    with pytest.raises(ValueError, match="convert-mtp HF_DIR MLX_DIR") as error:
        next(mlx_spec.speculative_generate_step(mx.array(PROMPT), model, drafter="mtp"))
    assert "\n" not in str(error.value)


def test_a_head_made_for_another_model_is_refused_at_load(folders, tmp_path):
    qwen, other = folders("qwen3_next"), folders("qwen3_5")
    shutil.copytree(qwen.mlx, tmp_path / "mixed-up")
    shutil.copy(other.mlx / FILE, tmp_path / "mixed-up" / FILE)
    with pytest.raises(ValueError, match="MTP head of another model"):
        load(tmp_path / "mixed-up")


def test_a_file_of_another_tool_is_neither_read_nor_overwritten(folders, tmp_path):
    built = folders("qwen3_5")
    shutil.copytree(built.mlx, tmp_path / "other")
    foreign = tmp_path / "other" / FILE
    mx.save_safetensors(str(foreign), {"mtp.fc.weight": mx.zeros((64, 128))})
    with pytest.warns(UserWarning, match="not written by mlx-spec"):
        model, _ = load(tmp_path / "other")
    assert head_of(model) is None
    with pytest.raises(ValueError, match="not written by mlx-spec"):
        convert_mtp(built.hf, tmp_path / "other")
    assert set(mx.load(str(foreign))) == {"mtp.fc.weight"}


def test_a_checkpoint_missing_a_shard_is_refused_before_reading(folders, tmp_path):
    built = folders("qwen3_5")
    shutil.copytree(built.hf, tmp_path / "hf")
    (tmp_path / "hf" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"lacks 1 of the 2 files its index names"):
        convert_mtp(tmp_path / "hf", built.mlx, on_progress=pytest.fail)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: convert_mtp(3, "x"), "convert_mtp: `hf_dir` must be a folder path, got int"),
        (lambda: convert_mtp("no-such", "x"), "convert_mtp: `hf_dir` must be a model folder"),
        (lambda: load(None), "load: `path_or_hf_repo` must be a folder or a repository name"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(call, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        call()


def test_a_bad_progress_callback_and_an_unknown_family_are_refused(folders, tmp_path):
    built = folders("glm4_moe")
    with pytest.raises(ValueError, match="`on_progress` must be callable, got int"):
        convert_mtp(built.hf, built.mlx, on_progress=3)
    shutil.copytree(TOKENIZER, tmp_path / "llama")
    with pytest.raises(ValueError, match="holds a llama model; MTP heads are read for"):
        convert_mtp(tmp_path / "llama", built.mlx)


# -- the command and the guide ----------------------------------------------------------------


def test_the_command_writes_the_head_with_a_progress_line_per_step(folders, tmp_path):
    built = folders("deepseek_v3")
    shutil.copytree(built.quantized, tmp_path / "q")
    (tmp_path / "q" / FILE).unlink()
    status, out, err = cli_main("convert-mtp", str(built.hf), str(tmp_path / "q"))
    assert status == 0, err
    steps = [line for line in err.splitlines() if re.match(r"\[[#.]{20}\] \d+/\d+ ", line)]
    assert [line.split()[1] for line in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert "reading" in steps[0] and "MTP weights" in steps[0]
    assert out.startswith(f"Wrote {tmp_path / 'q' / FILE}")
    assert_same_weights(weights(loaded_head(tmp_path / "q")), weights(loaded_head(built.quantized)))


def test_help_and_bad_folders_answer_without_importing_mlx_lm(tmp_path):
    for args in (("--help",), (str(tmp_path), str(tmp_path))):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "mlx_spec", "convert-mtp", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == (0 if args == ("--help",) else 2), proc.stderr
        assert "mlx_lm" not in proc.stderr
    assert "is not a model folder (no config.json in it)" in proc.stderr


def guide_commands() -> list[str]:
    """The ``mlx-spec`` commands of the guide's section on MTP heads."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## MTP heads", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith("mlx-spec ")]


def test_the_guides_commands_run_on_tiny_folders(folders, tmp_path, monkeypatch):
    # The guide's folders, downloaded there, are tiny ones of the same family here.
    built = folders("qwen3_5")
    commands = guide_commands()
    assert [c.split()[1] for c in commands] == ["convert-mtp", "generate"]
    names = shlex.split(commands[0])[2:]
    shutil.copytree(built.hf, tmp_path / names[0])
    shutil.copytree(built.quantized, tmp_path / names[1])
    (tmp_path / names[1] / FILE).unlink()
    monkeypatch.chdir(tmp_path)
    status, _, err = cli_main(*shlex.split(commands[0])[1:])
    assert status == 0, err
    assert head_of(load(names[1])[0]) is not None
    status, out, err = cli_main(*shlex.split(commands[1])[1:], "--max-tokens", "16")
    assert status == 0, err
    assert "Speculation: MTP head" in out


def mtp_generate(folder: Path, *extra: str) -> tuple[int, str, str]:
    """``mlx-spec generate --model folder --mtp`` of a code prompt, greedy, 40 tokens."""
    return cli_main(
        "generate", "--model", str(folder), "--mtp", "--prompt", "def read(path):\n",
        "--ignore-chat-template", "--temp", "0", "--max-tokens", "40", *extra,
    )  # fmt: skip


def test_generate_with_mtp_prints_plain_decodings_text_and_how_often_each_position_was_kept(
    folders,
):
    import mlx_lm

    built = folders("qwen3_5")
    status, out, err = mtp_generate(built.quantized, "-n", "3", "--fixed")
    assert status == 0, err
    model, tokenizer = silently(mlx_lm.load, str(built.quantized))
    plain = mlx_lm.generate(model, tokenizer, "def read(path):\n", max_tokens=40)
    assert out.split("\n==========\n")[0] == plain
    found = re.search(r"Speculation: MTP head, N fixed 3, (\d+) rounds, (\d+) drafted", out)
    rounds, drafted = map(int, found.groups())
    assert 0 < drafted <= 3 * rounds
    kept = re.search(r"^Kept at draft position 1, 2, 3: (\d+)%, (\d+)%, (\d+)%$", out, re.M)
    assert kept, out


def test_generate_mtp_of_a_model_without_a_head_is_one_line_saying_how_to_add_one(
    folders, tmp_path
):
    built = folders("qwen3_next")
    shutil.copytree(built.quantized, tmp_path / "bare")
    (tmp_path / "bare" / FILE).unlink()
    status, out, err = mtp_generate(tmp_path / "bare")
    assert (status, out, err.count("\n")) == (2, "", 1), err
    assert "has no MTP head" in err and "mlx-spec convert-mtp HF_DIR MLX_DIR" in err
    # A model of a family that ships no head (the demo target without its own): the same line
    # says so.
    shutil.copytree(TOKENIZER, tmp_path / "llama")
    (tmp_path / "llama" / FILE).unlink()
    status, out, err = mtp_generate(tmp_path / "llama")
    assert (status, out, err.count("\n")) == (2, "", 1), err
    assert "llama models ship none" in err and "mlx-spec convert-mtp HF_DIR MLX_DIR" in err


def test_generate_mtp_says_why_a_file_of_another_tool_was_left_aside(folders, tmp_path):
    built = folders("qwen3_5")
    shutil.copytree(built.mlx, tmp_path / "other")
    mx.save_safetensors(str(tmp_path / "other" / FILE), {"mtp.fc.weight": mx.zeros((64, 128))})
    status, out, err = mtp_generate(tmp_path / "other")
    assert (status, out, err.count("\n")) == (2, "", 1), err
    assert "not written by mlx-spec" in err and "has no MTP head" in err


@pytest.mark.parametrize("other", [["--prompt-lookup"], ["--draft-model", str(TOKENIZER)]])
def test_generate_mtp_with_another_drafter_is_refused_in_one_line(other):
    status, out, err = mtp_generate(TOKENIZER, *other)
    assert (status, out, err.count("\n")) == (2, "", 1), err
    assert "not allowed with argument --mtp" in err


def test_generate_mtp_is_refused_on_several_ranks():
    import argparse

    from mlx_spec.cli import generate
    from mlx_spec.cli._common import CliError

    generate._check_mtp(argparse.Namespace(mtp=True), 1)
    generate._check_mtp(argparse.Namespace(mtp=False), 2)
    with pytest.raises(CliError, match="--mtp runs in one process, not split over 2 ranks"):
        generate._check_mtp(argparse.Namespace(mtp=True), 2)
