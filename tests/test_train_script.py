"""The demo-model scripts: the training script's smoke run, its conversion, and their helpers.

The smoke run needs torch (not a CI dependency: skipped there) and the conversion mlx-lm.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    # The scripts import their shared corpus module from their own folder, as when run.
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_heldout_split_is_a_small_fixed_fraction_by_name():
    corpus = load_script("demo_corpus")
    names = [f"stdlib/pkg{i}/mod{i}.py" for i in range(4000)]
    held = [n for n in names if corpus.is_heldout(n)]
    # 4000 names at 1/20: mean 200, sd ~14.
    assert 140 < len(held) < 260
    assert held == [n for n in reversed(names) if corpus.is_heldout(n)][::-1]


def test_corpus_splits_share_no_text_and_hold_out_a_few_percent():
    tr, held = load_script("demo_corpus").build_corpus()
    assert not set(tr) & set(held)
    assert 0.02 < len(held) / (len(tr) + len(held)) < 0.1


def test_corpus_caps_stop_adding_documents():
    corpus = load_script("demo_corpus")
    tr, held = corpus.build_corpus(max_train_bytes=200_000, max_heldout_bytes=50_000)
    sizes = [len(t.encode()) for t in tr]
    assert held
    assert sum(sizes[:-1]) < 200_000 <= sum(sizes)


def test_tokens_per_round_replays_greedy_acceptance():
    convert = load_script("convert_demo_models")
    # N = 2 over [1, 1, 0, 1]: round 1 accepts 2 and adds the target's token (3 tokens),
    # round 2 starts at the last position: 1 token. 4 tokens in 2 rounds.
    assert convert.tokens_per_round([[True, True, False, True]], 2) == 2.0
    # No match ever: one token a round, whatever N.
    assert convert.tokens_per_round([[False] * 5], 3) == 1.0
    # All match, N = 4 over 10 positions: rounds of 5 tokens.
    assert convert.tokens_per_round([[True] * 10], 4) == 5.0


def test_mtp_replay_starts_a_round_after_each_kept_run():
    convert = load_script("convert_demo_models")
    # Two drafted tokens from each of 4 positions, matched or not.
    rows = [[True, True], [False, False], [True, False], [True, True]]
    # N = 2: the round at 0 keeps 2 (3 tokens); the next starts at 3 and keeps 2 (3 tokens).
    assert convert.mtp_tokens_per_round([rows], 2) == 3.0
    # N = 1: rounds at 0 and 2 keep 1 each (2 tokens each).
    assert convert.mtp_tokens_per_round([rows], 1) == 2.0
    # Agreement at each draft position counts every row, whatever the tokens before it.
    assert convert.agreement_at([rows], 2) == [0.75, 0.5]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    out = tmp_path_factory.mktemp("demo") / "trained"
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(SCRIPTS / "train_demo_models.py"), "--out", str(out)]
    # Shards of 0.1 MiB: the target's 0.2 MB of weights take several files, like the real run's.
    cmd += ["--quick", "--device", "cpu", "--threads", "1", "--max-shard-mb", "0.1"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    return out


def test_quick_run_writes_models_tokenizer_and_report(quick_run: Path):
    report = json.loads((quick_run / "train_report.json").read_text())
    for name in ("target", "draft"):
        assert (quick_run / name / "config.json").is_file()
        assert list((quick_run / name).glob("model*.safetensors"))
        assert not (quick_run / name / "model.safetensors.index.json").exists()
        assert report[name]["steps"] > 0
    assert len(list((quick_run / "target").glob("model-*-of-*.safetensors"))) > 1
    # Nothing else: the GPU machine returns at most 8 files (3 shards here, 2 in the real run).
    others = {
        p.relative_to(quick_run).as_posix()
        for p in quick_run.rglob("*")
        if p.is_file() and not p.name.startswith("model")
    }
    assert others == {
        "train_report.json",
        "target/config.json",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "draft/config.json",
    }
    assert (quick_run / "target" / "tokenizer.json").is_file()
    vocab = report["tokenizer"]["vocab_size"]
    # The target learned something: below the loss of a uniform guess.
    assert report["target"]["heldout_loss"] < math.log(vocab) - 0.5
    assert 0.0 <= report["agreement"]["heldout_text"] <= 1.0
    assert report["sizes"]["models_total_bytes"] == sum(
        p.stat().st_size for p in quick_run.rglob("model*.safetensors")
    )


def test_quick_tokenizer_loads_offline_and_round_trips(quick_run: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(quick_run / "target"))
    text = "def f(x):\n    return {'a': x}  # é\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(tok.eos_token) == tok.eos_token_id


def test_quick_models_convert_and_match_pytorch_logits(quick_run: Path, tmp_path: Path):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm import load
    from transformers import LlamaForCausalLM

    convert = load_script("convert_demo_models")
    dst = tmp_path / "demo"
    args = ["--src", str(quick_run), "--dst", str(dst)]
    assert convert.main([*args, "--repeats", "2", "--prompts", "2", "--new-tokens", "8"]) == 0
    assert (dst / "README.md").is_file()
    ids = list(range(3, 40))
    for name in ("target", "draft"):
        model, tokenizer = load(str(dst / name))
        assert tokenizer.eos_token_id == 0
        got = np.array(model(mx.array([ids])).astype(mx.float32))
        hf_folder = tmp_path / f"hf-{name}"
        shutil.copytree(quick_run / name, hf_folder)
        convert.write_shard_index(hf_folder)
        hf = LlamaForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits.numpy()
        # Both run the same bfloat16 weights; MLX computes in bfloat16, torch here in float32.
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9
