"""The server's speculative batches (``mlx_spec.serving``) against mlx-lm's ``BatchGenerator``.

Both are driven as ``mlx_lm.server`` drives them: ``insert_segments`` with the server's
arguments, ``next()`` until every request has finished. At temperature 0 every request's tokens
and finish reason must be mlx-lm's, through stop sequences, warm caches from an earlier turn,
per-request draft lengths and requests removed mid-flight.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from tiny_models import cut, tiny_llama, tiny_qwen3_5

from mlx_spec import _mlx_lm
from mlx_spec.serving import ServerBatchGenerator

# A repeated phrase (prompt lookup finds it), a single token, a short repetition and a long one.
PROMPTS = [[1, 2, 3, 4, 5] * 8, [7], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 8] * 25]
MAX_TOKENS = [24, 17, 30, 9]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def target(request):
    """A transformer, and a hybrid whose gated delta-net layers keep no positions."""
    return tiny_llama(0) if request.param == "llama" else tiny_qwen3_5(0)


@pytest.fixture(scope="module", params=["draft-model", "prompt-lookup"])
def make(request, target):
    """A maker of the server's speculative generator, with each drafter (a draft model: the
    target's first layer, or a hybrid's first two)."""
    hybrid = any(isinstance(c, ArraysCache) for c in make_prompt_cache(target))
    first = 2 if hybrid else 1
    options = (
        {"draft_model": cut(target, first)}
        if request.param == "draft-model"
        else {"drafter": "prompt-lookup"}
    )
    return lambda **kwargs: ServerBatchGenerator(target, **options, **kwargs)


def offsets(cache: list) -> set[int]:
    """The lengths a request's caches hold (recurrent layers hold none)."""
    return {c.offset for c in cache if not isinstance(c, ArraysCache)}


def stops_of(tokens: list[list[int]]) -> StopSequences:
    return StopSequences([tuple(t) for t in tokens])


def drive(generator, segments, *, stops=None, processors=None, remove_after=None, **kwargs):
    """Each request's ``(tokens, final response)``, and every prompt response as ``(call, uid,
    progress, end_of_segment, end_of_prompt)``, driving ``generator`` as the server does;
    ``remove_after``: ``(uid index, calls)`` removes one request after that many calls of
    ``next``."""
    uids = generator.insert_segments(
        segments,
        stop_sequences=stops,
        logits_processors=processors,
        **kwargs,
    )
    tokens = {uid: [] for uid in uids}
    last, prompted = {}, []
    for call in range(1, 2000):
        prompt_responses, responses = generator.next()
        prompted += [
            (call, r.uid, r.progress, r.end_of_segment, r.end_of_prompt) for r in prompt_responses
        ]
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                last[r.uid] = r
        if remove_after is not None and call == remove_after[1]:
            gone = uids[remove_after[0]]
            generator.remove([gone, gone, 10_000])  # a duplicate and an unknown uid
            last[gone] = None
        if len(last) == len(uids):
            break
    else:
        pytest.fail("the requests did not finish")
    return [(tokens[u], last[u]) for u in uids], prompted


def reference(target, segments, *, prompted=False, prefill_step_size=2048, **kwargs):
    """mlx-lm's ``BatchGenerator`` driven as :func:`drive` drives it: the requests' tokens and
    final responses (and, with ``prompted``, its prompt responses)."""
    generator = BatchGenerator(
        target, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=prefill_step_size
    )
    got, responses = drive(generator, segments, **kwargs)
    return (got, responses) if prompted else got


@pytest.mark.parametrize("target", ["llama"], indirect=True)
def test_server_batches_give_mlx_lms_tokens_and_stops(target, make) -> None:
    # Stop sequences of one token and of several (the first of one of them seen twice before it
    # completes; another's last token also the request's last), which rounds may meet inside
    # their drafts: placed where the transformer's tokens meet them.
    stops = [
        stops_of([[242, 135, 33], [200]]),
        stops_of([[11]]),
        StopSequences(),
        stops_of([[206, 128]]),
    ]
    segments = [[p[:3], p[3:]] if len(p) > 3 else [p] for p in PROMPTS]
    expected, mlx_lms = reference(
        target, segments, prompted=True, stops=stops, max_tokens=MAX_TOKENS
    )
    got, prompted = drive(make(), segments, stops=stops, max_tokens=MAX_TOKENS)
    for (tokens, last), (want, want_last) in zip(got, expected, strict=True):
        assert tokens == want
        assert last.finish_reason == want_last.finish_reason
    assert [len(t) for t, _ in expected] == [23, 11, 30, 9]  # where the stops are met
    assert [r.finish_reason for _, r in expected] == ["stop", "stop", "length", "stop"]
    # The same prompt responses at the same calls: each segment's end, then the whole prompt.
    assert sorted(prompted) == sorted(mlx_lms)
    assert (1, 0, (3, 40), True, False) in prompted and (2, 0, (39, 40), True, False) in prompted


def test_long_prompts_are_prefilled_a_chunk_a_call_while_others_run(target, make) -> None:
    # Chunks of 8 tokens: a 75-token prompt takes 10 calls to prefill its first 74 (its first
    # segment's 3, then 71 in chunks of 8) and joins at the 11th. The short prompts run
    # meanwhile, emitting a token (or more) every call; every request's tokens are mlx-lm's,
    # and so are the prompt responses.
    segments = [[p[:3], p[3:]] if len(p) > 3 else [p] for p in PROMPTS]
    expected, mlx_lms = reference(
        target, segments, prompted=True, prefill_step_size=8, max_tokens=MAX_TOKENS
    )
    generator = make(prefill_step_size=8)
    got, prompted = drive(generator, segments, max_tokens=MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert sorted(prompted) == sorted(mlx_lms)
    joined = {uid: call for call, uid, _, _, end in prompted if end}
    assert joined[1] == 1 and joined[3] == 11, joined
    # The short prompt [7] emitted tokens on every call before the long one joined.
    assert len(got[1][0]) >= joined[3] or got[1][1].finish_reason == "stop"


def test_a_segments_end_gives_its_caches_for_the_servers_prompt_cache(target, make) -> None:
    # A system prompt of 10 tokens, then 30 more: at the segment's end the server takes the
    # caches (the target's and any draft model's) holding exactly those 10 tokens, and a later
    # request started from them gives the tokens of the whole prompt prefilled afresh.
    system, rest = PROMPTS[3][:10], PROMPTS[3][10:40]
    generator = make(prefill_step_size=8)
    (uid,) = generator.insert_segments([[system, rest]], max_tokens=[MAX_TOKENS[0]])
    saved = None
    for _ in range(50):
        prompted, _ = generator.next()
        ends = [r.uid for r in prompted if r.end_of_segment and not r.end_of_prompt]
        caches = generator.extract_cache(ends)
        if saved is None and uid in caches:
            saved = caches[uid]
        if not len(generator):
            break
    cache, tokens = saved
    assert tokens == system
    assert len(cache) == len(generator.kinds) and offsets(cache) == {10}
    fresh = make()
    got, _ = drive(fresh, [[rest]], caches=[cache], all_tokens=[tokens], max_tokens=MAX_TOKENS[:1])
    expected = reference(target, [[system + rest]], max_tokens=MAX_TOKENS[:1])
    assert got[0][0] == expected[0][0]


def test_a_finished_requests_caches_start_its_next_turn(target, make, monkeypatch) -> None:
    # The server files each finished request's caches under its tokens, and gives them to the
    # next turn of the conversation with the tokens they hold: that turn is prefilled from them
    # alone and continues as mlx-lm continues the whole prompt.
    first, _ = drive(make(), [[p] for p in PROMPTS], max_tokens=MAX_TOKENS)
    more = [11, 12, 13, 14]
    caches = [last.prompt_cache for _, last in first]
    held = [last.all_tokens for _, last in first]
    generator = make()
    layers = len(generator.kinds)
    for cache, tokens in zip(caches, held, strict=True):
        assert len(cache) == layers and offsets(cache) == {len(tokens)}
    fed = []
    prompt = PromptProcessingBatch.prompt

    def counting(self, tokens):
        fed.append([len(t) for t in tokens])
        return prompt(self, tokens)

    monkeypatch.setattr(PromptProcessingBatch, "prompt", counting)
    got, _ = drive(generator, [[more]] * 4, caches=caches, all_tokens=held, max_tokens=MAX_TOKENS)
    monkeypatch.undo()
    # Each model (the target, a draft model) was fed each row's new tokens but the last.
    assert fed and all(lengths == [len(more) - 1] * 4 for lengths in fed)
    expected = reference(target, [[h + more] for h in held], max_tokens=MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in expected]


def test_caches_that_do_not_fit_are_left_and_the_prompt_prefilled_whole(target, make) -> None:
    # A cache holding other lengths than all_tokens (or of other layers) is not used.
    wrong = make_prompt_cache(target)
    expected = reference(target, [[p] for p in PROMPTS], max_tokens=MAX_TOKENS)
    got, _ = drive(
        make(),
        [[p[2:]] for p in PROMPTS[:1]] + [[p] for p in PROMPTS[1:]],
        caches=[wrong, None, None, None],
        all_tokens=[PROMPTS[0][:2], [], [], []],
        max_tokens=MAX_TOKENS,
    )
    assert [t for t, _ in got] == [t for t, _ in expected]


def test_each_request_drafts_up_to_its_own_num_draft_tokens(target, make) -> None:
    generator = make()
    lengths = [0, 1, 3, 2]
    processors = [_mlx_lm.DraftTokens([], n) for n in lengths]
    generator.insert_segments([[p] for p in PROMPTS], logits_processors=processors)
    while generator.generator.waiting or generator.generator.prefilling:
        generator.next()  # prefilled, then joined
    running = {s.uid: s.draft_length for s in generator.generator._batch.sequences}
    assert [running[uid] for uid in range(4) if uid in running] == [
        n for uid, n in enumerate(lengths) if uid in running
    ]
    assert len(running) >= 3  # [7] may have finished
    expected = reference(target, [[p] for p in PROMPTS], max_tokens=MAX_TOKENS)
    got, _ = drive(make(), [[p] for p in PROMPTS], processors=processors, max_tokens=MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in expected]


def test_a_request_removed_mid_flight_leaves_the_others_exact(target, make) -> None:
    expected = reference(target, [[p] for p in PROMPTS], max_tokens=MAX_TOKENS)
    generator = make()
    got, _ = drive(generator, [[p] for p in PROMPTS], max_tokens=MAX_TOKENS, remove_after=(2, 3))
    for i, ((tokens, last), (want, _)) in enumerate(zip(got, expected, strict=True)):
        if i == 2:
            assert last is None and tokens == want[: len(tokens)]
        else:
            assert tokens == want
    assert len(generator) == 0 and generator.prompt_cache_nbytes == 0
    assert generator.extract_cache([0, 1]) == {}


def test_the_caches_held_are_counted_and_close_drops_them(target, make) -> None:
    generator = make()
    generator.insert_segments([[p] for p in PROMPTS], max_tokens=[50] * 4)
    assert generator.prompt_cache_nbytes == 0  # waiting, on no cache
    generator.next()
    held = generator.prompt_cache_nbytes
    assert held > 0
    generator.close()
    assert len(generator) == 0 and generator.prompt_cache_nbytes == 0
    assert generator.next() == ([], [])


@pytest.mark.parametrize("target", ["llama"], indirect=True)
def test_requests_with_logits_processors_give_mlx_lms_tokens(target, make) -> None:
    # A logit bias, none, both, and a repetition penalty over the last 20 tokens, each row its
    # own, applied at every position a round verifies given the text and drafts before it (on
    # the transformer, whose text each of them changes).
    made = [
        make_logits_processors(logit_bias={33: 12.0}),
        [],
        make_logits_processors(logit_bias={200: -9.0, 7: 3.0}, repetition_penalty=1.2),
        make_logits_processors(repetition_penalty=1.5, repetition_context_size=20),
    ]
    processors = [_mlx_lm.DraftTokens(p, 3) for p in made]
    segments = [[p] for p in PROMPTS]
    expected = reference(target, segments, processors=made, max_tokens=MAX_TOKENS)
    plain = reference(target, segments, max_tokens=MAX_TOKENS)
    got, _ = drive(make(), segments, processors=processors, max_tokens=MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in expected]
    # The processors changed the text of every row that has some, and only those.
    changed = [t != p for (t, _), (p, _) in zip(expected, plain, strict=True)]
    assert changed == [True, False, True, True]


def test_a_logits_processor_that_is_not_callable_is_refused(make) -> None:
    with pytest.raises(
        ValueError, match=r"^SpeculativeBatchGenerator.insert: `logits_processors\[0\]`"
    ):
        make().insert_segments([[[1, 2]]], logits_processors=[[None]])


def test_a_stream_given_is_the_one_used(make) -> None:
    stream = mx.new_stream(mx.default_device())
    assert make(stream=stream).generator.stream == stream
