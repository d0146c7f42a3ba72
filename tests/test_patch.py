"""mlx-lm's entry points through mlx-spec: ``stream_generate``, ``generate`` and ``patch_mlx_lm``
(mlx-lm's own functions, command and samplers; with ``mtp=True``, its loading and its server's
batching too)."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPT, ByteTokenizer, run
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

import mlx_spec.batch as spec_batch
import mlx_spec.generation as spec_generation
from mlx_spec import _mlx_lm, loop, mtp_convert
from mlx_spec._mlx_lm import lm
from mlx_spec.batch_length import BatchAdaptive
from mlx_spec.drafters import PromptLookupDrafter
from mlx_spec.generation import (
    SpeculativeResponse,
    SpeculativeStats,
    speculative_generate_step,
    stream_generate,
)
from mlx_spec.mtp import MTPDrafter, MTPHead, head_of
from mlx_spec.patch import patch_mlx_lm, unpatch_mlx_lm
from mlx_spec.serving import ServerBatchGenerator

lm_generate = importlib.import_module("mlx_lm.generate")
lm_sample_utils = importlib.import_module("mlx_lm.sample_utils")


def offsets(cache) -> set[int]:
    return {c.offset for c in cache}


def test_stream_generate_matches_mlx_lm_plain(target, drafts) -> None:
    tokenizer = ByteTokenizer()
    plain = list(lm_generate.stream_generate(target, tokenizer, PROMPT, max_tokens=50))
    stats = SpeculativeStats()
    ours = list(
        stream_generate(
            target, tokenizer, PROMPT, max_tokens=50, draft_model=drafts["truncated"], stats=stats
        )
    )
    assert [r.token for r in ours] == [r.token for r in plain]
    assert "".join(r.text for r in ours) == "".join(r.text for r in plain)
    assert [r.finish_reason for r in ours] == [r.finish_reason for r in plain]
    assert [r.generation_tokens for r in ours] == [r.generation_tokens for r in plain]
    assert all(isinstance(r, SpeculativeResponse) for r in ours)
    last = ours[-1].stats
    assert last == stats and last.generated == 50 and last.rounds < 50
    assert stats.rounds - 1 <= [r.from_draft for r in ours].count(False) <= stats.rounds


def test_stream_generate_stops_at_tokenizer_eos(target, drafts, greedy_reference) -> None:
    stop = greedy_reference[30]

    class Tok(ByteTokenizer):
        eos_token_id = stop

    plain = list(lm_generate.stream_generate(target, Tok(), PROMPT, max_tokens=100))
    cache = make_prompt_cache(target) + make_prompt_cache(drafts["self"])
    ours = list(
        stream_generate(
            target,
            Tok(),
            PROMPT,
            max_tokens=100,
            draft_model=drafts["self"],
            num_draft_tokens=8,
            prompt_cache=cache,
        )
    )
    assert ours[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert [r.token for r in ours] == [r.token for r in plain]
    # The EOS token is in the caches, as the server's cache key expects.
    assert offsets(cache) == {len(PROMPT) + greedy_reference.index(stop) + 1}


def test_generate_returns_text_and_fills_stats(target, drafts) -> None:
    tokenizer = ByteTokenizer()
    plain = lm_generate.generate(target, tokenizer, PROMPT, max_tokens=40)
    stats = SpeculativeStats()
    text = spec_generation.generate(
        target, tokenizer, PROMPT, max_tokens=40, draft_model=drafts["truncated"], stats=stats
    )
    assert text == plain and stats.generated == 40 and stats.rounds > 0


@pytest.mark.parametrize("verbose", [np.array([], dtype=bool), "no", None])
def test_generate_refuses_a_verbose_that_is_not_a_bool(target, drafts, verbose) -> None:
    # An empty NumPy array in `if verbose` raised NumPy's own ValueError.
    with pytest.raises(ValueError, match="generate: `verbose` must be a bool"):
        spec_generation.generate(
            target, ByteTokenizer(), PROMPT, verbose=verbose, draft_model=drafts["truncated"]
        )


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"tokenizer": None}, r"stream_generate: `tokenizer` must be a tokenizer .* got NoneType"),
        ({"prompt": [2**64]}, r"stream_generate: `prompt` must be text, .* got list"),
        ({"prompt": [[1], [2, 3]]}, r"stream_generate: `prompt` must be text, .* got list"),
        ({"stats": {}}, r"speculative_generate_step: `stats` must be a SpeculativeStats"),
        # Compared with == first, an array gave NumPy's "truth value ... is ambiguous".
        ({"max_tokens": np.array([1, 2])}, r"speculative_generate_step: `max_tokens` must be"),
        ({"drafter": np.array([1, 2])}, r"speculative_generate_step: `drafter` must be"),
    ],
)
def test_stream_generate_refuses_bad_arguments(target, drafts, arguments, match) -> None:
    given = {"tokenizer": ByteTokenizer(), "prompt": PROMPT, "max_tokens": 3, **arguments}
    if "drafter" not in given:
        given["draft_model"] = drafts["truncated"]
    responses = stream_generate(target, **given)
    with pytest.raises(ValueError, match=match):
        next(responses)


@pytest.fixture
def patched():
    patch_mlx_lm()
    yield
    unpatch_mlx_lm()


def test_patch_routes_mlx_lm_stream_generate_through_mlx_spec(patched, target) -> None:
    import mlx_lm

    sampler = lm_sample_utils.make_sampler(temp=1.0)  # made through the patched factory
    mx.random.seed(4)
    responses = list(
        mlx_lm.stream_generate(
            target,
            ByteTokenizer(),
            PROMPT,
            max_tokens=41,
            draft_model=target,
            num_draft_tokens=4,
            sampler=sampler,
        )
    )
    # The target drafting for itself: rejection sampling keeps every draft token, so every round
    # yields 5 tokens, 4 of them from the draft (mlx-lm's rule keeps a draft token with
    # probability sum(p^2) only); the 41st token, alone in its round, is the target's.
    flags = [r.from_draft for r in responses]
    assert flags == ([True] * 4 + [False]) * 8 + [False]
    mx.random.seed(4)
    ours, _, _ = run(PROMPT, target, target, sampler=sampler, max_tokens=41, num_draft_tokens=4)
    assert [r.token for r in responses] == ours


def test_patch_keeps_plain_sampling_unchanged(target) -> None:
    def sample(factory):
        mx.random.seed(8)
        return [
            t
            for t, _ in generate_step(
                mx.array(PROMPT), target, max_tokens=30, sampler=factory(temp=0.9, top_p=0.9)
            )
        ]

    before = sample(lm_sample_utils.make_sampler)
    patch_mlx_lm()
    try:
        during = sample(lm_sample_utils.make_sampler)
        assert callable(lm_sample_utils.make_sampler(temp=0.9).probs)
    finally:
        unpatch_mlx_lm()
    assert during == before


def mlx_lm_package():
    import mlx_lm

    return mlx_lm


def server_parts(server) -> tuple:
    """What the patch replaces in mlx-lm's server (its own names, its handler, its cache, its
    loading and its batches)."""
    return (
        server.make_sampler,
        server.stream_generate,
        server.LRUPromptCache,
        server.APIHandler.handle_completion,
        server.ResponseGenerator._run_generate,
        server.ModelProvider._load,
        server.BatchGenerator,
        server.ResponseGenerator._is_batchable,
        server._make_logits_processors,
        server.ResponseGenerator._tokenize,
    )


def test_patch_and_unpatch_are_idempotent_and_exact() -> None:
    server = pytest.importorskip("mlx_lm.server")
    originals = (
        lm_generate.speculative_generate_step,
        lm_sample_utils.make_sampler,
        lm_generate.make_sampler,
        lm_generate.stream_generate,
        lm_generate.generate,
        *server_parts(server),
    )
    patch_mlx_lm()
    patched_server = server_parts(server)
    patch_mlx_lm()
    assert lm_generate.speculative_generate_step is speculative_generate_step
    for module in (lm_sample_utils, lm_generate, server):
        assert module.make_sampler is not originals[1]
        assert callable(module.make_sampler(temp=0.5).probs)
    # stream_generate is replaced too, so that mlx-lm's own `max_kv_size` reaches the loop.
    assert lm_generate.stream_generate is not originals[3]
    assert mlx_lm_package().stream_generate is lm_generate.stream_generate
    assert server.stream_generate is lm_generate.stream_generate
    assert mlx_lm_package().generate is lm_generate.generate is not originals[4]
    # Each part of the server replaced once (a second patch wraps nothing again).
    assert server_parts(server) == patched_server
    assert all(p is not o for p, o in zip(patched_server, originals[5:], strict=True))
    unpatch_mlx_lm()
    unpatch_mlx_lm()
    assert (
        lm_generate.speculative_generate_step,
        lm_sample_utils.make_sampler,
        lm_generate.make_sampler,
        lm_generate.stream_generate,
        lm_generate.generate,
        *server_parts(server),
    ) == originals
    assert mlx_lm_package().generate is originals[4]


def test_patched_generate_verbose_shows_the_speculation(patched, target, drafts, capsys) -> None:
    import mlx_lm

    stats = SpeculativeStats()
    text = mlx_lm.generate(
        target, ByteTokenizer(), PROMPT, verbose=True, max_tokens=30,
        draft_model=drafts["truncated"], num_draft_tokens=3, stats=stats,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert text and stats.rounds and stats.drafted
    line = (
        f"Speculation: {stats.rounds} rounds, {stats.accepted}/{stats.drafted} draft tokens "
        f"accepted, {stats.tokens_per_round:.2f} tokens per round"
    )
    assert out.endswith(f"Peak memory: {out.split('Peak memory: ')[1].splitlines()[0]}\n{line}\n")
    # Without speculation, mlx-lm's own output.
    mlx_lm.generate(target, ByteTokenizer(), PROMPT, verbose=True, max_tokens=5)
    assert "Speculation" not in capsys.readouterr().out
    # Not verbose: nothing printed.
    mlx_lm.generate(target, ByteTokenizer(), PROMPT, max_tokens=5, draft_model=drafts["self"])
    assert capsys.readouterr().out == ""


def test_patched_generate_says_when_nothing_was_drafted(patched, target, drafts, capsys) -> None:
    # One token: its round drafts nothing (no token would be left to verify a draft against).
    lm_generate.generate(
        target, ByteTokenizer(), PROMPT, verbose=True, max_tokens=1, draft_model=drafts["self"]
    )
    assert "Speculation: 1 rounds, nothing drafted, 1.00 tokens per round\n" in (
        capsys.readouterr().out
    )


def test_patched_mlx_lm_command_keeps_every_draft_of_the_target_itself(
    patched, target, monkeypatch, capsys
) -> None:
    # `mlx_lm.generate` (the command) with the target as its own draft at temperature 1: mlx-lm's
    # main builds its sampler with the patched make_sampler, whose logits mlx-spec draws each
    # position from with that position's key; the draft draws the target's own token, so every
    # draft token is kept.
    class Tok(ByteTokenizer):
        vocab_size = 256

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(Tok())

    def load(path, **kwargs):
        return (target, tokenizer, {}) if kwargs.get("return_config") else (target, tokenizer)

    rounds = []
    original_round = loop.Generation._round

    def counted_round(self, n, proposal, remaining):
        out = original_round(self, n, proposal, remaining)
        rounds.append((self.rule.kind, self.policy.n, out[1]))
        return out

    monkeypatch.setattr(lm_generate, "load", load)
    monkeypatch.setattr(loop.Generation, "_round", counted_round)
    argv = "mlx_lm.generate --model m --draft-model d --num-draft-tokens 4 --temp 1.0"
    argv += " --max-tokens 21 --seed 0 --ignore-chat-template --prompt hello"
    monkeypatch.setattr(sys, "argv", argv.split())
    lm_generate.main()
    out = capsys.readouterr().out
    # mlx-lm's summary, and the speculation's: 4 rounds of 4 kept drafts, then one of 0.
    assert "Generation: 21 tokens" in out
    assert "Speculation: 5 rounds, 16/16 draft tokens accepted, 4.20 tokens per round" in out
    assert rounds and {mode for mode, _, _ in rounds} == {"coupled"}
    # Every draft token kept, and no round drafts more than the tokens left after its own.
    assert all(from_draft == min(n, 20 - 5 * i) for i, (_, n, from_draft) in enumerate(rounds))


@pytest.mark.parametrize(
    "options",
    [
        ["--max-kv-size", "12"],
        ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "8"],
    ],
)
def test_patched_command_with_cache_options_prints_plain_decodings_text(
    monkeypatch, capsys, options
) -> None:
    # mlx-lm's own speculative path drops --max-kv-size; patched, the loop gets it (rotating
    # caches that keep 4 tokens, wrapped several times here) and --kv-bits, and the text is the
    # one plain decoding prints with the same options.
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tiny_models import cut, tiny_qwen2

    model = tiny_qwen2(0)
    models = {"m": model, "d": cut(model, 1)}

    class Tok(ByteTokenizer):
        vocab_size = 256

    tokenizer = TokenizerWrapper(Tok())

    def load(path, **kwargs):
        pair = (models[path], tokenizer)
        return (*pair, {}) if kwargs.get("return_config") else pair

    def printed(argv: str) -> str:
        monkeypatch.setattr(sys, "argv", [*argv.split(), *options])
        lm_generate.main()
        return capsys.readouterr().out.split("==========")[1]

    monkeypatch.setattr(lm_generate, "load", load)
    command = "mlx_lm.generate --model m --temp 0 --max-tokens 60 --ignore-chat-template"
    command += " --prompt hello"
    plain = printed(command)
    unpatched = printed(command + " --draft-model d --num-draft-tokens 3")
    patch_mlx_lm()
    try:
        speculative = printed(command + " --draft-model d --num-draft-tokens 3")
    finally:
        unpatch_mlx_lm()
    assert len(plain) > 15 and speculative == plain
    if "--max-kv-size" in options:
        # The option matters: mlx-lm's own speculative loop drops it and prints another text.
        assert unpatched != plain


# -- patch_mlx_lm(mtp=True): the model's own MTP head -------------------------------------------

MTP_PROMPT = "def read(path):\n"


@pytest.fixture
def drafters_seen(monkeypatch) -> list[str]:
    """The class name of the drafter of every round that mlx-spec's loop runs."""
    seen: list[str] = []
    original = loop.Generation._round

    def counted(self, n, proposal, remaining):
        seen.append(type(self.drafter).__name__)
        return original(self, n, proposal, remaining)

    monkeypatch.setattr(loop.Generation, "_round", counted)
    return seen


def test_patch_with_mtp_loads_the_head_and_drafts_with_it(mtp_folders, drafters_seen) -> None:
    import mlx_lm

    folder, _ = mtp_folders
    model, tokenizer = mlx_lm.load(str(folder))
    assert head_of(model) is None  # mlx-lm's own load leaves the head aside
    plain = mlx_lm.generate(model, tokenizer, MTP_PROMPT, max_tokens=60)
    patch_mlx_lm(mtp=True)
    try:
        model, tokenizer = mlx_lm.load(str(folder))
        stats = SpeculativeStats()
        text = mlx_lm.generate(model, tokenizer, MTP_PROMPT, max_tokens=60, stats=stats)
    finally:
        unpatch_mlx_lm()
    assert isinstance(head_of(model), MTPHead)
    assert text == plain
    assert drafters_seen and set(drafters_seen) == {"MTPDrafter"}
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("prompt_lookup", [False, True])
def test_patch_with_mtp_leaves_a_model_without_a_head_as_it_was(
    mtp_folders, drafters_seen, prompt_lookup
) -> None:
    import mlx_lm

    _, bare = mtp_folders
    patch_mlx_lm(mtp=True, prompt_lookup=prompt_lookup)
    try:
        model, tokenizer = mlx_lm.load(str(bare))
        mlx_lm.generate(model, tokenizer, MTP_PROMPT * 2, max_tokens=20)
    finally:
        unpatch_mlx_lm()
    assert head_of(model) is None
    # mlx-lm's own generation, or, asked for, prompt lookup.
    assert set(drafters_seen) == ({"PromptLookupDrafter"} if prompt_lookup else set())


def test_patched_mlx_lm_command_drafts_with_the_models_head(
    mtp_folders, drafters_seen, monkeypatch, capsys
) -> None:
    folder, _ = mtp_folders

    def printed() -> str:
        argv = f"mlx_lm.generate --model {folder} --max-tokens 40 --num-draft-tokens 3"
        monkeypatch.setattr(sys, "argv", [*argv.split(), "--prompt", MTP_PROMPT])
        lm_generate.main()
        return capsys.readouterr().out

    plain = printed()
    patch_mlx_lm(mtp=True)
    try:
        speculative = printed()
    finally:
        unpatch_mlx_lm()
    assert "Speculation" not in plain
    text = plain.split("==========")[1]
    assert len(text) > 20 and speculative.split("==========")[1] == text
    found = re.search(r"Speculation: (\d+) rounds, (\d+)/(\d+) draft tokens accepted", speculative)
    rounds, accepted, drafted = map(int, found.groups())
    assert set(drafters_seen) == {"MTPDrafter"} and len(drafters_seen) == rounds
    assert 0 < accepted < drafted


LOADERS = ("mlx_lm", "mlx_lm.utils", "mlx_lm.generate", "mlx_lm.server")


def loaders() -> list:
    pytest.importorskip("mlx_lm.server")
    return [sys.modules[name].load for name in LOADERS]


def test_load_is_replaced_with_mtp_only_and_put_back() -> None:
    originals = loaders()
    assert set(originals) == {lm.load}
    patch_mlx_lm(mtp=True)
    try:
        assert loaders() == [mtp_convert.load] * len(LOADERS)
        patch_mlx_lm(mtp=True)
        assert loaders() == [mtp_convert.load] * len(LOADERS)
        patch_mlx_lm()  # the options anew: no MTP, mlx-lm's load
        assert loaders() == originals
        patch_mlx_lm(mtp=True)
    finally:
        unpatch_mlx_lm()
    assert loaders() == originals


@pytest.mark.parametrize("mtp", [1, "yes", None, np.bool_(True)])
def test_a_bad_mtp_is_refused_before_any_work(mtp) -> None:
    with pytest.raises(ValueError, match=r"^patch_mlx_lm: `mtp` must be a bool, got "):
        patch_mlx_lm(mtp=mtp)
    assert lm_generate.stream_generate is lm.stream_generate
    assert loaders() == [lm.load] * len(LOADERS)


def test_patched_server_batches_a_model_with_a_head(mtp_folders, drafters_seen) -> None:
    # ModelProvider._load finds a model with a head of one layer batchable: the server's batches
    # draft with it. A head of two layers does not batch: its requests are served one at a time,
    # each through stream_generate, which drafts with the head.
    from mlx_spec import patch
    from mlx_spec.mtp import attach, new_head

    server = pytest.importorskip("mlx_lm.server")
    folder, bare = mtp_folders

    def provider(model: Path, **options) -> object:
        args = argparse.Namespace(
            model=str(model), adapter_path=None, draft_model=None, pipeline=False,
            trust_remote_code=False, chat_template=None, use_default_chat_template=False,
        )  # fmt: skip
        patch_mlx_lm(**options)
        try:
            loaded = server.ModelProvider(args)
            loaded.load("default_model", None, "default_model")
        finally:
            unpatch_mlx_lm()
        return loaded

    without = provider(folder)
    assert head_of(without.model) is None and without.is_batchable  # the control
    assert provider(bare, mtp=True).is_batchable
    served = provider(folder, mtp=True)
    assert isinstance(head_of(served.model), MTPHead) and served.is_batchable
    prompt = served.tokenizer.encode(MTP_PROMPT)
    plain = [t for t, _ in generate_step(mx.array(prompt), served.model, max_tokens=40)]
    patch_mlx_lm(mtp=True)
    try:
        served = server.ModelProvider(served.cli_args)
        served.load("default_model", None, "default_model")
        generator = server.BatchGenerator(served.model)
        (uid,) = generator.insert_segments([[prompt]], max_tokens=[40])
        batched = []
        for _ in range(200):
            batched += [r.token for r in generator.next()[1] if r.uid == uid]
            if not len(generator):
                break
        tokens = [
            r.token
            for r in server.stream_generate(
                model=served.model, tokenizer=served.tokenizer, prompt=prompt, max_tokens=40,
                prompt_cache=make_prompt_cache(served.model), draft_model=None,
                num_draft_tokens=3,
            )
        ]  # fmt: skip
        two = served.model
        attach(two, new_head(two, "qwen", layers=2))
        serial = patch._serial(two)
    finally:
        unpatch_mlx_lm()
    assert isinstance(generator.generator._drafter, MTPDrafter)
    assert generator.generator._batch is None or not len(generator.generator._batch)
    assert batched == tokens == plain
    assert drafters_seen and set(drafters_seen) == {"MTPDrafter"}
    assert serial


def test_patching_again_probes_mlx_lms_own_parts_not_the_replacements() -> None:
    # A second patch_mlx_lm() runs the probes again: they must test mlx-lm's server and loading
    # (a probe of the replaced prompt cache recursed, one of the replaced _load found no load).
    pytest.importorskip("mlx_lm.server")
    patch_mlx_lm(mtp=True)
    try:
        patch_mlx_lm(mtp=True)
        assert all(_mlx_lm.report().values()), _mlx_lm.report()
    finally:
        unpatch_mlx_lm()


# -- mlx-lm's batch_generate, patched ---------------------------------------------------------

# Very different lengths, one repeating itself (prompt lookup finds it).
BATCH_PROMPTS = [[1, 2, 3, 4, 5] * 6, [7], [9, 10, 11, 9, 10, 11, 9, 10]]


def mlx_lms_batch(target, **options):
    return lm_generate.batch_generate(
        target,
        TokenizerWrapper(ByteTokenizer()),
        BATCH_PROMPTS,
        max_tokens=30,
        return_token_ids=True,
        **options,
    )


@pytest.fixture
def batch_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every call of mlx-spec's batch_generate."""
    calls: list[dict] = []
    original = spec_batch.batch_generate

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(spec_batch, "batch_generate", counted)
    return calls


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_patched_batch_generate_speculates_and_gives_mlx_lms_tokens(
    target, drafts, drafter, batch_calls
) -> None:
    import mlx_lm

    want = mlx_lms_batch(target)
    lookup = drafter == "prompt-lookup"
    given = {} if lookup else {"draft_model": drafts["truncated"]}
    patch_mlx_lm(prompt_lookup=lookup)
    try:
        got = mlx_lm.batch_generate(
            target,
            TokenizerWrapper(ByteTokenizer()),
            BATCH_PROMPTS,
            max_tokens=30,
            return_token_ids=True,
            num_draft_tokens=4,
            prefill_batch_size=2,  # how prompts prefill together changes no token
            logits_processors=None,  # options at their defaults are not refused
            max_kv_size=None,
            **given,
        )
    finally:
        unpatch_mlx_lm()
    assert got.token_ids == want.token_ids and got.texts == want.texts
    assert len(batch_calls) == 1
    call = batch_calls[0]
    assert call["num_draft_tokens"] == 4
    assert (call["drafter"], call["draft_model"]) == (
        ("prompt-lookup", None) if lookup else (None, drafts["truncated"])
    )
    assert mlx_lm.batch_generate is lm_generate.batch_generate  # restored
    assert mlx_lms_batch(target).token_ids == want.token_ids and len(batch_calls) == 1


def test_patched_batch_generate_speculates_with_logits_processors(target, batch_calls) -> None:
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(logit_bias={101: 4.0}, repetition_penalty=1.3)
    want = mlx_lms_batch(target, logits_processors=processors)
    assert want.token_ids != mlx_lms_batch(target).token_ids  # the processors matter here
    patch_mlx_lm(prompt_lookup=True)
    try:
        got = mlx_lms_batch(target, logits_processors=processors)
    finally:
        unpatch_mlx_lm()
    assert got.token_ids == want.token_ids and len(batch_calls) == 1
    assert batch_calls[0]["logits_processors"] == processors


def test_patched_batch_generate_decodes_in_turns_as_mlx_lm_does(target, batch_calls) -> None:
    # Three prompts, two at a time: the third joins when one finishes.
    want = mlx_lms_batch(target, completion_batch_size=2)
    patch_mlx_lm(prompt_lookup=True)
    try:
        got = mlx_lms_batch(target, completion_batch_size=2)
    finally:
        unpatch_mlx_lm()
    assert got.token_ids == want.token_ids and len(batch_calls) == 1
    assert batch_calls[0]["completion_batch_size"] == 2


def test_patched_batch_generate_without_a_drafter_is_mlx_lms(target, patched, batch_calls) -> None:
    want = mlx_lms_batch(target)  # patched without prompt_lookup
    assert not batch_calls
    unpatch_mlx_lm()
    assert mlx_lms_batch(target).token_ids == want.token_ids


@pytest.mark.parametrize(
    "options",
    [
        {"max_kv_size": 64},
    ],
    ids=["max_kv_size"],
)
def test_patched_batch_generate_runs_mlx_lms_own_for_what_batches_do_not_take(
    target, drafts, options, batch_calls
) -> None:
    want = mlx_lms_batch(target, **options)
    patch_mlx_lm(prompt_lookup=True)
    try:
        got = mlx_lms_batch(target, **options)
        # With a draft model, the call is refused instead, naming what batches do not take.
        name = next(iter(options))
        with pytest.raises(ValueError, match=rf"batch_generate \(patched\).*`{name}`"):
            mlx_lms_batch(target, draft_model=drafts["truncated"], **options)
    finally:
        unpatch_mlx_lm()
    assert got.token_ids == want.token_ids
    assert not batch_calls


DEMO = Path(__file__).resolve().parents[1] / "mlx_spec" / "demo"


def server_request(**options) -> SimpleNamespace:
    """What the server's ``_is_batchable`` and ``_make_logits_processors`` read of a request."""
    logits = SimpleNamespace(
        logit_bias=None, repetition_penalty=None, repetition_context_size=20,
        presence_penalty=None, presence_context_size=20, frequency_penalty=None,
        frequency_context_size=20,
    )  # fmt: skip
    for name in list(options):
        if hasattr(logits, name):
            setattr(logits, name, options.pop(name))
    return SimpleNamespace(**{"seed": None, "num_draft_tokens": 3, "logits": logits, **options})


@pytest.mark.parametrize("draft", [True, False])
def test_patched_server_batches_speculative_requests(draft) -> None:
    # With a draft model, mlx-lm's server serves requests one at a time; patched, it batches
    # them through mlx-spec's generator, as it does with prompt lookup and no draft model.
    server = pytest.importorskip("mlx_lm.server")
    args = argparse.Namespace(
        model=str(DEMO / "target"), adapter_path=None,
        draft_model=str(DEMO / "draft") if draft else None, pipeline=False,
        trust_remote_code=False, chat_template=None, use_default_chat_template=False,
        num_draft_tokens=4, kv_bits=None,
    )  # fmt: skip
    options = {"completion_batch_size": 4, "prefill_batch_size": 2, "prefill_step_size": 64}

    def serving() -> tuple[object, object]:
        """The server's provider with the model loaded, and the generator it makes."""
        provider = server.ModelProvider(args)
        provider.load("default_model", None, "default_model")
        return provider, server.BatchGenerator(provider.model, **options)

    def batchable(provider: object, **request) -> bool:
        responses = SimpleNamespace(model_provider=provider, cli_args=args)
        return server.ResponseGenerator._is_batchable(responses, server_request(**request))

    patch_mlx_lm(prompt_lookup=not draft)
    try:
        provider, generator = serving()
        # A request with a seed or more draft tokens than the server's is served one at a
        # time; others batch, logits processors (a bias, a penalty) included.
        assert batchable(provider) and batchable(provider, num_draft_tokens=0)
        assert batchable(provider, num_draft_tokens=4)
        assert not batchable(provider, seed=3)
        assert not batchable(provider, num_draft_tokens=5)
        assert batchable(provider, logit_bias={1: 2.0})
        assert batchable(provider, repetition_penalty=1.1)
        made = server._make_logits_processors(server_request(num_draft_tokens=2))
        assert made == [] and made.num_draft_tokens == 2
        made = server._make_logits_processors(
            server_request(logit_bias={1: 2.0}, repetition_penalty=1.1, num_draft_tokens=1)
        )
        assert len(made) == 2 and all(callable(f) for f in made) and made.num_draft_tokens == 1
        # The generators made for one loaded model (one after each drain) share one policy,
        # and so what it measured at each batch size.
        again = server.BatchGenerator(provider.model, **options)
        assert again is not generator
        assert again.generator.policy is generator.generator.policy is not None
        assert isinstance(generator.generator.policy, BatchAdaptive)
        # A server split over processes keeps serving them one at a time.
        split = SimpleNamespace(model_provider=provider, cli_args=args, _is_distributed=True)
        assert not server.ResponseGenerator._is_batchable(split, server_request())
        # --num-draft-tokens 0: the batches draft nothing, and a request asking for drafts is
        # served one at a time.
        args.num_draft_tokens = 0
        none_provider, none_generator = serving()
        assert none_generator.generator.num_draft_tokens == 0
        assert none_generator.generator.policy is None
        assert not batchable(none_provider, num_draft_tokens=1)
        assert batchable(none_provider, num_draft_tokens=0)
        args.num_draft_tokens = 4
    finally:
        unpatch_mlx_lm()
    assert provider.is_batchable and isinstance(generator, ServerBatchGenerator)
    assert generator.generator.draft_model is provider.draft_model
    assert generator.generator.num_draft_tokens == 4
    assert generator.generator.prefill_batch_size == 2
    drafter = generator.generator._drafter
    assert drafter is None if draft else isinstance(drafter, PromptLookupDrafter)
    # The controls: patched without prompt lookup (no draft model), and unpatched.
    if not draft:
        patch_mlx_lm()
        try:
            provider, generator = serving()
        finally:
            unpatch_mlx_lm()
        assert provider.is_batchable and type(generator) is server.BatchGenerator
    provider, generator = serving()
    assert provider.is_batchable is not draft and type(generator) is server.BatchGenerator


def test_the_server_batches_hybrids_and_sliding_windows() -> None:
    # A hybrid's gated delta-net layers batch beside its attention layers (with a hybrid draft
    # model too), as a target's sliding windows do; a draft model with sliding windows is left
    # to mlx-lm (its maker is None).
    from tiny_models import cut, tiny_gemma3, tiny_llama, tiny_qwen3_5

    from mlx_spec import patch

    hybrid = tiny_qwen3_5(0)
    patch_mlx_lm(prompt_lookup=True)
    try:
        make = patch._server_batches(hybrid, cut(hybrid, 2))
        assert make is not None
        assert make(hybrid).generator.draft_model is not None
        assert patch._server_batches(hybrid, None) is not None
        assert patch._server_batches(tiny_gemma3(0), tiny_llama(0)) is not None
        assert patch._server_batches(tiny_llama(0), tiny_gemma3(0)) is None
    finally:
        unpatch_mlx_lm()
