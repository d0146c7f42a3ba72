"""A verification's attention in chunks of queries (mlx_spec.attention): the same attention as one
call, only within ``chunking`` on its own thread, and lossless through the generation loop."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPT, run
from mlx_lm.generate import generate_step
from tiny_models import cut, tiny_llama

from mlx_spec import attention, generation
from mlx_spec.attention import QUERIES_PER_CALL, attention_in_chunks, chunking

ATTEND = mx.fast.scaled_dot_product_attention


def _qkv(count: int, length: int, head: int = 64, seed: int = 0) -> tuple[mx.array, ...]:
    """``[1, 4, count, head]`` queries over ``[1, 2, length, head]`` keys and values (two query
    heads per key head, as grouped-query attention has), float32."""
    key = mx.random.key(seed)
    q, k, v = (
        mx.random.normal(shape, key=part)
        for shape, part in zip(
            [(1, 4, count, head), (1, 2, length, head), (1, 2, length, head)],
            mx.random.split(key, 3),
            strict=True,
        )
    )
    return q, k, v


@pytest.mark.parametrize("mask", ["causal", None])
@pytest.mark.parametrize("size", [1, 2, QUERIES_PER_CALL])
@pytest.mark.parametrize("count,extra", [(1, 0), (4, 0), (5, 3), (9, 0), (9, 40), (12, 7)])
def test_chunks_give_the_attention_of_one_call(count, extra, size, mask):
    q, k, v = _qkv(count, count + extra)
    one = ATTEND(q, k, v, scale=0.125, mask=mask)
    chunked = attention_in_chunks(q, k, v, scale=0.125, mask=mask, size=size)
    assert chunked.shape == one.shape
    np.testing.assert_allclose(np.array(chunked), np.array(one), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("count", [4, 9])
def test_chunks_over_all_keys_would_differ(count):
    """Negative control: a causal chunk that kept every key (its first query would then see
    keys of later positions) gives another attention, which the test above would catch."""
    q, k, v = _qkv(count, count + 2)
    one = ATTEND(q, k, v, scale=0.125, mask="causal")
    unsliced = mx.concatenate(
        [
            ATTEND(q[:, :, a : a + QUERIES_PER_CALL], k, v, scale=0.125, mask="causal")
            for a in range(0, count, QUERIES_PER_CALL)
        ],
        axis=2,
    )
    assert not np.allclose(np.array(unsliced), np.array(one), rtol=1e-3, atol=1e-3)


class Spy:
    """An attention that records the query count of each call and gives MLX's."""

    def __init__(self) -> None:
        self.queries: list[int] = []

    def __call__(self, q, k, v, **kwargs):
        self.queries.append(q.shape[2])
        return ATTEND(q, k, v, **kwargs)


def test_chunking_applies_within_it_on_its_thread_only():
    spy = Spy()
    wrapped = attention._chunked(spy)
    q, k, v = _qkv(9, 12)
    outside = wrapped(q, k, v, scale=0.125, mask="causal")
    assert spy.queries == [9]
    seen_elsewhere: list[int] = []
    with chunking():
        inside = wrapped(q, k, v, scale=0.125, mask="causal")
        assert spy.queries[1:] == [3, 3, 3]

        def elsewhere():
            before = len(spy.queries)
            wrapped(q, k, v, scale=0.125, mask="causal")
            seen_elsewhere.extend(spy.queries[before:])

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert seen_elsewhere == [9]
    np.testing.assert_allclose(np.array(inside), np.array(outside), rtol=1e-5, atol=1e-5)
    after = len(spy.queries)
    wrapped(q, k, v, scale=0.125, mask="causal")
    assert spy.queries[after:] == [9]


@pytest.mark.parametrize(
    "case",
    ["array mask", "few queries", "head size 16"],
)
def test_chunking_leaves_other_calls_whole(case):
    spy = Spy()
    wrapped = attention._chunked(spy)
    count = QUERIES_PER_CALL if case == "few queries" else 9
    q, k, v = _qkv(count, 12, head=16 if case == "head size 16" else 64)
    with chunking():
        if case == "array mask":
            wrapped(q, k, v, scale=0.125, mask=mx.zeros((count, 12)))
        else:
            wrapped(q, k, v, scale=0.125, mask="causal")
    assert spy.queries == [count]


def test_chunking_replaces_attention_only_while_some_thread_is_inside():
    original = mx.fast.scaled_dot_product_attention
    entered, leave = threading.Event(), threading.Event()

    def other():
        with chunking():
            entered.set()
            leave.wait()

    with chunking():
        installed = mx.fast.scaled_dot_product_attention
        assert installed is not original and installed.chunks
        with chunking():
            assert mx.fast.scaled_dot_product_attention is installed
        thread = threading.Thread(target=other)
        thread.start()
        entered.wait()
    # The other thread is still inside: the wrapper stays until it leaves.
    assert mx.fast.scaled_dot_product_attention is installed
    leave.set()
    thread.join()
    assert mx.fast.scaled_dot_product_attention is original


@pytest.mark.parametrize("drafting", ["prompt-lookup", "draft model"])
def test_chunked_verifications_give_plain_greedy_tokens(drafting, monkeypatch):
    """Through the loop, verifications of up to 9 positions with chunked attention (head size
    64) give mlx-lm's plain greedy tokens over 200 tokens."""
    target = tiny_llama(0, heads=2, hidden=128, intermediate=256)
    reference = [t for t, _ in generate_step(mx.array(PROMPT), target, max_tokens=200)]
    chunks = []

    def counted(*args, **kwargs):
        chunks.append(args[0].shape[2])
        return attention_in_chunks(*args, **kwargs)

    # Chunked verifications, as on MLX's CUDA backend with cuDNN attention off.
    monkeypatch.setattr(generation, "chunks_pay", lambda device: True)
    monkeypatch.setattr(attention, "attention_in_chunks", counted)
    if drafting == "prompt-lookup":
        tokens, _, stats = run(
            PROMPT, target, None, drafter="prompt-lookup", num_draft_tokens=8, max_tokens=200
        )
    else:
        tokens, _, stats = run(PROMPT, target, cut(target, 1), num_draft_tokens=4, max_tokens=200)
    assert tokens == reference
    assert stats.accepted > 0
    assert chunks and max(chunks) > QUERIES_PER_CALL


@pytest.mark.parametrize("setting,pays", [("0", True), ("1", False), (None, False)])
def test_chunks_pay_on_cuda_with_cudnn_attention_off(setting, pays, monkeypatch):
    """Chunks pay on MLX's CUDA backend with cuDNN attention off, and nowhere else."""
    if setting is None:
        monkeypatch.delenv(attention.CUDNN_ATTENTION, raising=False)
    else:
        monkeypatch.setenv(attention.CUDNN_ATTENTION, setting)
    monkeypatch.setattr(attention.kernels, "on_cuda", lambda stream=None: True)
    assert attention.chunks_pay(mx.gpu) is pays
    # Turning the acceptance kernels off leaves the attention as it is.
    with attention.kernels.disabled():
        assert attention.chunks_pay(mx.gpu) is pays
    monkeypatch.setattr(attention.kernels, "on_cuda", lambda stream=None: False)
    assert attention.chunks_pay(mx.cpu) is False
