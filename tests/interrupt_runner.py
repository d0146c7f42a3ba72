"""The worker of ``test_fuzz.py``'s interrupt test: generations that SIGINTs cut short.

It runs speculative generations on tiny models, one after another, each announced with a line
``go``; the test sends SIGINTs at random moments within the time an uninterrupted generation of
the same setup took here (announced first, with ``ready``, so that the signals land during the
generations on a fast machine and a slow one alike). Only while a generation runs does a SIGINT
raise ``KeyboardInterrupt`` (the handler is armed then), wherever it lands: in the model, the
acceptance, the caches' rewinds, the drafter. After each generation, cut short or not, the
worker checks the guarantee: every cache holds the prompt and the tokens yielded, and the next
turn on those caches continues plain greedy decoding. It prints one JSON line per generation.

Usage: ``python interrupt_runner.py GENERATIONS``.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import cut, tiny_llama, tiny_qwen2, tiny_qwen3_next

from mlx_spec.generation import SpeculativeStats, speculative_generate_step

PROMPT = [1, 2, 3, 4, 5]
armed = False


def _interrupt(number, frame):
    if armed:
        raise KeyboardInterrupt


def _setups():
    """``(name, target, draft, cache maker, options)``: appending, rotating and hybrid caches,
    with a draft model and with prompt lookup."""
    llama, qwen2, hybrid = tiny_llama(0), tiny_qwen2(0), tiny_qwen3_next(0)
    return [
        ("llama, draft model", llama, cut(llama, 1), lambda m: make_prompt_cache(m), {}),
        ("llama, lookup", llama, None, lambda m: make_prompt_cache(m), {}),
        ("qwen2, rotating, draft", qwen2, cut(qwen2, 1), lambda m: make_prompt_cache(m, 12), {}),
        ("qwen3-next, draft", hybrid, cut(hybrid, 2), lambda m: make_prompt_cache(m), {}),
    ]


def generate(target, draft, make, options, cache=None, stats=None):
    """The speculative generation of a setup, on ``cache`` (fresh caches by default), counting
    into ``stats``."""
    if cache is None:
        cache = make(target) + (make(draft) if draft is not None else [])
    drafting = {} if draft is not None else {"drafter": "prompt-lookup"}
    return speculative_generate_step(
        mx.array(PROMPT), target, draft, num_draft_tokens=3, max_tokens=100,
        prompt_cache=cache, stats=stats, **drafting, **options,
    )  # fmt: skip


def main() -> None:
    global armed
    signal.signal(signal.SIGINT, _interrupt)
    setups = _setups()
    references = {}
    seconds = {}
    for name, target, draft, make, options in setups:
        steps = generate_step(mx.array(PROMPT), target, max_tokens=120, prompt_cache=make(target))
        references[name] = [t for t, _ in steps]
        for _ in range(2):  # the second is timed: the first also compiles
            start = time.perf_counter()
            for _ in generate(target, draft, make, options):
                pass
            seconds[name] = time.perf_counter() - start
    print(json.dumps({"ready": True, "seconds": seconds}), flush=True)
    for _, (name, target, draft, make, options) in zip(
        range(int(sys.argv[1])), itertools.cycle(setups), strict=False
    ):
        cache = make(target) + (make(draft) if draft is not None else [])
        yielded, interrupted, started = [], False, False
        stats = SpeculativeStats()
        print(json.dumps({"go": name}), flush=True)
        armed = True
        try:
            steps = generate(target, draft, make, options, cache, stats)
            # Cut short before this, the call changed nothing: the caches still hold nothing.
            started = True
            for token, _, _ in steps:
                yielded.append(token)
            armed = False  # a signal before this line is caught below
        except KeyboardInterrupt:
            armed, interrupted = False, True
        if started:
            # Landed in this loop's own lines, the interrupt left the generation suspended at a
            # yield: the guarantee holds once it is closed, as a caller's `with` or `del` would.
            steps.close()
        # What the generation handed out: a signal between a yield and the append above leaves
        # the last token unrecorded here.
        count = stats.generated
        reference = references[name]
        held = sorted({c.offset for c in cache if hasattr(c, "offset")})
        fed = [reference[count]] if started else PROMPT
        steps = generate_step(
            mx.array(fed), target, max_tokens=5, prompt_cache=cache[: len(make(target))]
        )
        more = [t for t, _ in steps]
        print(json.dumps({
            "setup": name,
            "interrupted": interrupted,
            "yielded": count,
            "text ok": yielded == reference[: len(yielded)] and count - 1 <= len(yielded) <= count,
            "offsets": held,
            "expected offset": len(PROMPT) + count if started else 0,
            "continues": more == reference[count + started : count + started + 5],
        }), flush=True)  # fmt: skip
    # A signal sent as the last generation ended must not end the process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
