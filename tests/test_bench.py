"""``mlx_spec.bench`` measures what it labels: ``bench.mlx_lm`` runs mlx-lm's own speculative loop,
also while ``patch_mlx_lm()`` routes mlx-lm's through mlx-spec's.

A tiny random llama drafts for itself at temperature 1, where the two loops part: rejection
sampling keeps every draft token (``p == q``), mlx-lm's rule keeps one only when the target's own
sample equals it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import mlx_spec
from mlx_spec import bench
from mlx_spec.generation import speculative_generate_step

lm_generate = importlib.import_module("mlx_lm.generate")

MODEL = """
import mlx.core as mx
from mlx_lm.models import llama

args = llama.ModelArgs(
    model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
    num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=64,
)
mx.random.seed(0)
model = llama.Model(args)
mx.eval(model.parameters())
prompt = mx.array([1, 2, 3, 4])
"""


@pytest.fixture(scope="module")
def model() -> llama.Model:
    namespace: dict = {}
    exec(MODEL, namespace)
    return namespace["model"]


def test_mlx_lm_ignores_the_loop_installed_in_mlx_lm(model, monkeypatch):
    prompt = mx.array([1, 2, 3, 4])
    theirs = bench.mlx_lm(model, model, 4)
    before = theirs.generate(prompt, 1.0, 0, 40)
    calls = []

    def installed(*args, **kwargs):
        calls.append(args)
        return speculative_generate_step(*args, **kwargs)

    # What patch_mlx_lm() installs, counted.
    monkeypatch.setattr(lm_generate, "speculative_generate_step", installed)
    during = theirs.generate(prompt, 1.0, 0, 40)
    assert not calls
    assert during == before


def test_mlx_lm_keeps_mlx_lms_rule_when_imported_after_the_patch():
    # A fresh interpreter, patched before mlx_spec.bench is imported: names that bench took from
    # mlx-lm at import would then be mlx-spec's loop and sampler (rejection sampling).
    source = MODEL + textwrap.dedent("""
        import mlx_spec
        mlx_spec.patch_mlx_lm()
        from mlx_spec import bench
        for method in (bench.mlx_lm(model, model, 4), bench.mlx_spec(model, 4, draft=model)):
            stats = method.generate(prompt, 1.0, 0, 40)
            print(stats.drafted, stats.accepted)
    """)
    package = str(Path(mlx_spec.__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=120, cwd=package
    )
    assert run.returncode == 0, run.stderr
    (theirs_drafted, theirs_accepted), (ours_drafted, ours_accepted) = (
        map(int, line.split()) for line in run.stdout.splitlines()
    )
    assert theirs_accepted < theirs_drafted
    assert ours_accepted == ours_drafted  # the control: mlx-spec keeps every draft token here
