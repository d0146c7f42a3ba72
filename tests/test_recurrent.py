"""The gated delta-net states kept after every position of a call (mlx_spec.recurrent), and the
rewinds of mlx_spec.caches.ModelCache that use them, on mlx-lm's real model classes."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gated_delta
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import tiny_lfm2, tiny_llama, tiny_qwen3_5, tiny_qwen3_next

from mlx_spec import _mlx_lm as recurrent
from mlx_spec.caches import ModelCache

BUILDERS = {"qwen3_next": tiny_qwen3_next, "qwen3_5": tiny_qwen3_5}
PROMPT = mx.array([[5, 17, 3, 99, 42, 7, 61, 200, 13]])
FED = mx.array([[8, 150, 31, 77, 2, 190]])


def _prefilled(model):
    cache = make_prompt_cache(model)
    model(PROMPT, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _recurrent_entries(cache) -> list[list[mx.array]]:
    return [list(c.cache) for c in cache if type(c).__name__ == "ArraysCache"]


def _distance(a: mx.array, b: mx.array) -> float:
    """The largest difference of ``a`` and ``b``, relative to the largest value of ``b``."""
    assert a.shape == b.shape
    a, b = np.array(a), np.array(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# A GPU's matrix products may round a row differently in calls of other lengths.
CLOSE = 1e-3


@pytest.mark.parametrize("noted", ["steps noted", "one position at a time"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_positions_hold_what_a_shorter_call_leaves(name: str, noted: str, monkeypatch) -> None:
    model = BUILDERS[name](0)
    assert recurrent.track(model) == 2
    if noted == "one position at a time":
        # As under mlx-lm's Metal kernel, whose call makes only the last state.
        step = gated_delta._gated_delta_step_ops
        monkeypatch.setattr(gated_delta, "_gated_delta_step_ops", step.unnoted)
    cache = _prefilled(model)
    with recurrent.tracking() as records:
        model(FED, cache=cache)
    assert len(records) == 2
    assert all(len(r.states) == FED.shape[1] for r in records)
    for count in range(1, FED.shape[1] + 1):
        shorter = _prefilled(model)
        model(FED[:, :count], cache=shorter)
        for positions, entries in zip(records, _recurrent_entries(shorter), strict=True):
            for kept, entry in zip(positions.after(count), entries, strict=True):
                assert _distance(kept, entry) < CLOSE
            if count > 1:
                # The neighbouring position's state is far off: the comparison tells them apart.
                assert _distance(positions.after(count - 1)[1], entries[1]) > 50 * CLOSE
    # The whole call's entries are what the caches hold after it.
    for positions, entries in zip(records, _recurrent_entries(cache), strict=True):
        for kept, entry in zip(positions.after(FED.shape[1]), entries, strict=True):
            np.testing.assert_array_equal(np.array(kept), np.array(entry))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tracked_calls_give_the_logits_of_untracked_ones(name: str) -> None:
    model = BUILDERS[name](1)
    before = model(FED, cache=_prefilled(model))
    recurrent.track(model)
    outside = model(FED, cache=_prefilled(model))
    with recurrent.tracking():
        inside = model(FED, cache=_prefilled(model))
    np.testing.assert_array_equal(np.array(outside), np.array(before))
    # Within tracking the recurrence runs a position at a time, as plain decoding's steps do.
    np.testing.assert_allclose(np.array(inside), np.array(before), atol=1e-4)


def test_track_counts_the_layers_it_knows_and_installs_once() -> None:
    model = tiny_qwen3_next(2)
    assert recurrent.track(model) == recurrent.track(model) == 2
    # One subclass of mlx's Conv1d, not a subclass of a subclass.
    assert type(model.layers[0].linear_attn.conv1d).__bases__ == (nn.Conv1d,)
    assert recurrent.track(tiny_llama(2)) == 0
    assert recurrent.track(tiny_lfm2(2)) == 0


def test_tracking_records_this_thread_only() -> None:
    model = tiny_qwen3_next(3)
    recurrent.track(model)
    cache = _prefilled(model)
    other = _prefilled(model)
    with recurrent.tracking() as records:
        thread = threading.Thread(target=lambda: mx.eval(model(FED, cache=other)))
        thread.start()
        thread.join()
        assert records == []
        model(FED[:, :2], cache=cache)
    assert [len(r.states) for r in records] == [2, 2]


def _model_cache(model) -> ModelCache:
    cache = make_prompt_cache(model)
    model_cache = ModelCache(cache, model=model)
    model(PROMPT, cache=cache)
    model_cache.fed(PROMPT.shape[1])
    return model_cache


def _next_logits(model, model_cache: ModelCache, tokens: mx.array) -> np.ndarray:
    return np.array(model(tokens, cache=model_cache.layers)[0, -1])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_rewind_into_a_tracked_call_keeps_that_length(name: str) -> None:
    model = BUILDERS[name](4)
    model_cache = _model_cache(model)
    assert not model_cache.replays
    start = model_cache.length
    model_cache.checkpoint()
    with model_cache.tracking():
        model(FED, cache=model_cache.layers)
        model_cache.fed(FED.shape[1])
    assert model_cache.rewind(start + 4) == start + 4
    assert model_cache.rewind(start + 2) == start + 2  # again, lower, from the same call
    reference = _model_cache(model)
    model(FED[:, :2], cache=reference.layers)
    tail = FED[:, 2:3]
    np.testing.assert_allclose(
        _next_logits(model, model_cache, tail), _next_logits(model, reference, tail), atol=1e-4
    )


def test_rewind_after_a_later_call_restores_the_checkpoint() -> None:
    model = tiny_qwen3_next(5)
    model_cache = _model_cache(model)
    start = model_cache.length
    model_cache.checkpoint()
    with model_cache.tracking():
        model(FED, cache=model_cache.layers)
        model_cache.fed(FED.shape[1])
    model(FED[:, :1], cache=model_cache.layers)
    model_cache.fed(1)
    # The states kept describe the caches before the last call: only the checkpoint is exact.
    assert model_cache.rewind(start + 2) == start


def test_without_the_model_a_hybrid_replays() -> None:
    model = tiny_qwen3_next(6)
    assert ModelCache(make_prompt_cache(model)).replays
    assert ModelCache(make_prompt_cache(tiny_lfm2(6)), model=tiny_lfm2(6)).replays
    assert not ModelCache(make_prompt_cache(tiny_llama(6)), model=tiny_llama(6)).replays


def test_forget_keeps_the_latest_checkpoint_at_or_below_a_length() -> None:
    model = tiny_lfm2(7)
    model_cache = _model_cache(model)
    start = model_cache.length
    for token in FED[0, :3].tolist():
        model_cache.checkpoint()
        model(mx.array([[token]]), cache=model_cache.layers)
        model_cache.fed(1)
    model_cache.forget(start + 1)
    assert model_cache.rewind(start + 2) == start + 1
    model_cache.forget()
    with pytest.raises(RuntimeError, match="no checkpoint at or below"):
        model_cache.rewind(start)
