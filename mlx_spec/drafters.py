"""What proposes draft tokens: a draft model, or prompt lookup over the text so far.

A :class:`Drafter` proposes up to ``n`` tokens after the text, lazily, with or without the
distributions they were drawn from, and is told after each round how many of them were kept.
Two ship:

- :class:`ModelDrafter`: a small model with the target's tokenizer, run token by token on its own
  caches (rolled back exactly after each round, recurrent and sliding-window ones included);
- :class:`PromptLookupDrafter`: no second model; it finds the latest earlier occurrence of the
  text's last n-gram and proposes what followed it, from an index kept up to date as the text
  grows, so a proposal costs a few dictionary lookups whatever the length of the text.

A third, :class:`~mlx_spec.mtp.MTPDrafter` (a model's own multi-token prediction head), is
defined in :mod:`mlx_spec.mtp`, which builds on this module, and exported here too.

Lookup drafts are deterministic: a sampled generation keeps such a draft token ``d`` with
probability ``p(d)``, lossless at any temperature. With ``distribution=True`` and a sampled
generation, a lookup draft is instead drawn, as the generation's rule draws
(:meth:`mlx_spec.rules.Rule.draw`), from the frequencies of the continuations the text holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .caches import ModelCache
from .rules import Rule

if TYPE_CHECKING:
    from .loop import Text
    from .mtp import MTPDrafter

__all__ = [
    "MAX_NGRAM",
    "Draft",
    "DraftSetup",
    "Drafter",
    "MTPDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
]

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

#: The longest n-gram prompt lookup matches: each token added to the text is indexed once per
#: n-gram size, so the size bounds the work of a round.
MAX_NGRAM = 32


@dataclass(frozen=True)
class Draft:
    """Draft tokens proposed for one round.

    Attributes:
        tokens (array): ``[n]`` uint32 tokens, lazy.
        probs (array, optional): ``[n, V_d]`` float32 distributions the tokens were drawn from
            (any ``V_d``: the loop pads or cuts them to the target's vocabulary); ``None`` for
            deterministic drafts (a point mass on each token).
        steps (int): model calls made to propose them, for the choice of draft lengths.
        label (int): the kind of proposal, for the choice of draft lengths, which estimates how
            often a first draft token is kept for each label apart (prompt lookup: the length of
            the n-gram it matched). Default: 0.
    """

    tokens: mx.array
    probs: mx.array | None = None
    steps: int = 0
    label: int = 0

    def head(self, n: int) -> Draft:
        """Draft: its first ``n`` tokens (and their distributions)."""
        if n >= self.size:
            return self
        probs = None if self.probs is None else self.probs[:n]
        return Draft(self.tokens[:n], probs, self.steps, self.label)

    @property
    def size(self) -> int:
        """int: the number of draft tokens ``n``."""
        return self.tokens.size


_EMPTY = Draft(mx.array([], dtype=mx.uint32))


@dataclass(frozen=True)
class DraftSetup:
    """What a drafter learns from the generation it drafts for.

    Attributes:
        rule (Rule): how tokens are drawn (greedy, sampled, or drawn by the sampler).
        logits_processors (list): ``processor(tokens, logits) -> logits`` applied in order to a
            model drafter's ``[1, V]`` logits, ``tokens`` being the text before that position.
        quantize (callable): applied to a model drafter's caches after each call (mlx-lm's
            ``kv_bits`` quantization; by default, nothing).
        prefill_step_size (int): prompt tokens per prefill call.
        target (Split, optional): the target as backbone, LM head and embedding
            (:class:`mlx_spec._mlx_lm.Split`), for a drafter that reads its hidden states;
            ``None`` for the others, or where the target's build does not expose them.
    """

    rule: Rule
    logits_processors: Sequence[LogitsProcessor] = ()
    quantize: Callable[[list[Any]], None] = field(default=lambda cache: None)
    prefill_step_size: int = 512
    target: Any = None


class Drafter(ABC):
    """Proposes draft tokens; subclass it for a drafter of your own.

    The loop calls :meth:`start` once, then per round :meth:`propose` and :meth:`update`, and
    :meth:`finish` when the generation ends. Proposals may be lazy; the loop reads them together
    with the round's acceptance, in its one host read.
    """

    #: Whether a proposal costs no model call, so the loop may ask for one it does not verify.
    free: bool = False
    #: Whether the drafter reads the target's hidden states (:meth:`see`): the target's calls
    #: then return them too, at no extra call. The others pay nothing.
    reads_hidden: bool = False
    #: Whether :meth:`propose` reads its ``keys`` (it draws its tokens). One that never does is
    #: given ``None``, and the loop makes no keys for it.
    reads_keys: bool = True

    def start(self, text: Text, setup: DraftSetup) -> None:  # noqa: B027 (optional hook)
        """Prepares for a generation. Optional: the default does nothing.

        Args:
            text (Text): the text so far: the prompt.
            setup (DraftSetup): the generation's rule, logits processors, cache quantization
                and prefill step.
        """

    @abstractmethod
    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        """Up to ``n`` tokens to follow ``text``.

        A drafter that samples draws its ``i``-th token with ``setup.rule.draw(logits,
        keys[i])``: under coupled acceptance that is the randomness the target's own token at
        that position takes, so the two agree as often as they can.

        Args:
            text (Text): the text so far.
            n (int): the most tokens to propose, ``>= 0``.
            keys (array, optional): ``[n, 2]`` uint32, the key of each proposed token's draw;
                ``None`` when the rule takes no keys (greedy) or the drafter reads none
                (:attr:`reads_keys`).

        Returns:
            Draft: at most ``n`` tokens (fewer, or none, when there is nothing to propose).
        """

    def see(self, hidden: mx.array, start: int, text: Text) -> None:  # noqa: B027 (optional hook)
        """Learns the target's hidden states at text positions ``start, start + 1, ...``, for a
        drafter with :attr:`reads_hidden`: after the prefill, after each round (the positions
        kept) and after plain steps: each step's for a :attr:`free` drafter, which guesses
        during them; a stretch's all at once at its end for any other. Optional: the default
        does nothing.

        Args:
            hidden (array): ``[k, H]``: row ``i`` is the input of the target's LM head at text
                position ``start + i`` (the state that predicted the token at ``start + i + 1``,
                which ``text`` holds).
            start (int): the text position of the first row.
            text (Text): the text.
        """

    def update(self, text: Text, accepted: int) -> None:  # noqa: B027 (optional hook)
        """Learns the outcome of a round. Optional: the default does nothing.

        Args:
            text (Text): the text, grown by the kept draft tokens and the target's next token
                (unless the generation ended within them).
            accepted (int): how many tokens of the last proposal were kept.
        """

    def finish(self, text: Text, length: int, feed: bool) -> None:  # noqa: B027 (optional hook)
        """Ends a generation, also after an error or a close. Optional: the default does nothing.

        Args:
            text (Text): the text; the generation's final text is its first ``length`` tokens.
            length (int): the tokens of ``text`` that the generation kept.
            feed (bool): whether state such as a model's caches must hold all ``length`` tokens
                (else a prefix of them is enough, as after an error).
        """


class ModelDrafter(Drafter):
    """A draft model with the target's tokenizer.

    ``draft_model=model`` makes ``ModelDrafter(model)``. Given as ``drafter=``, it keeps its own
    caches: a ``prompt_cache`` then holds the target's only.

    Args:
        model (nn.Module): the draft model (its vocabulary may be padded differently).
        cache (list, optional): its caches, one per layer, reused and updated in place. Default:
            new caches.
    """

    def __init__(self, model: nn.Module, cache: list[Any] | None = None) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = ModelCache(cache if cache is not None else make_prompt_cache(model))
        self._setup = DraftSetup(Rule("greedy"))
        # The text's length at the last proposal not yet followed by an update.
        self._base: int | None = None

    def start(self, text: Text, setup: DraftSetup) -> None:
        self._setup = setup
        self.cache.length = 0
        while self.cache.length < len(text) - 1:
            stop = min(self.cache.length + setup.prefill_step_size, len(text) - 1)
            self._feed(text.tokens(self.cache.length, stop))
            mx.eval([c.state for c in self.cache.layers])

    def _feed(self, tokens: mx.array) -> mx.array:
        with self.cache.feeding(tokens.size):
            logits = self.model(tokens[None], cache=self.cache.layers)
        self._setup.quantize(self.cache.layers)
        return logits[0, -1:]

    def _process(self, logits: mx.array, text: Text, drafts: list[mx.array]) -> mx.array:
        processors = self._setup.logits_processors
        if not processors:
            return logits
        tokens = mx.concatenate([text.array(), *drafts]) if drafts else text.array()
        for processor in processors:
            logits = processor(tokens, logits)
        return logits

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        self._base = len(text)
        if n == 0:
            return _EMPTY
        if keys is None:
            keys = [None] * n
        pending = text.tokens(self.cache.length)
        drafts: list[mx.array] = []
        rows: list[mx.array] = []
        for i in range(n):
            if i:
                # The state holding the text and i - 1 drafts: a rejection may come back to it.
                self.cache.checkpoint()
            logits = self._process(self._feed(pending), text, drafts)
            token, q = self._setup.rule.draw(logits, keys[i])
            # Start computing while the next step's graph is built (not a host read).
            mx.async_eval(token)
            drafts.append(token)
            if q is not None:
                rows.append(q)
            pending = token
        probs = mx.concatenate(rows) if rows else None
        return Draft(mx.concatenate(drafts), probs, steps=n)

    def update(self, text: Text, accepted: int) -> None:
        if self._base is None:
            # Nothing proposed since the last update (a stretch of plain steps): the caches hold a
            # prefix of the text, and the next proposal feeds what they lack.
            return
        self.cache.rewind(self._base + accepted)
        # The round's tokens may yet be refused (a generation closed mid-round): keep what takes
        # the caches back to the text before them.
        self.cache.forget(self._base)
        self._base = None

    def finish(self, text: Text, length: int, feed: bool) -> None:
        held = self.cache.rewind(length)
        if feed and held < length:
            self._feed(text.tokens(held, length))
        self.cache.forget()


class _NgramIndex:
    """For every n-gram of the text (``min_n <= n <= max_n``), where it was last followed by a
    token, and with ``counting``, how often by each token; updated as the text grows."""

    def __init__(self, min_n: int, max_n: int, counting: bool = False) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.last: dict[tuple[int, ...], int] = {}
        self.counts: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
        self.counting = counting
        self.ids: list[int] = []

    def extend(self, ids: list[int]) -> None:
        """Appends ``ids`` to the indexed text: time in ``len(ids)``, not in the text's length."""
        text = self.ids
        for token in ids:
            end = len(text)
            for n in self.sizes:
                if n <= end:
                    gram = tuple(text[end - n :])
                    self.last[gram] = end
                    if self.counting:
                        self.counts[gram][token] += 1
            text.append(token)

    def match(self, suffix: list[int]) -> tuple[int, ...] | None:
        """The longest n-gram ending ``suffix`` that occurred earlier with a continuation."""
        for n in self.sizes:
            if n <= len(suffix):
                gram = tuple(suffix[len(suffix) - n :])
                if gram in self.last:
                    return gram
        return None


class PromptLookupDrafter(Drafter):
    """Drafts by prompt lookup (n-gram matching), with no draft model.

    For the text's last ``max_ngram`` tokens, then fewer down to ``min_ngram``, it looks for the
    latest earlier occurrence and proposes the tokens that followed it, up to ``n`` (and never
    past the end of the text). The text includes what a reused cache held before the prompt
    (``cached_tokens`` of :func:`mlx_spec.generation.speculative_generate_step`). With nothing
    matching it proposes nothing, and the round is a plain step of the target.

    Args:
        max_ngram (int): the longest n-gram to match, in ``[min_ngram, MAX_NGRAM]``. Default:
            ``3``.
        min_ngram (int): the shortest n-gram to match, ``>= 1``. Default: ``1``.
        distribution (bool): in a sampled generation, draw each draft token from the frequencies
            of the tokens that followed the matched n-gram (and keep it with probability
            ``sum(min(p, q))``) instead of proposing the latest continuation (kept with
            probability ``p(d)``). Greedy generation always proposes the latest continuation.
            Default: ``False``.

    Raises:
        ValueError: an n-gram size is not an integer in ``[1, MAX_NGRAM]``, or
            ``min_ngram > max_ngram``.
    """

    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, distribution: bool = False) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NGRAM:
                raise ValueError(
                    f"PromptLookupDrafter: `{name}` must be an int in [1, {MAX_NGRAM}], "
                    f"got {value!r}"
                )
        if min_ngram > max_ngram:
            raise ValueError(
                f"PromptLookupDrafter: `min_ngram` ({min_ngram}) must not exceed `max_ngram` "
                f"({max_ngram})"
            )
        if not isinstance(distribution, bool):
            raise ValueError(
                f"PromptLookupDrafter: `distribution` must be a bool, got {distribution!r}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.distribution = distribution
        self._index = _NgramIndex(min_ngram, max_ngram)
        self._history = 0
        self._rule: Rule | None = None

    @property
    def reads_keys(self) -> bool:
        """bool: whether proposals are drawn (``distribution``); a copied one reads no keys."""
        return self.distribution

    def start(self, text: Text, setup: DraftSetup) -> None:
        self._index = _NgramIndex(self.min_ngram, self.max_ngram, self.distribution)
        # An earlier turn's text, which a reused cache holds, is what a chat copies most.
        self._history = len(text.history)
        self._index.extend([*text.history, *text.ids(0)])
        self._rule = setup.rule if self.distribution and setup.rule.random else None

    def update(self, text: Text, accepted: int) -> None:
        self._index.extend(text.ids(len(self._index.ids) - self._history))

    def finish(self, text: Text, length: int, feed: bool) -> None:
        self.update(text, 0)

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        ids = self._index.ids
        if n == 0:
            return _EMPTY
        if self._rule is not None and keys is not None:
            return self._draw(n, keys)
        gram = self._index.match(ids[-self.max_ngram :])
        if gram is None:
            return _EMPTY
        start = self._index.last[gram]
        return Draft(mx.array(ids[start : start + n], dtype=mx.uint32), label=len(gram))

    def _draw(self, n: int, keys: mx.array) -> Draft:
        """Draws up to ``n`` tokens, each from the continuations of the n-gram it follows, the
        ``i``-th with ``keys[i]`` as the generation's rule draws (one host read a token: the
        next n-gram depends on it)."""
        suffix = self._index.ids[-self.max_ngram :]
        tokens: list[int] = []
        rows: list[mx.array] = []
        label = 0
        for i in range(n):
            gram = self._index.match(suffix)
            if gram is None:
                break
            label = label or len(gram)
            counts = self._index.counts[gram]
            support = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            weights = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            scores = np.full((1, int(support.max()) + 1), -np.inf, dtype=np.float32)
            scores[0, support] = np.log(weights / weights.sum())
            token, q = self._rule.draw(mx.array(scores), keys[i])
            tokens.append(int(token.item()))
            rows.append(q)
            suffix = [*suffix, tokens[-1]][-self.max_ngram :]
        if not tokens:
            return _EMPTY
        probs = None
        if rows[0] is not None:
            width = max(q.shape[-1] for q in rows)
            probs = mx.concatenate([mx.pad(q, [(0, 0), (0, width - q.shape[-1])]) for q in rows])
        return Draft(mx.array(tokens, dtype=mx.uint32), probs, label=label)


def __getattr__(name: str) -> Any:
    # MTPDrafter is defined in .mtp, which imports this module: imported on first use.
    if name == "MTPDrafter":
        from .mtp import MTPDrafter

        return MTPDrafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
