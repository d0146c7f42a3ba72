"""MTP drafts: the head computes what the published models compute, and sampling with it is exact.

**1. A head that must reproduce a known function of the target's hidden state.** A Qwen-layout
head (on ``qwen3_5``) and a DeepSeek-layout head (on ``glm4_moe``, whose MTP layer DeepSeek-V3's
layout describes) are written as the original Hugging Face checkpoint
(:func:`tiny_models.save_hf_folder`: the Qwen norms zero-centred) and loaded with
:func:`mlx_spec.load`, which prepares them as ``convert-mtp`` does. Their weights make one draft
step a function computed here in NumPy:

- the decoder layer is an identity (the output projections of its attention and MLP or experts
  are zero, so both residual branches add nothing);
- the projection is ``[I | B]``: the embedding half passes, the hidden half is mixed by a random
  ``B`` (so swapping the halves changes the result);
- every norm has random weights ``1 + k / 64`` (:func:`tiny_models.randomize_norms`), the
  target's final norm included: with unit weights there, the head's hidden norm would give the
  same result before and after it.

From ``h``, the target's hidden state at text position ``j`` (the input of its LM head, after its
final norm; here from mlx-lm's own backbone over the whole text), and ``e``, the embedding of the
token at ``j + 1``, a step is ``z = fc @ [rms(e) * w_e ; rms(h) * w_h]`` and its logits are
``W @ (rms(z) * w_n)``, with ``rms(x) = x / sqrt(mean(x**2) + eps)``; the next draft position
takes ``rms(z) * w_n`` (Qwen) or ``z`` (DeepSeek) as its ``h`` and the drafted token's embedding.
The norm weights ``w`` are the checkpoint's stored values plus 1 (Qwen) or as stored (DeepSeek).
Every round of a greedy generation (drafts both kept and rejected) must give these logits at
both draft positions within :data:`TOLERANCE`. Beside it, negative controls build the wrong
variants, each of which must miss by more than that: the Qwen norm shift missing or applied
twice (a DeepSeek norm shifted), the concatenation ``[h, e]`` instead of ``[e, h]``, the hidden
state taken before the target's final norm, and the chained state of the other layout.

These conventions were checked in the published model code:

- vLLM ``vllm/model_executor/models/qwen3_next_mtp.py`` (``Qwen3NextMultiTokenPredictor``):
  ``pre_fc_norm_embedding`` of the embeddings and ``pre_fc_norm_hidden`` of the hidden states,
  concatenated ``[embeddings, hidden]``, then ``fc``, the layer, and ``norm``, whose output the
  LM head reads and the next step takes; its norms are ``Qwen3NextRMSNorm``, which
  ``vllm/model_executor/models/qwen3_next.py`` imports as ``GemmaRMSNorm``: ``x * (1 + w)``, the
  zero-centred weights that mlx-lm shifts by 1. SGLang's ``qwen3_next_mtp.py`` agrees
  (``GemmaRMSNorm``, ``torch.cat((input_embeds, hidden_states))``).
- vLLM ``vllm/model_executor/models/deepseek_mtp.py`` (``DeepSeekMultiTokenPredictorLayer``):
  ``enorm`` and ``hnorm``, ``eh_proj`` of ``torch.cat([inputs_embeds, previous_hidden_states])``,
  the block, and ``residual + hidden_states`` returned before ``shared_head.norm``, which
  ``compute_logits`` applies; plain RMSNorm weights (no shift). SGLang's ``deepseek_nextn.py``
  concatenates in the same order.
- The hidden state the head takes is the one the target's LM head reads: SGLang's
  ``python/sglang/srt/layers/logits_processor.py`` captures for the drafter the same
  ``pruned_states`` it multiplies by the LM head (the model's output after its final norm).

**2. Sampled exactness.** On a 24-token llama with an MTP head of random weights (each layout),
the first two tokens after :data:`helpers.PROMPT` are counted over fixed keys ``0, 1, ...`` and
compared with the exact joint distribution of sampling the target alone
(:func:`first_tokens.exact_joint`) by :func:`first_tokens.chi_square_p` (threshold ``1e-3``), at
temperature 1 and with top-p, top-k and min-p (:func:`mlx_spec.sampling.make_sampler`), under
both acceptance rules. Each run generates up to 3 tokens with 2 drafts a round, so every way the
drafter proposes is used: the first round drafts from the prefill's hidden states and chains the
head for its second token, and after a rejection the next round drafts from the hidden state the
verification gave. Drafts are both kept and rejected (checked).

Beside each test a negative control, a rule that accepts the MTP drafts wrongly, must fail at
the same sample size:

- coupled: the first draft token kept without being checked. The first token then follows the
  head's distribution ``q1`` and the second the target's after it: ``w(a, b) = q1(a) p(b | a)``.
- residual: after a rejection, ``next`` drawn from ``p`` instead of ``norm(max(p - q, 0))``. At a
  position whose rows are ``p`` and ``q`` a rule emits ``q min(1, p / q) + (1 - k) r`` (``k`` the
  chance the draft is kept, ``r`` its residual), so ``w(a, b) = q1(a) min(1, p1(a) / q1(a))
  s(p(. | a), q2(. | a))(b) + (1 - k1) r1(a) s(p(. | a), q2'(. | a))(b)``, with ``q2(. | a)`` the
  head chained after drafting ``a`` and ``q2'(. | a)`` the head after the target's ``a``.

The sample sizes come from a power calculation that :func:`test_each_control_fails_with_power`
repeats: the head's rows are computed by running the head itself (:func:`head_rows`), apart from
the drafter's bookkeeping (:func:`test_the_power_calculation_reads_the_drafters_own_rows` checks
them against the rows the drafter reports), and the closed form gives the target's joint for the
right rule (checked). The statistic of ``n`` draws from ``w`` is noncentral chi-square of
noncentrality ``n * sum((w - p)**2 / p)`` over the cells :func:`first_tokens.chi_square_p` forms
(:func:`first_tokens.chi_square_power`; a pair outside the target's support fails at once). Each
size in :data:`SIZES` is the least multiple of 25 keys that gives the control beside its test a
chance of at least :data:`first_tokens.POWER` (0.999) to fail. The coupled controls are strong
(with a filter, the head's first token often falls outside the target's support); the weakest,
the residual control at temperature 1, moves the joint by ``sum((w - p)**2 / p)`` of about 0.09
and needs 350 keys (375 with the DeepSeek layout). Only the residual test with top-p on the Qwen
layout and its control run in the quick suite; the others are ``statistical`` (``--full``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cache
from itertools import islice
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from first_tokens import POWER, THRESHOLD, chi_square_p, chi_square_power, exact_joint
from helpers import PROMPT
from mlx.utils import tree_map_with_path
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from tiny_models import randomize_norms, save_hf_folder, tiny_llama, tiny_mtp_pair

import mlx_spec
from mlx_spec import _mlx_lm, rules
from mlx_spec.acceptance import accept_sampled, matching_decision
from mlx_spec.draft_length import Outcome, Round
from mlx_spec.mtp import MTPDrafter, MTPHead, head_of, new_head
from mlx_spec.mtp_convert import load
from mlx_spec.sampling import make_sampler

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "mlx_spec" / "demo" / "target"


class Recorder(MTPDrafter):
    """An MTP drafter that records, for each proposal: the text's length ``L``, the logits of
    each draft position (the first from the head's step at position ``L - 2``, the next ones
    chained), the tokens drafted and the rows they were drawn from (``None`` but for
    ``"residual"``)."""

    def __init__(self, head: MTPHead) -> None:
        super().__init__(head)
        self.proposals: list[tuple[int, list[np.ndarray], list[int], np.ndarray | None]] = []

    def propose(self, text, n, keys):
        steps = [self._last] if self._last is not None and n else []
        run = self._run

        def recorded(hidden, embedded, depth):
            step = run(hidden, embedded, depth)
            steps.append(step)
            return step

        self._run = recorded
        try:
            draft = super().propose(text, n, keys)
        finally:
            del self._run
        if steps:
            logits = [np.array(s.logits[0], dtype=np.float64) for s in steps]
            probs = None if draft.probs is None else np.array(draft.probs, dtype=np.float64)
            self.proposals.append((len(text), logits, draft.tokens.tolist(), probs))
        return draft


# =================================================================================================
# 1. A head that must reproduce a known function of the target's hidden state.

#: The families whose heads are built, one per layout.
KNOWN = {"qwen3_5": "qwen", "glm4_moe": "deepseek"}
#: Drafted logits within this of the NumPy function (they are of order 10 here; float32 gives
#: about 1e-6, the variants below miss by more than 1e-2).
TOLERANCE = 1e-4
KNOWN_PROMPT = list(range(1, 11))
KNOWN_TOKENS = 40

# Each wrong variant, and the families it applies to.
VARIANTS = {
    "norm shift missing": ("qwen3_5",),
    "norm shift applied twice": ("qwen3_5",),
    "norm shifted where none is due": ("glm4_moe",),
    "concatenation [h, e]": ("qwen3_5", "glm4_moe"),
    "hidden state before the final norm": ("qwen3_5", "glm4_moe"),
    "chained state of the other layout": ("qwen3_5", "glm4_moe"),
}


@dataclass
class Known:
    """A family's checkpoint whose head computes a known function (the module's description)."""

    family: str
    folder: Path
    stored: dict[str, np.ndarray]  # the checkpoint's MTP weights, float64
    first: int  # the index of the first MTP layer in DeepSeek's layout (the target's layers)

    @property
    def layout(self) -> str:
        return KNOWN[self.family]

    def weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``fc`` and the norm weights ``w_e``, ``w_h``, ``w_n`` the published code applies to
        what the checkpoint stores: ``1 + w`` for Qwen's zero-centred norms."""
        if self.layout == "qwen":
            names = ("mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm")
            shift = 1.0
        else:
            layer = f"model.layers.{self.first}"
            names = tuple(f"{layer}.{n}" for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm"))
            shift = 0.0
        fc, *norms = (self.stored[f"{name}.weight"] for name in names)
        return fc, *(w + shift for w in norms)

    def target(self) -> nn.Module:
        model, _ = load(self.folder)
        return model


def identity_layers(head: MTPHead) -> None:
    """Zeroes the output projections of the head's decoder layers (attention, MLP, experts and
    shared experts): each layer then returns its input."""
    head.update(
        tree_map_with_path(
            lambda path, w: mx.zeros_like(w) if "o_proj" in path or "down_proj" in path else w,
            head.parameters(),
        )
    )


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """``known(family)``: the family's :class:`Known` checkpoint, written once for the module."""
    built: dict[str, Known] = {}

    def get(family: str) -> Known:
        if family not in built:
            model, head = tiny_mtp_pair(family)
            randomize_norms(getattr(model, "language_model", model).model.norm, 5)
            hidden = head.projections[0].weight.shape[0]
            mx.random.seed(9)
            mix = 0.5 * mx.random.normal((hidden, hidden)) / math.sqrt(hidden)
            for projection in head.projections:
                projection.weight = mx.concatenate([mx.eye(hidden), mix], axis=1)
            identity_layers(head)
            mx.eval(model.parameters(), head.parameters())
            folder = tmp_path_factory.mktemp(family) / "hf"
            save_hf_folder(folder, model, head, TOKENIZER)
            first = len(model.layers)
            stored = {}
            for file in folder.glob("*.safetensors"):
                for key, value in mx.load(str(file)).items():
                    if key.startswith(("mtp.", f"model.layers.{first}.")):
                        stored[key] = np.array(value.astype(mx.float32), dtype=np.float64)
            built[family] = Known(family, folder, stored, first)
        return built[family]

    return get


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def drafted_from(
    model: nn.Module,
    drafter: Recorder,
    prompt: list[int],
    num_draft_tokens: int = 2,
    policy: mlx_spec.DraftPolicy | None = None,
) -> tuple[list[int], mlx_spec.SpeculativeStats]:
    """The text of a greedy generation of :data:`KNOWN_TOKENS` tokens with ``drafter`` (and
    ``policy``, where given), and its counts; ``drafter`` records each round's logits."""
    stats = mlx_spec.SpeculativeStats()
    tokens = [
        t
        for t, _, _ in mlx_spec.speculative_generate_step(
            mx.array(prompt),
            model,
            drafter=drafter,
            num_draft_tokens=num_draft_tokens,
            max_tokens=KNOWN_TOKENS,
            stats=stats,
            policy=policy,
        )
    ]
    return prompt + tokens, stats


def drafted(model: nn.Module, drafter: Recorder) -> tuple[list[int], mlx_spec.SpeculativeStats]:
    """:func:`drafted_from` the known prompt, 2 draft tokens a round."""
    return drafted_from(model, drafter, KNOWN_PROMPT)


def miss(built: Known, model: nn.Module, drafter: Recorder, text: list[int]) -> float:
    """The largest distance between the drafter's logits and the NumPy function of the target's
    hidden states (the module's description), over every draft position it drafted."""
    lm = getattr(model, "language_model", model)
    eps = lm.args.rms_norm_eps
    embeddings = np.array(lm.model.embed_tokens.weight, dtype=np.float64)
    out = np.array(lm.lm_head.weight, dtype=np.float64)
    # The input of the target's LM head at every position: mlx-lm's backbone, whose last step is
    # its final norm, over the whole text at once.
    states = np.array(lm.model(mx.array(text)[None])[0], dtype=np.float64)
    fc, w_e, w_h, w_n = built.weights()

    def step(h: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
        z = fc @ np.concatenate([rms(embeddings[token], w_e, eps), rms(h, w_h, eps)])
        normed = rms(z, w_n, eps)
        return out @ normed, (normed if built.layout == "qwen" else z)

    worst = 0.0
    assert drafter.proposals
    for length, logits, tokens, _ in drafter.proposals:
        h = states[length - 2]
        for i, got in enumerate(logits):
            want, h = step(h, text[length - 1] if i == 0 else tokens[i - 1])
            worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.mark.parametrize("family", KNOWN)
def test_the_head_drafts_the_known_function_of_the_final_hidden_state(family, known):
    built = known(family)
    model = built.target()
    drafter = Recorder(head_of(model))
    text, stats = drafted(model, drafter)
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)
    assert any(len(logits) == 2 for _, logits, _, _ in drafter.proposals)
    assert miss(built, model, drafter, text) < TOLERANCE


class SwappedHalves(nn.Module):
    """A projection that reads its input's halves swapped: ``fc([e, h])`` becomes ``fc([h, e])``,
    what a head that concatenates in the other order computes."""

    def __init__(self, projection: nn.Module) -> None:
        super().__init__()
        self.projection = projection

    def __call__(self, x: mx.array) -> mx.array:
        half = x.shape[-1] // 2
        return self.projection(mx.concatenate([x[..., half:], x[..., :half]], axis=-1))


def before_the_final_norm(model: nn.Module) -> _mlx_lm.Split:
    """``model`` split so that the drafter reads the backbone's output before its final norm
    (which the head then applies): the target's logits are unchanged."""
    right = _mlx_lm.split(model)
    backbone, norm = right.backbone, right.backbone.norm

    def unnormed(tokens: mx.array, cache=None) -> mx.array:
        backbone.norm = nn.Identity()
        try:
            return backbone(tokens, cache=cache)
        finally:
            backbone.norm = norm

    return _mlx_lm.Split(unnormed, lambda x: right.head(norm(x)), right.embed, right.text)


@pytest.mark.parametrize(
    ("family", "variant"),
    [(family, variant) for variant, families in VARIANTS.items() for family in families],
)
def test_known_function_test_fails_for_the_wrong_variant(family, variant, known, monkeypatch):
    # Negative control: each variant is what a conversion or a head with that error gives; the
    # check above must see it.
    built = known(family)
    model = built.target()
    head = head_of(model)
    shifts = {
        "norm shift missing": -1.0,
        "norm shift applied twice": 1.0,
        "norm shifted where none is due": 1.0,
    }
    if variant in shifts:
        for norm in (*head.embed_norms, *head.hidden_norms, *head.norms):
            norm.weight = norm.weight + shifts[variant]
    elif variant == "concatenation [h, e]":
        head.projections = [SwappedHalves(p) for p in head.projections]
    elif variant == "hidden state before the final norm":
        wrong = before_the_final_norm(model)
        monkeypatch.setattr(_mlx_lm, "split", lambda m: wrong if m is model else None)
    else:
        head.layout = "deepseek" if head.layout == "qwen" else "qwen"
    drafter = Recorder(head)
    text, _ = drafted(model, drafter)
    assert miss(built, model, drafter, text) > 100 * TOLERANCE


# =================================================================================================
# 2. Sampled exactness.

VOCAB = 24
LAYOUTS = ("qwen", "deepseek")
RULES = ("coupled", "residual")
#: The samplers: temperature and filters.
CASES = {
    "temp 1": (1.0, {}),
    "top-p 0.8": (1.0, {"top_p": 0.8}),
    "top-k 5": (1.0, {"top_k": 5}),
    "min-p 0.1": (1.0, {"min_p": 0.1}),
}
#: Keys for each layout and sampler, under either rule: the least multiple of STEP that gives
#: both controls beside its tests a chance of at least POWER to fail (the residual one needs more
#: keys; test_each_control_fails_with_power). The DeepSeek layout, which changes only how the head
#: chains, is run at temperature 1.
SIZES = {
    ("qwen", "temp 1"): 350,
    ("qwen", "top-p 0.8"): 175,
    ("qwen", "top-k 5"): 250,
    ("qwen", "min-p 0.1"): 250,
    ("deepseek", "temp 1"): 375,
}
QUICK = ("qwen", "residual", "top-p 0.8")
STEP = 25


@cache
def target() -> nn.Module:
    """A 24-token llama whose layers weigh little, so that its next token depends mostly on the
    current one, as an MTP head's guess does."""
    return tiny_llama(3, vocab=VOCAB, head=4.0, scales=(0.5, 0.25))


@cache
def mtp_head(layout: str, layers: int = 1) -> MTPHead:
    """A head of random weights for :func:`target`: its projection passes the embedding and adds
    a random mix of the hidden state, its layers' matrices are scaled by 0.6, its norms drawn.
    Its first draft shares 0.5 to 0.6 of the target's first-token mass, so drafts are kept and
    rejected alike."""
    model = target()
    mx.random.seed(11)
    head = new_head(model, layout, layers)
    head.update(
        tree_map_with_path(
            lambda path, w: w * 0.6 if path.startswith("layers.") and "norm" not in path else w,
            head.parameters(),
        )
    )
    hidden = head.projections[0].weight.shape[0]
    for projection in head.projections:
        mix = mx.random.normal((hidden, hidden)) / math.sqrt(hidden)
        projection.weight = mx.concatenate([mx.eye(hidden), mix], axis=1)
    randomize_norms(head, 12)
    mx.eval(head.parameters())
    return head


@cache
def sampler(case: str):
    temp, filters = CASES[case]
    return make_sampler(temp=temp, **filters)


@cache
def expected(case: str) -> np.ndarray:
    """``[V, V]``: the joint of the first two tokens of sampling the target alone."""
    temp, filters = CASES[case]
    return exact_joint(target(), PROMPT, VOCAB, temp, **filters)


def pairs(layout: str, rule: str, case: str, samples: int) -> tuple[np.ndarray, int]:
    """``[V, V]`` counts of the first two tokens of ``samples`` generations with keys ``0, 1,
    ...`` (see the module's description), and how many first tokens came from the draft."""
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    kept = 0
    for i in range(samples):
        steps = mlx_spec.speculative_generate_step(
            mx.array(PROMPT),
            target(),
            drafter=MTPDrafter(mtp_head(layout)),
            num_draft_tokens=2,
            max_tokens=3,
            sampler=sampler(case),
            key=mx.random.key(i),
            acceptance=rule,
        )
        (first, _, from_draft), (second, _, _) = islice(steps, 2)
        steps.close()
        counts[first, second] += 1
        kept += from_draft
    return counts, kept


def first_kept_unchecked(choice, invalid, draft, eos):
    """A coupled decision that keeps the first draft token whatever the target drew there."""
    n = draft.size
    if n == 0:
        return matching_decision(choice, invalid, draft, eos)
    same = draft.astype(mx.uint32) == choice[:n].astype(mx.uint32)
    ok = mx.concatenate([mx.array([True]), same[1:]])
    accepted = mx.cumprod(ok.astype(mx.uint32)).sum()
    following = mx.take(choice.astype(mx.uint32), accepted)
    return mx.stack([accepted, following, mx.array(0, mx.uint32)])


def resampled_from_the_target(probs, tokens, draft_probs, eos, key, **options):
    """A residual decision that draws ``next`` after a rejection from ``p``, not the residual."""
    result = accept_sampled(probs, tokens, draft_probs, eos, key, **options)
    row = mx.take(probs, result[0], axis=0)
    token = mx.random.categorical(mx.log(row), key=mx.random.split(key)[1])
    return mx.stack([result[0], token.astype(mx.uint32), result[2]])


def with_wrong_rule(rule: str, monkeypatch) -> None:
    if rule == "coupled":
        monkeypatch.setattr(rules, "matching_decision", first_kept_unchecked)
    else:
        monkeypatch.setattr(rules, "sampled_decision", resampled_from_the_target)


def grid(quick: tuple[str, str, str]) -> list:
    """Every layout and sampler of :data:`SIZES` under each rule, as parameters:
    ``statistical`` but ``quick``."""
    heavy = pytest.mark.statistical
    return [
        pytest.param(layout, rule, case, marks=() if quick == (layout, rule, case) else heavy)
        for layout, case in SIZES
        for rule in RULES
    ]


def fit(counts: np.ndarray, joint: np.ndarray) -> float:
    """:func:`first_tokens.chi_square_p` of ``counts`` against ``joint``, 0 where a pair of
    probability 0 was drawn (as :func:`first_tokens.chi_square_power` counts it)."""
    if counts[joint == 0].sum():
        return 0.0
    return chi_square_p(counts, joint)


@pytest.mark.parametrize(("layout", "rule", "case"), grid(QUICK))
def test_first_two_tokens_have_the_target_distribution(layout, rule, case):
    samples = SIZES[layout, case]
    counts, kept = pairs(layout, rule, case, samples)
    assert 0 < kept < samples, kept  # first drafts both kept and rejected
    assert fit(counts, expected(case)) > THRESHOLD


@pytest.mark.parametrize(("layout", "rule", "case"), grid(QUICK))
def test_negative_control_wrong_acceptance_fails(layout, rule, case, monkeypatch):
    with_wrong_rule(rule, monkeypatch)
    counts, _ = pairs(layout, rule, case, SIZES[layout, case])
    assert fit(counts, expected(case)) < THRESHOLD


# -- the power calculation --------------------------------------------------------------------


def distribution(case: str, logits: mx.array) -> np.ndarray:
    """``[V]`` float64: what the generation's sampler draws from ``[1, V]`` logits."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(sampler(case).probs(logprobs), dtype=np.float64).reshape(-1)


@cache
def head_rows(layout: str, case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The head's distributions, by running the head: ``q1`` ``[V]``, its first draft after the
    prompt (from the target's states at positions ``0 .. P - 2``); ``q2[a]`` ``[V, V]``, its
    second, chained after drafting ``a``; and ``q2'[a]``, its draft after the target's ``a`` (from
    the target's state at ``P - 1``)."""
    model, head = target(), mtp_head(layout)
    embed, lm_head = model.model.embed_tokens, model.lm_head
    prompt = mx.array(PROMPT)[None]
    states = model.model(prompt)  # the input of the LM head at every prompt position
    seen = states[:, :-1]
    embedded = embed(prompt[:, 1:])
    if layout == "deepseek":  # no embedding at the text's first position (vLLM's deepseek_mtp)
        embedded = mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)
    cache = KVCache()
    mask = create_attention_mask(seen, cache, return_array=True)
    chain, normed = head(seen, embedded, 0, cache, mask)
    first = distribution(case, lm_head(normed[:, -1]))
    chained, fresh = np.zeros((VOCAB, VOCAB)), np.zeros((VOCAB, VOCAB))
    for token in range(VOCAB):
        e = embed(mx.array([[token]]))
        _, normed = head(chain[:, -1:], e, 1, cache)
        chained[token] = distribution(case, lm_head(normed[:, -1]))
        cache.trim(1)
        _, normed = head(states[:, -1:], e, 0, cache)
        fresh[token] = distribution(case, lm_head(normed[:, -1]))
        cache.trim(1)
    return first, chained, fresh


def clipped(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def the_target(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return p


def kept(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``[V]``: the chance of drafting each token and keeping it, ``q * min(1, p / q)``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, q * np.minimum(1.0, p / q), 0.0)


def emitted(p: np.ndarray, q: np.ndarray, residual) -> np.ndarray:
    """``[V]``: the token a residual rule emits at a position whose rows are ``p`` and ``q``."""
    keep = kept(p, q)
    return keep + (1 - keep.sum()) * residual(p, q)


def residual_joint(layout: str, case: str, residual) -> np.ndarray:
    """``[V, V]``: the first two tokens of the residual rule whose residual is ``residual``
    (the module's description)."""
    joint = expected(case)
    p1 = joint.sum(axis=1)
    q1, chained, fresh = head_rows(layout, case)
    keep = kept(p1, q1)
    rejected = (1 - keep.sum()) * residual(p1, q1)
    out = np.zeros_like(joint)
    for a in np.flatnonzero(p1 > 0):
        p2 = joint[a] / p1[a]
        out[a] = keep[a] * emitted(p2, chained[a], residual)
        out[a] += rejected[a] * emitted(p2, fresh[a], residual)
    return out


def wrong_joint(layout: str, rule: str, case: str) -> np.ndarray:
    """``[V, V]``: the first two tokens of the control beside ``(layout, rule, case)``."""
    if rule == "residual":
        return residual_joint(layout, case, the_target)
    joint = expected(case)
    p1 = joint.sum(axis=1)
    q1, _, _ = head_rows(layout, case)
    out = np.zeros_like(joint)
    for a in range(VOCAB):
        # After a first token the target cannot emit, where the second falls does not matter:
        # the pair is outside the target's support.
        out[a] = q1[a] * joint[a] / p1[a] if p1[a] > 0 else np.eye(VOCAB)[0] * q1[a]
    return out


def power(layout: str, rule: str, case: str, samples: int) -> float:
    found = chi_square_power(expected(case), wrong_joint(layout, rule, case), samples)
    return found if math.isfinite(found) else 0.0


@pytest.mark.parametrize(("layout", "case"), SIZES)
def test_each_control_fails_with_power(layout, case):
    # SIZES is the least multiple of STEP keys with that power for both controls. Guarded: the
    # closed form gives the target's joint for the right rule.
    right = residual_joint(layout, case, clipped)
    np.testing.assert_allclose(right, expected(case), atol=1e-9)
    samples = SIZES[layout, case]
    assert min(power(layout, rule, case, samples) for rule in RULES) >= POWER
    assert min(power(layout, rule, case, samples - STEP) for rule in RULES) < POWER


@pytest.mark.parametrize(("layout", "case"), [("qwen", "top-p 0.8"), ("deepseek", "temp 1")])
def test_the_power_calculation_reads_the_drafters_own_rows(layout, case):
    # The rows head_rows computes are those the drafter draws its tokens from, in every way it
    # drafts (first, chained, after a rejection), over the runs of 40 keys.
    q1, chained, fresh = head_rows(layout, case)
    seen = set()
    for i in range(40):
        drafter = Recorder(mtp_head(layout))
        steps = mlx_spec.speculative_generate_step(
            mx.array(PROMPT),
            target(),
            drafter=drafter,
            num_draft_tokens=2,
            max_tokens=3,
            sampler=sampler(case),
            key=mx.random.key(i),
            acceptance="residual",
        )
        text = PROMPT + [t for t, _, _ in steps]
        for length, _, tokens, probs in drafter.proposals:
            if length == len(PROMPT):
                want = [q1, chained[tokens[0]]][: len(tokens)]
                seen.add("first" if len(tokens) == 1 else "chained")
            elif length == len(PROMPT) + 1:
                want = [fresh[text[length - 1]]]
                seen.add("after a rejection")
            else:
                continue
            np.testing.assert_allclose(probs, np.stack(want), atol=1e-6)
    assert seen == {"chained", "after a rejection"}


# =================================================================================================
# A head of several layers keeps its cache as the target verified the text.


class Scripted:
    """A draft-length policy that takes its lengths from ``lengths`` in turn, one a choice (the
    loop asks again after every plain step)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = itertools.cycle(lengths)

    def choose(self, round: Round) -> int:
        return min(next(self.lengths), round.cap)

    def observe(self, outcome: Outcome) -> None:
        pass


@pytest.mark.parametrize(
    "lengths", [[3], [0, 0, 0, 0, 3, 3]], ids=["rounds", "rounds and plain steps"]
)
def test_a_head_of_several_layers_drafts_from_every_verified_position(lengths):
    # Each draft step feeds one layer's cache (step i, layer i mod 2); the entries a draft adds
    # are taken back after the round, each layer its own. So at every proposal the drafter's
    # logits are those of the head run afresh: layer 0 over the target's states at every
    # position verified so far, layer 1 over the round's chain alone. Positions emitted by plain
    # steps are seen at the end of their stretch, all at once.
    model, head = target(), mtp_head("deepseek", 2)
    drafter = Recorder(head)
    text, stats = drafted_from(model, drafter, PROMPT, 3, Scripted(lengths))
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)
    assert len(drafter.proposals) >= 4
    states = model.model(mx.array(text)[None])
    embed = model.model.embed_tokens
    worst = 0.0
    for length, logits, tokens, _ in drafter.proposals:
        seen = states[:, : length - 1]
        embedded = embed(mx.array(text[1:length])[None])
        embedded = mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)
        caches = [KVCache(), KVCache()]
        mask = create_attention_mask(seen, caches[0], return_array=True)
        chain, normed = head(seen, embedded, 0, caches[0], mask)
        chain = chain[:, -1:]
        want = [model.lm_head(normed[:, -1])]
        for depth, token in enumerate(tokens[:-1], start=1):
            e = embed(mx.array([[token]]))
            chain, normed = head(chain, e, depth, caches[depth % 2])
            want.append(model.lm_head(normed[:, -1]))
        for got, row in zip(logits, want, strict=True):
            worst = max(worst, float(np.abs(got - np.array(row[0], dtype=np.float64)).max()))
    assert worst < TOLERANCE
