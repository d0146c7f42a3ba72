"""Shared test configuration: deterministic hypothesis, the ``--full`` switch for heavy runs, full
float32 matrix products on CUDA, SIGINT's default action for the processes the tests start, the
tiny llama models the generation tests share, and a tiny model's folders with and without an MTP
head."""

import os
import signal

# The generation tests compare speculative decoding with token-at-a-time generation of a float32
# model, which needs the target's logits for a position to be the same whether 1 or N + 1 positions
# are scored together. MLX's CUDA backend computes float32 matrix products in TF32 by default (10
# mantissa bits), which moves logits by ~1e-3 between those two shapes and flips near ties; the
# acceptance itself is exact either way (docs/design.md). Set before MLX is imported.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import pytest
from hypothesis import HealthCheck, settings

# Tests stop servers and commands with SIGINT, as Ctrl-C does. A shell without job control starts
# a background command (``pytest &`` in a script) with SIGINT ignored, which its children inherit;
# Python's own handler here makes them start with the default action again.
signal.signal(signal.SIGINT, signal.default_int_handler)

settings.register_profile(
    "deterministic",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("deterministic")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="also run the heavy tests (markers 'statistical' and 'slow'); CI runs them",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        # A quick case of what a slow test checks in full (more tokens from the same prompts
        # and seeds, or more examples of the same property) adds nothing to the full run.
        skip = pytest.mark.skip(reason="quick case: a slow test checks it in full")
        skipped = ("quick_only",)
    else:
        skip = pytest.mark.skip(reason="heavy test: run with --full")
        skipped = ("statistical", "slow")
    for item in items:
        if any(name in item.keywords for name in skipped):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _eager(request: pytest.FixtureRequest):
    """Runs a test marked ``eager`` with ``mx.compile`` off. MLX's CPU backend compiles C++ for
    each fused graph and each constant baked into it, about a second each, so a sweep drawing a
    new vocabulary size or filter value per example spends most of its time in the compiler; the
    sweep checks the ops' values, which compiling does not change, and a compiled sibling with
    fewer examples runs beside it."""
    if request.node.get_closest_marker("eager") is None:
        yield
        return
    import mlx.core as mx

    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


@pytest.fixture(scope="module")
def target():
    """A two-layer float32 llama (:func:`tiny_models.tiny_llama`)."""
    from tiny_models import tiny_llama

    return tiny_llama(0)


@pytest.fixture(scope="module")
def drafts(target):
    """Drafts for ``target``: itself, cut to its first layer (agrees on about 3 of 4 tokens at
    temperature 0), and an unrelated random model (almost never agrees)."""
    from tiny_models import cut, tiny_llama

    return {"self": target, "truncated": cut(target, 1), "unrelated": tiny_llama(7)}


@pytest.fixture(scope="module")
def greedy_reference(target) -> list[int]:
    """300 tokens of mlx-lm's plain greedy ``generate_step`` after ``helpers.PROMPT``."""
    import mlx.core as mx
    from helpers import PROMPT
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(mx.array(PROMPT), target, max_tokens=300)]


@pytest.fixture(scope="module")
def mtp_folders(tmp_path_factory):
    """Two mlx-lm folders of a tiny qwen3_5 (:func:`tiny_models.tiny_mtp_pair`) with the demo
    target's tokenizer: one with the model's MTP head (``mtp.safetensors``, which agrees with the
    model on about half the draft tokens), one without it."""
    from pathlib import Path

    from tiny_models import save_model_folder, tiny_mtp_pair

    from mlx_spec.mtp_convert import save_head

    tokenizer = Path(__file__).resolve().parents[1] / "mlx_spec" / "demo" / "target"
    root = tmp_path_factory.mktemp("mtp")
    model, head = tiny_mtp_pair("qwen3_5")
    for name in ("head", "bare"):
        save_model_folder(model, root / name, tokenizer_from=tokenizer)
    save_head(head, root / "head")
    return root / "head", root / "bare"
