"""Multi-token prediction (MTP) heads: the drafter a model ships with.

Qwen3-Next, Qwen3.5 / 3.6, DeepSeek-V3 and GLM-4.5 carry one or more MTP layers, trained with the
model to predict the token after next from the target's last hidden state. One MTP step, for text
position ``j``, takes the target's hidden state ``h_j`` (the input of its LM head, which predicted
the token at ``j + 1``) and the embedding of that token, ``e(x_{j+1})``, and applies:

1. the two norms, ``embed_norm(e)`` and ``hidden_norm(h)``;
2. the concatenation ``[e, h]`` (both layouts' order) and the projection back to the hidden size;
3. one decoder layer of the target's own kind (its attention, with a cache of the head's own, and
   its MLP or MoE);
4. the final norm, and the target's own (shared) LM head: the logits of ``x_{j+2}``.

A draft of ``k`` tokens chains the head on its own output: the next step takes the head's hidden
state in place of the target's (after the final norm in Qwen's layout, before it in DeepSeek's, as
each model was trained), and the embedding of the token just drafted. With several MTP layers,
step ``i`` uses layer ``i mod layers``.

Two weight layouts are read (``mtp.safetensors`` beside an mlx-lm model, written by
``mlx-spec convert-mtp``; see :mod:`mlx_spec.mtp_convert`):

- Qwen (``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.N``,
  ``mtp.norm``);
- DeepSeek (``model.layers.{L}.enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the
  decoder layer's own weights under ``model.layers.{L}``, ``L`` counting from
  ``num_hidden_layers``).

:class:`MTPDrafter` drafts with a head: the loop hands it the target's hidden states of the
positions it keeps (:meth:`mlx_spec.drafters.Drafter.see`), which it runs through the head to keep
the head's cache and its prediction for the next position current.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import mlx.nn as nn

from . import _mlx_lm
from .caches import ModelCache
from .drafters import Draft, Drafter, DraftSetup

if TYPE_CHECKING:
    from .loop import Text

__all__ = ["LAYOUTS", "MTPDrafter", "MTPHead", "attach", "head_of", "new_head", "own_names"]

#: The weight layouts a head is read in.
LAYOUTS = ("qwen", "deepseek")

Layout = Literal["qwen", "deepseek"]

_EMPTY = Draft(mx.array([], dtype=mx.uint32))


class MTPHead(nn.Module):
    """The MTP layers of one model, with what they share (see the module's description).

    Args:
        layout (str): ``"qwen"`` (one projection and pair of norms for all layers; the chained
            hidden state is taken after the final norm) or ``"deepseek"`` (each layer with its
            own; the chained state is taken before it).
        layers (list of nn.Module): decoder layers of the target's kind, ``layer(x, mask,
            cache)``.
        hidden_size (int): the target's hidden size ``H``.
        eps (float): the norms' epsilon.
    """

    def __init__(
        self, layout: Layout, layers: list[nn.Module], hidden_size: int, eps: float
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"MTPHead: `layout` must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        count = len(layers) if layout == "deepseek" else 1
        self.embed_norms = [nn.RMSNorm(hidden_size, eps=eps) for _ in range(count)]
        self.hidden_norms = [nn.RMSNorm(hidden_size, eps=eps) for _ in range(count)]
        self.projections = [
            nn.Linear(2 * hidden_size, hidden_size, bias=False) for _ in range(count)
        ]
        self.layers = layers
        self.norms = [nn.RMSNorm(hidden_size, eps=eps) for _ in range(count)]

    def __call__(
        self, hidden: mx.array, embedded: mx.array, depth: int, cache: Any, mask: Any = None
    ) -> tuple[mx.array, mx.array]:
        """One MTP step at ``depth`` over ``k`` positions.

        Args:
            hidden (array): ``[1, k, H]`` the hidden state each position starts from (the
                target's, or the head's own when chaining).
            embedded (array): ``[1, k, H]`` the embedding of the token after each position.
            depth (int): the draft step (layer ``depth mod layers``).
            cache: the cache of that layer.
            mask: the attention mask of ``k`` positions (``None`` for one).

        Returns:
            tuple: ``[1, k, H]`` the hidden state to chain on and ``[1, k, H]`` the input of the
            LM head (after the final norm).
        """
        i = depth % len(self.layers)
        shared = i % len(self.projections)
        joined = mx.concatenate(
            [self.embed_norms[shared](embedded), self.hidden_norms[shared](hidden)], axis=-1
        )
        out = self.layers[i](self.projections[shared](joined), mask, cache)
        normed = self.norms[shared](out)
        return (normed if self.layout == "qwen" else out), normed


def new_head(model: nn.Module, layout: Layout, layers: int = 1) -> MTPHead:
    """An MTP head of ``layers`` layers for ``model`` (its weights as initialized: load them, or
    train them), in ``layout``.

    Args:
        model (nn.Module): the target (an mlx-lm model).
        layout (str): ``"qwen"`` or ``"deepseek"``.
        layers (int): MTP layers, ``>= 1``. Default: ``1``.

    Returns:
        MTPHead: in the target's dtype.
    """
    split = _mlx_lm.split(model)
    if split is None:
        raise ValueError(
            f"new_head: `model` ({type(model).__module__}) does not expose its hidden states"
        )
    args = split.text.args
    hidden = args.hidden_size
    eps = getattr(args, "rms_norm_eps", 1e-6)
    head = MTPHead(layout, [_mlx_lm.decoder_layer(model) for _ in range(layers)], hidden, eps)
    dtype = split.embed.weight.dtype if hasattr(split.embed, "weight") else mx.float32
    if dtype in (mx.float16, mx.bfloat16, mx.float32):
        head.set_dtype(dtype)
    return head


def head_of(model: nn.Module) -> MTPHead | None:
    """The MTP head :func:`attach` gave ``model`` (:func:`mlx_spec.load` does), or ``None``."""
    return getattr(model, "_mlx_spec_mtp", None)


def attach(model: nn.Module, head: MTPHead) -> None:
    """Gives ``model`` its MTP head, found by :func:`head_of` and ``drafter="mtp"`` (kept beside
    the model's own parameters, not among them)."""
    object.__setattr__(model, "_mlx_spec_mtp", head)


@dataclass
class _Step:
    """The head's latest output: what the next draft token is drawn from."""

    chain: mx.array
    logits: mx.array


class MTPDrafter(Drafter):
    """Drafts with a model's own MTP head (see the module's description).

    Each round it drafts up to ``n`` tokens: the first from the head's prediction at the last
    position the target verified, the next ones by chaining the head on its own output. Each
    layer of the head keeps a cache of its own: the first holds an entry for every position the
    target verified; the entries a draft adds, to any layer, are taken back after the round (so a
    later layer holds only the round's chain).

    Args:
        head (MTPHead, optional): the head. Default: the target's (:func:`head_of`), given with
            ``drafter="mtp"``.
    """

    reads_hidden = True

    def __init__(self, head: MTPHead | None = None) -> None:
        if head is not None and not isinstance(head, MTPHead):
            raise ValueError(f"MTPDrafter: `head` must be an MTPHead, got {type(head).__name__}")
        self.head = head
        self._split: _mlx_lm.Split | None = None
        # One per layer: draft step i feeds only layer i mod layers, so their lengths differ.
        self._caches: list[ModelCache] = []
        self._last: _Step | None = None
        self._setup: DraftSetup | None = None
        self._bases: list[int] | None = None

    def start(self, text: Text, setup: DraftSetup) -> None:
        from mlx_lm.models.cache import KVCache

        if self.head is None or setup.target is None:
            raise ValueError(
                "MTPDrafter: the target has no MTP head, or does not expose its hidden states "
                "(load it with mlx_spec.load; add a head with `mlx-spec convert-mtp`)"
            )
        self._split = setup.target
        self._setup = setup
        self._caches = [ModelCache([KVCache()]) for _ in self.head.layers]
        self._last = None

    def _embed(self, tokens: list[int]) -> mx.array:
        return self._split.embed(mx.array(tokens, dtype=mx.uint32)[None])

    def _run(self, hidden: mx.array, embedded: mx.array, depth: int) -> _Step:
        from mlx_lm.models.base import create_attention_mask

        caches = self._caches[depth % len(self._caches)]
        cache = caches.layers[0]
        # An array, not "causal": DeepSeek's attention applies the mask itself (mx.where).
        mask = create_attention_mask(hidden, cache, return_array=True)
        with caches.feeding(hidden.shape[1]):
            chain, normed = self.head(hidden, embedded, depth, cache, mask)
        return _Step(chain[:, -1:], self._split.head(normed[:, -1:])[0])

    def see(self, hidden: mx.array, start: int, text: Text) -> None:
        tokens = text.ids(start + 1, start + 1 + hidden.shape[0])
        embedded = self._embed(tokens)
        if self.head.layout == "deepseek" and start == 0:
            # DeepSeek's MTP was trained with no embedding at the text's first position.
            embedded = mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)
        self._last = self._run(hidden[None], embedded, 0)

    def propose(self, text: Text, n: int, keys: mx.array | None) -> Draft:
        self._bases = [caches.length for caches in self._caches]
        if n == 0 or self._last is None:
            return _EMPTY
        rule = self._setup.rule
        keys = keys if keys is not None else [None] * n
        tokens, rows, step = [], [], self._last
        for i in range(n):
            token, q = rule.draw(step.logits, keys[i])
            mx.async_eval(token)
            tokens.append(token)
            if q is not None:
                rows.append(q)
            if i + 1 < n:
                step = self._run(step.chain, self._split.embed(token[None]), i + 1)
        probs = mx.concatenate(rows) if rows else None
        return Draft(mx.concatenate(tokens), probs, steps=n - 1)

    def update(self, text: Text, accepted: int) -> None:
        if self._bases is not None:
            # The draft's entries were the head's guesses: the verified ones come with see().
            for caches, base in zip(self._caches, self._bases, strict=True):
                caches.rewind(base)
                caches.forget()
            self._bases = None


def _deepseek_names(key: str, first: int) -> str | None:
    """A DeepSeek-layout key as the head's own name (``None``: not the head's)."""
    match = re.match(r"model\.layers\.(\d+)\.(.+)", key)
    if match is None or int(match[1]) < first:
        return None
    depth, rest = int(match[1]) - first, match[2]
    for theirs, ours in (
        ("enorm.", "embed_norms"),
        ("hnorm.", "hidden_norms"),
        ("eh_proj.", "projections"),
        ("shared_head.norm.", "norms"),
    ):
        if rest.startswith(theirs):
            return f"{ours}.{depth}.{rest[len(theirs) :]}"
    if rest.startswith(("shared_head.head.", "embed_tokens.")):
        return None  # the target's own head and embedding are used
    return f"layers.{depth}.{rest}"


def _qwen_names(key: str) -> str | None:
    """A Qwen-layout key as the head's own name (``None``: not the head's)."""
    for theirs, ours in (
        ("mtp.fc.", "projections.0."),
        ("mtp.pre_fc_norm_embedding.", "embed_norms.0."),
        ("mtp.pre_fc_norm_hidden.", "hidden_norms.0."),
        ("mtp.norm.", "norms.0."),
        ("mtp.layers.", "layers."),
    ):
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    return None


def own_names(weights: dict[str, mx.array], layout: Layout, first: int) -> dict[str, mx.array]:
    """``weights`` in a checkpoint's layout, under the head's own names (others dropped).

    Args:
        weights (dict): names to arrays.
        layout (str): ``"qwen"`` or ``"deepseek"``.
        first (int): the index of the first MTP layer in DeepSeek's layout (the target's
            ``num_hidden_layers``).

    Returns:
        dict: the head's weights.
    """
    out = {}
    for key, value in weights.items():
        name = _qwen_names(key) if layout == "qwen" else _deepseek_names(key, first)
        if name is not None:
            out[name] = value
    return out
