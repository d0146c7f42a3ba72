"""The worker of ``test_fuzz.py``: calls the public functions on fuzzed arguments in a process of
its own, so that a segmentation fault or a hang ends this process and not the test run.

A case is ``(function, arguments)``: the name of a function in :data:`CALLS` and a dict of its
arguments, encoded as plain data that pickles (:class:`Arr` for an array, :class:`Named` for an
object built here, such as a model, a stream or a function). The reply says how the call ended
(``"ok"``, ``"ValueError"`` or ``"error"`` for any other exception) and, for ``"ok"``, the facts
the test judges the result by: the arguments as NumPy arrays, what the function returned, and a
reference computed with mlx-lm's own functions where there is one. Judging is left to the test.

Protocol: each message is a pickle after its length (8 bytes, big-endian); cases come on stdin,
replies go to the process's original stdout. What a call prints goes to stderr, and
``faulthandler`` writes the Python stack there on a crash.
"""

from __future__ import annotations

import faulthandler
import functools
import itertools
import os
import pickle
import struct
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The most tokens a generation case reads: enough to cross a few rounds, few enough to be quick.
TAKE = 6

#: Token ids past the end of the target's vocabulary (:func:`tiny_models.tiny_llama`'s).
VOCAB = 256


@dataclass(frozen=True)
class Arr:
    """An array built from ``values``.

    Attributes:
        values (np.ndarray): the elements, already of the NumPy type closest to ``dtype``
            (float32 for bfloat16).
        dtype (str): an ``mx`` dtype name (``"int32"``, ``"bfloat16"``, ...).
        numpy (bool): hand over the NumPy array instead of an ``mx.array``.
        view (str, optional): build the same values with other strides: ``"T"``, the
            transpose of a transposed copy; ``"step"``, every other row of a larger array.
    """

    values: np.ndarray
    dtype: str
    numpy: bool = False
    view: str | None = None

    def __repr__(self) -> str:
        where = "np" if self.numpy else "mx"
        view = f", view={self.view!r}" if self.view else ""
        return f"Arr({where}.{self.dtype}{list(self.values.shape)}: {self.values.tolist()!r}{view})"


@dataclass(frozen=True)
class Named:
    """An object built here by name (see :func:`_named`): a model, a stream, a function..."""

    name: str


@dataclass(frozen=True)
class Case:
    """One call: ``function`` on ``arguments`` (names to encoded values).

    Attributes:
        function (str): a key of :data:`CALLS`.
        arguments (dict): argument name to value, passed by keyword.
        bad (tuple): the arguments the case draws a bad value for; the rest are good.
    """

    function: str
    arguments: dict[str, Any] = field(default_factory=dict)
    bad: tuple[str, ...] = ()


# -- building the arguments -------------------------------------------------------------------


@functools.cache
def models() -> dict[str, Any]:
    """The tiny models the generation cases use, built once per process."""
    import mlx.core as mx
    from tiny_models import cut, tiny_llama, tiny_qwen2

    target = tiny_llama(0)
    # A draft with a larger vocabulary whose first rows are the target's: it proposes ids the
    # target cannot embed wherever its extra rows win.
    big = tiny_llama(5, vocab=VOCAB + 64)
    for mine, theirs in [
        (target.model.embed_tokens, big.model.embed_tokens),
        (target.lm_head, big.lm_head),
    ]:
        extra = 20.0 * mx.random.normal((64, mine.weight.shape[1]), key=mx.random.key(9))
        theirs.weight = mx.concatenate([mine.weight, extra])
    mx.eval(big.parameters())
    return {
        "target": target,
        "draft": cut(target, 1),
        "unrelated": tiny_llama(7),
        "big-draft": big,
        # Heads of 32 dimensions, which caches quantized in groups of 32 take:
        "narrow-heads": tiny_llama(1, heads=2),
        "qwen2": tiny_qwen2(3),  # no make_cache: max_kv_size makes caches that keep 4 tokens
    }


def _huge_drafter() -> Any:
    """A drafter of one's own that proposes int32 ids the target cannot embed."""
    import mlx.core as mx

    from mlx_spec.drafters import Draft, Drafter

    class Huge(Drafter):
        def propose(self, text, n, key):
            ids = [-(2**31), 2**31 - 1, -1, VOCAB][:n]
            return Draft(mx.array(ids, dtype=mx.int32))

    return Huge()


def _filled_caches(name: str) -> list[Any]:
    """Caches of model ``name`` and its one-layer cut holding a few tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import cut

    model = models()[name]
    caches = []
    for m in (model, cut(model, 1)):
        cache = make_prompt_cache(m)
        m(mx.array([[1, 2, 3]]), cache=cache)
        mx.eval([c.state for c in cache])
        caches += cache
    return caches


def _named(name: str) -> Any:
    import mlx.core as mx
    from helpers import ByteTokenizer
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    from mlx_spec.drafters import PromptLookupDrafter
    from mlx_spec.generation import SpeculativeStats
    from mlx_spec.sampling import make_sampler

    m = models()
    builders = {
        "object": object,
        "fn": lambda: lambda *args, **kwargs: None,
        "class": lambda: PromptLookupDrafter,
        "cpu": lambda: mx.cpu,
        "gpu": lambda: mx.gpu,
        "cpu-device": lambda: mx.Device(mx.cpu),
        "gpu-device": lambda: mx.Device(mx.gpu),
        "cpu-stream": lambda: mx.default_stream(mx.cpu),
        "target": lambda: m["target"],
        "draft": lambda: m["draft"],
        "unrelated": lambda: m["unrelated"],
        "big-draft": lambda: m["big-draft"],
        "argmax": lambda: lambda logprobs: mx.argmax(logprobs, axis=-1),
        "mlx-lm-greedy": lambda: greedy_sampler,
        "spec-greedy": lambda: make_sampler(temp=0.0),
        "identity-processor": lambda: lambda tokens, logits: logits,
        "progress": lambda: lambda done, total: None,
        "stats": SpeculativeStats,
        "lookup": PromptLookupDrafter,
        "huge-ids": _huge_drafter,
        "tokenizer": ByteTokenizer,
        "fresh-caches": lambda: make_prompt_cache(m["target"]) + make_prompt_cache(m["draft"]),
        "target-caches": lambda: make_prompt_cache(m["target"]),
        "caches-of-strings": lambda: ["a", "b", "c"],
        "caches-of-another-kind": lambda: [ArraysCache(2), KVCache(), KVCache()],
        "caches-of-another-model": lambda: _filled_caches("narrow-heads"),
    }
    return builders[name]()


_MX_DTYPES = (
    "bool_ uint8 uint16 uint32 uint64 int8 int16 int32 int64 float16 bfloat16 float32 float64 "
    "complex64"
).split()


def _array(spec: Arr) -> Any:
    import mlx.core as mx

    values = spec.values
    if spec.view == "T":
        values = np.ascontiguousarray(values.T)
    elif spec.view == "step":
        values = np.repeat(values, 2, axis=0)
    if spec.numpy:
        a = values
    else:
        dtype = getattr(mx, spec.dtype)
        # Through NumPy: mx.array of a Python int at or above 2**63 fails (std::bad_cast). NumPy
        # has no bfloat16, and MLX makes float32 of NumPy's float64 (kept on the CPU, the one
        # backend with float64).
        a = mx.array(values)
        if a.dtype != dtype:
            a = a.astype(dtype, stream=mx.cpu)
    if spec.view == "T":
        a = a.T
    elif spec.view == "step":
        a = a[::2]
    return a


def build(value: Any) -> Any:
    """The object ``value`` encodes; containers are built element by element."""
    if isinstance(value, Arr):
        return _array(value)
    if isinstance(value, Named):
        return _named(value.name)
    if isinstance(value, list):
        return [build(v) for v in value]
    if isinstance(value, tuple):
        return tuple(build(v) for v in value)
    if isinstance(value, dict):
        return {k: build(v) for k, v in value.items()}
    return value


# -- the calls ----------------------------------------------------------------------------------


def _np(a: Any, dtype: Any = None) -> np.ndarray | None:
    """An array argument the function accepted, as NumPy (``None`` stays ``None``)."""
    import mlx.core as mx

    if a is None:
        return None
    if isinstance(a, mx.array) and a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    out = np.array(a)
    return out.astype(dtype) if dtype is not None else out


def _read(result: Any, facts: dict[str, Any]) -> dict[str, Any]:
    """Adds ``read``'s verdict on ``result``, or its error, to ``facts``."""
    from mlx_spec import read

    try:
        facts["verdict"] = read(result)
    except ValueError as error:
        facts["read_error"] = str(error)
    return facts


def call_accept_greedy(a: dict[str, Any]) -> dict[str, Any]:
    from mlx_spec import accept_greedy

    result = accept_greedy(a["logits"], a["draft"], a["eos"], fused=a["fused"], stream=a["stream"])
    facts = {
        "logits": _np(a["logits"], np.float32),
        "draft": _np(a["draft"], np.int64),
        "eos": _np(a["eos"], np.int64),
    }
    return _read(result, facts)


def call_accept_sampled(a: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from mlx_spec import accept_sampled

    result = accept_sampled(
        a["probs"], a["draft"], a["draft_probs"], a["eos"], a["key"], fused=a["fused"],
        stream=a["stream"],
    )  # fmt: skip
    n = a["draft"].shape[0]
    facts = {
        "probs": _np(a["probs"], np.float32),
        "draft": _np(a["draft"], np.int64),
        "draft_probs": _np(a["draft_probs"], np.float32),
        "eos": _np(a["eos"], np.int64),
        # The uniforms the docstring says the key draws.
        "uniforms": _np(mx.random.uniform(shape=(n + 1,), key=a["key"])),
    }
    return _read(result, facts)


def call_read(a: dict[str, Any]) -> dict[str, Any]:
    from mlx_spec import read

    verdict = read(a["result"])
    return {"result": _np(a["result"]), "verdict": verdict}


def _mask_reference(function: str, a: dict[str, Any]) -> np.ndarray | None:
    """The tokens mlx-lm's own filter keeps, where it takes the parameters."""
    from mlx_lm import sample_utils as lm

    logprobs = a["logprobs"]
    if function == "top_p_mask" and 0 < a["top_p"] < 1:
        return np.isfinite(_np(lm.apply_top_p(logprobs, a["top_p"])))
    if function == "min_p_mask" and 0 < a["min_p"] and a["min_tokens_to_keep"] < logprobs.shape[-1]:
        kept = lm.apply_min_p(logprobs, a["min_p"], a["min_tokens_to_keep"])
        return np.isfinite(_np(kept))
    if function == "top_k_mask" and 0 < a["top_k"] < logprobs.shape[-1]:
        return np.isfinite(_np(lm.apply_top_k(logprobs, int(a["top_k"]))))
    return np.ones(logprobs.shape, dtype=bool)  # the filter is off


def _call_mask(function: str, a: dict[str, Any]) -> dict[str, Any]:
    from mlx_spec import sampling

    mask = getattr(sampling, function)(**a)
    return {
        "logprobs": _np(a["logprobs"], np.float32),
        "mask": _np(mask),
        "mask_dtype": str(mask.dtype),
        "reference": _mask_reference(function, a),
    }


def _sampler_facts(sampler: Any, logprobs: Any) -> dict[str, Any]:
    """What a sampler does on ``logprobs``: its distribution and one draw."""
    import mlx.core as mx

    mx.random.seed(0)
    return {
        "logprobs": _np(logprobs, np.float32),
        "probs": _np(sampler.probs(logprobs)),
        "probs_dtype": str(sampler.probs(logprobs).dtype),
        "tokens": _np(sampler(logprobs), np.int64),
        "greedy": sampler.greedy,
    }


#: ``[2, 8]`` log-probabilities a sampler made by a case is tried on (some -inf).
with np.errstate(divide="ignore"):
    _LOGPROBS = np.log(
        [[0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02], [0.5, 0.4, 0.09, 0.01, 0, 0, 0, 0]]
    ).astype(np.float32)


def call_make_sampler(a: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from mlx_spec import make_sampler

    sampler = make_sampler(**a)
    facts = _sampler_facts(sampler, mx.array(_LOGPROBS))
    facts["fields"] = {k: getattr(sampler, k) for k in a}
    return facts


def call_spec_sampler(a: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from mlx_spec import SpecSampler

    sampler = SpecSampler(**a)
    facts = _sampler_facts(sampler, mx.array(_LOGPROBS))
    facts["fields"] = {k: getattr(sampler, k) for k in a}
    return facts


def _call_spec_sampler(method: str, a: dict[str, Any]) -> dict[str, Any]:
    from mlx_spec import SpecSampler

    sampler = SpecSampler(**a["sampler"])
    out = getattr(sampler, method)(a["logprobs"])
    return {
        "logprobs": _np(a["logprobs"], np.float32),
        "out": _np(out),
        "out_dtype": str(out.dtype),
        "greedy": sampler.greedy,
        # What a token drawn by __call__ is judged by.
        "probs": _np(sampler.probs(a["logprobs"])),
    }


@functools.lru_cache(maxsize=64)
def _plain(model: str, prompt: tuple[int, ...]) -> list[int]:
    """mlx-lm's plain greedy decoding of ``model`` after ``prompt``: :data:`TAKE` tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), models()[model], max_tokens=TAKE)
    return [t for t, _ in steps]


def _model_name(model: Any) -> str:
    return next(k for k, v in models().items() if v is model)


def call_speculative_generate_step(a: dict[str, Any]) -> dict[str, Any]:
    from mlx_spec.generation import speculative_generate_step

    steps = speculative_generate_step(**a)
    try:
        tokens = [t for t, _, _ in itertools.islice(steps, TAKE)]
    finally:
        steps.close()
    prompt = tuple(_np(a["prompt"], np.int64).tolist())
    stats, eos = a.get("stats"), a.get("eos_token_ids")
    return {
        "tokens": tokens,
        "plain": _plain(_model_name(a["model"]), prompt),
        "eos": [] if eos is None else [int(i) for i in eos],
        "max_tokens": a.get("max_tokens", 256),
        "drafted": None if stats is None else stats.drafted,
    }


def _lm_stream(model: Any, tokenizer: Any, prompt: Any, max_tokens: int, **kwargs: Any) -> list:
    """mlx-lm's own ``stream_generate`` (no draft): the tokens of at most :data:`TAKE`
    responses."""
    from mlx_spec._mlx_lm import lm

    responses = lm.stream_generate(model, tokenizer, prompt, max_tokens, **kwargs)
    return [r.token for r in itertools.islice(responses, TAKE)]


def call_stream_generate(a: dict[str, Any]) -> dict[str, Any]:
    from mlx_spec.generation import stream_generate

    responses = stream_generate(**a)
    try:
        tokens = [r.token for r in itertools.islice(responses, TAKE)]
    finally:
        responses.close()
    plain_max = a["max_tokens"] if 0 < a["max_tokens"] < TAKE else TAKE
    options = {"max_kv_size": a["max_kv_size"]} if "max_kv_size" in a else {}
    plain = _lm_stream(a["model"], a["tokenizer"], a["prompt"], plain_max, **options)
    return {"tokens": tokens, "plain": plain}


def call_generate(a: dict[str, Any]) -> dict[str, Any]:
    from mlx_lm.generate import generate as lm_generate

    from mlx_spec.generation import generate

    text = generate(**a)
    plain = lm_generate(a["model"], a["tokenizer"], a["prompt"], max_tokens=a["max_tokens"])
    return {"text": text, "plain": plain}


def call_prompt_lookup_drafter(a: dict[str, Any]) -> dict[str, Any]:
    """Makes the drafter and drafts a greedy generation with it."""
    import mlx.core as mx

    from mlx_spec.drafters import PromptLookupDrafter

    drafter = PromptLookupDrafter(**a)
    facts = call_speculative_generate_step(
        {
            "prompt": mx.array([1, 2, 3, 1, 2, 3, 1, 2]),
            "model": models()["target"],
            "drafter": drafter,
            "num_draft_tokens": 4,
        }
    )
    facts["fields"] = {k: getattr(drafter, k) for k in a}
    return facts


def call_patch_mlx_lm(a: dict[str, Any]) -> dict[str, Any]:
    import importlib

    from mlx_spec import generation, patch

    # The module: the package exports a function under the same name.
    lm_module = importlib.import_module("mlx_lm.generate")

    patch.patch_mlx_lm(**a)
    try:
        patched = lm_module.speculative_generate_step is generation.speculative_generate_step
        lookup = patch._options["prompt_lookup"]
    finally:
        patch.unpatch_mlx_lm()
    return {"patched": patched, "prompt_lookup": lookup}


def _own_drafter(proposal: Any, free: bool) -> Any:
    """A drafter of one's own whose first proposal is ``proposal`` (whatever it is) and whose
    later ones are empty; it notes the ``n`` of each call."""
    import mlx.core as mx

    from mlx_spec.drafters import Draft, Drafter

    class Own(Drafter):
        def __init__(self) -> None:
            self.asked: list[int] = []

        def propose(self, text, n, keys):
            self.asked.append(n)
            return proposal if len(self.asked) == 1 else Draft(mx.array([], dtype=mx.uint32))

    Own.free = free
    return Own()


def _seeded(seed: int, steps: Any) -> list[int]:
    """The tokens of the generator ``steps`` (made lazily) after ``mx.random.seed(seed)``."""
    import mlx.core as mx

    mx.random.seed(seed)
    out = steps()
    try:
        return [int(step[0]) for step in itertools.islice(out, TAKE)]
    finally:
        out.close()


def call_own_drafter(a: dict[str, Any]) -> dict[str, Any]:
    """A generation whose drafter proposes ``a["proposal"]`` once: built from ``tokens``,
    ``probs`` and ``label`` when ``a["draft"]``, else the value itself. At ``temp`` 0 the
    reference is mlx-lm's greedy decoding, above it mlx-lm's sampling under the same seed."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler as lm_sampler

    from mlx_spec.drafters import Draft
    from mlx_spec.generation import speculative_generate_step
    from mlx_spec.sampling import make_sampler

    p = a["proposal"]
    proposal = Draft(p["tokens"], p["probs"], label=p["label"]) if a["draft"] else p
    drafter = _own_drafter(proposal, a["free"])
    model, prompt = models()["target"], a["prompt"]
    tokens = _seeded(
        a["seed"],
        lambda: speculative_generate_step(
            prompt,
            model,
            drafter=drafter,
            num_draft_tokens=a["num_draft_tokens"],
            max_tokens=TAKE,
            sampler=make_sampler(temp=a["temp"]),
        ),
    )
    plain = _seeded(
        a["seed"],
        lambda: generate_step(prompt, model, max_tokens=TAKE, sampler=lm_sampler(temp=a["temp"])),
    )
    return {"tokens": tokens, "plain": plain, "asked": drafter.asked}


def call_cache_settings(a: dict[str, Any]) -> dict[str, Any]:
    """Greedy turns on one reused cache of ``a["model"]`` (``"narrow-heads"`` or ``"qwen2"``),
    by mlx-spec's ``stream_generate`` with a drafter (its one-layer cut, or prompt lookup) and
    by mlx-lm's, under the same cache settings (``kv_bits``, ``quantized_kv_start``,
    ``max_kv_size``); the tokens of each turn, mlx-lm's error, or mlx-spec's refusal."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import cut

    from mlx_spec._mlx_lm import lm
    from mlx_spec.generation import stream_generate

    target, tokenizer = models()[a["model"]], _named("tokenizer")
    settings = {k: a[k] for k in ("kv_bits", "quantized_kv_start") if a[k] is not None}
    settings["kv_group_size"] = 32
    if a["drafter"] == "lookup":
        drafting, drafts = {"drafter": "prompt-lookup"}, [target]
    else:
        draft = cut(target, 1)
        drafting, drafts = {"draft_model": draft}, [target, draft]

    def turns(generate: Any, models_: list[Any]) -> list[list[int]]:
        cache = [c for model in models_ for c in make_prompt_cache(model, a["max_kv_size"])]
        out = []
        for prompt in a["turns"]:
            responses = generate(mx.array(prompt), cache)
            out.append([r.token for r in itertools.islice(responses, a["tokens"])])
            responses.close()
        return out

    facts = {}
    try:
        facts["plain"] = turns(
            lambda prompt, cache: lm.stream_generate(
                target, tokenizer, prompt, a["tokens"], prompt_cache=cache, **settings
            ),
            [target],
        )
    except Exception as error:  # what mlx-lm's own decoding does not handle
        facts["plain_error"] = f"{type(error).__name__}: {error}"
    try:
        facts["tokens"] = turns(
            lambda prompt, cache: stream_generate(
                target, tokenizer, prompt, a["tokens"], prompt_cache=cache,
                num_draft_tokens=a["num_draft_tokens"], **drafting, **settings,
            ),
            drafts if a["drafter"] == "draft" else [target],
        )  # fmt: skip
    except ValueError as error:
        facts["refusal"] = str(error)
    return facts


def call_crash(a: dict[str, Any]) -> dict[str, Any]:
    """Not a public function: a segmentation fault, for the test of the worker itself."""
    import ctypes

    return ctypes.string_at(0)


def call_sleep(a: dict[str, Any]) -> dict[str, Any]:
    """Not a public function: a hang, for the test of the worker itself."""
    import time

    time.sleep(a["seconds"])
    return {}


def call_plain(a: dict[str, Any]) -> dict[str, Any]:
    """Not a public function: mlx-lm's greedy decoding, for tests that guard a case."""
    return {"tokens": _plain(a["model"], tuple(a["prompt"]))}


CALLS = {
    "crash": call_crash,
    "sleep": call_sleep,
    "plain": call_plain,
    "accept_greedy": call_accept_greedy,
    "accept_sampled": call_accept_sampled,
    "read": call_read,
    "top_p_mask": functools.partial(_call_mask, "top_p_mask"),
    "min_p_mask": functools.partial(_call_mask, "min_p_mask"),
    "top_k_mask": functools.partial(_call_mask, "top_k_mask"),
    "make_sampler": call_make_sampler,
    "SpecSampler": call_spec_sampler,
    "SpecSampler.__call__": functools.partial(_call_spec_sampler, "__call__"),
    "SpecSampler.probs": functools.partial(_call_spec_sampler, "probs"),
    "speculative_generate_step": call_speculative_generate_step,
    "stream_generate": call_stream_generate,
    "generate": call_generate,
    "PromptLookupDrafter": call_prompt_lookup_drafter,
    "patch_mlx_lm": call_patch_mlx_lm,
    "own_drafter": call_own_drafter,
    "cache_settings": call_cache_settings,
}


def run(case: Case) -> dict[str, Any]:
    """Calls ``case``; returns how it ended (see the module's description)."""
    try:
        facts = CALLS[case.function](build(case.arguments))
    except ValueError as error:
        return {"kind": "ValueError", "message": str(error)}
    except Exception as error:  # the test reports any other exception as a failure
        return {
            "kind": "error",
            "type": type(error).__name__,
            "message": str(error),
            "traceback": traceback.format_exc(),
        }
    return {"kind": "ok", "facts": facts}


def _receive(stream: Any) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        return None
    return pickle.loads(stream.read(struct.unpack(">Q", header)[0]))


def _send(stream: Any, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the calls print must not reach the replies
    faulthandler.enable()
    _send(replies, "ready")
    while (case := _receive(sys.stdin.buffer)) is not None:
        _send(replies, run(case))


if __name__ == "__main__":
    main()
