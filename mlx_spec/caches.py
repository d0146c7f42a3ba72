"""Taking a model's caches back to an earlier length: trimmed where that is exact, else restored.

Speculation feeds a model tokens that may be rejected, so after each round the caches must drop
them. mlx-lm's ``trim`` is exact for the attention caches that append (``KVCache``,
``QuantizedKVCache``, ``ConcatenateKVCache``, ``ChunkedKVCache``). It is not for the others:

- a ``RotatingKVCache`` whose window has wrapped has overwritten old entries, and mlx-lm's trim
  leaves the rejected entries in its buffer; here it is trimmed by putting the buffer in temporal
  order and cutting it, which is exact while the buffer still holds a full window before the cut
  (always so after a call of several tokens, as a verification is);
- a recurrent state (``ArraysCache``, and deepseek-v4's ``LayerCache``) keeps no history at all.

Those are restored from a checkpoint taken before the call (:meth:`ModelCache.checkpoint`). MLX
arrays are immutable values, so a checkpoint holds references, not copies; an array that a cache
overwrites in place (``a[i] = x`` rebinds the array object) is held through a new object of the
same value, so the write does not reach the checkpoint. A model whose caches were restored lacks
the tokens fed since the checkpoint: the caller feeds them again with its next call. The gated
delta-net layers that :mod:`mlx_spec._mlx_lm` knows need no such replay: within
:meth:`ModelCache.tracking`, their state after every position of a call is kept, and a rewind
into that call takes the state at its length.

:func:`check_caches` refuses, before any work, a cache this module cannot take back exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from . import _mlx_lm

__all__ = ["ModelCache", "check_caches"]

# Appending attention caches: mlx-lm's trim drops the newest entries exactly.
_APPENDING = (KVCache, QuantizedKVCache, ConcatenateKVCache, ChunkedKVCache)
# Caches whose every update rebinds attributes, list items or arrays: a checkpoint restores them.
_RECURRENT = (ArraysCache,)


def _kind(layer: Any) -> str | None:
    """``"append"``, ``"rotating"``, ``"recurrent"``, ``"list"`` or ``None`` (not supported)."""
    if isinstance(layer, _APPENDING):
        return "append"
    if isinstance(layer, RotatingKVCache):
        return "rotating"
    if isinstance(layer, _RECURRENT) or type(layer).__name__ in _mlx_lm.RESTORED_BY_NAME:
        return "recurrent"
    if isinstance(layer, CacheList):
        return "list"
    return None


def _unsupported(layers: list[Any]) -> set[str]:
    names = set()
    for layer in layers:
        kind = _kind(layer)
        if kind is None:
            names.add(type(layer).__name__)
        elif kind == "list":
            names |= _unsupported(list(layer.caches))
    return names


def _replays(layers: list[Any]) -> bool:
    """Whether some layer keeps a recurrent state (so a rejected draft is replayed)."""
    return any(
        _kind(layer) == "recurrent" or (_kind(layer) == "list" and _replays(list(layer.caches)))
        for layer in layers
    )


def _role(layer: Any) -> Any:
    """What a layer's cache serves: attention (appending and rotating caches serve it alike, as
    ``max_kv_size`` and quantization swap them), a recurrent state, or a list of those."""
    kind = _kind(layer)
    if kind == "list":
        return tuple(_role(member) for member in layer.caches)
    return "attention" if kind in ("append", "rotating") else kind


def check_caches(
    op: str, name: str, layers: Any, argument: str | None = None, model: Any = None
) -> None:
    """Raises ``ValueError`` unless ``layers`` is a list of caches this module can take back.

    Args:
        op (str): the public function, for the message.
        name (str): which model's caches, for the message (``"the target's"``).
        layers (list): one cache per layer, as ``mlx_lm.models.cache.make_prompt_cache`` builds.
        argument (str, optional): the argument that gave them, for the message. Default: none
            (the model made them).
        model (nn.Module, optional): the model they are for: each cache must then serve what
            ``make_prompt_cache(model)``'s does in its place (attention or a recurrent state).
            Default: not compared.
    """
    name = f"{name} caches" + (f" (`{argument}`)" if argument else "")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{op}: {name} must be a non-empty list, got {layers!r}")
    unsupported = _unsupported(layers)
    if unsupported:
        raise ValueError(
            f"{op}: {name} include {', '.join(sorted(unsupported))}, which speculative "
            "decoding cannot take back after a rejected draft (supported: KVCache, "
            "QuantizedKVCache, ConcatenateKVCache, ChunkedKVCache, RotatingKVCache, ArraysCache, "
            "CacheList of those)"
        )
    narrow = [c for c in _flat(layers) if _kind(c) == "rotating" and c.max_size <= c.keep]
    if narrow:
        raise ValueError(
            f"{op}: {name} include a RotatingKVCache of {narrow[0].max_size} tokens that keeps its "
            f"first {narrow[0].keep}: its window holds nothing past them (with mlx-lm's "
            f"`max_kv_size`, give more than {narrow[0].keep})"
        )
    if model is not None:
        fresh = make_prompt_cache(model)
        roles = [_role(layer) for layer in layers]
        if roles != [_role(layer) for layer in fresh]:
            raise ValueError(
                f"{op}: {name} do not fit the model: its layers take "
                f"{[type(c).__name__ for c in fresh]}, got {[type(c).__name__ for c in layers]}"
            )


def _trimmable(layer: Any, n: int) -> bool:
    """Whether trimming the newest ``n`` tokens of ``layer`` is exact.

    A rotating buffer in temporal order holds the ``keep`` first tokens and the newest others;
    without its newest ``n`` it is exact when nothing was evicted yet, or when it still holds a
    full window (``max_size`` entries, the most a later call of one token reads; with fewer, that
    call would grow the buffer as if it had never wrapped). Where this mlx-lm's buffer is not laid
    out as expected (:func:`mlx_spec._mlx_lm.rotating_trims`), a rotating cache is restored from a
    checkpoint instead.
    """
    kind = _kind(layer)
    if kind == "append" or n == 0:
        return True
    if kind == "rotating":
        if not _mlx_lm.rotating_trims():
            return False
        held = _mlx_lm.rotating_held(layer)
        return layer.offset <= held or held - n >= layer.max_size
    if kind == "list":
        return all(_trimmable(member, n) for member in layer.caches)
    return False


def _trim(layer: Any, n: int) -> None:
    """Drops the newest ``n`` tokens of ``layer``, where :func:`_trimmable` says it is exact."""
    kind = _kind(layer)
    if kind == "append":
        layer.trim(n)
    elif kind == "rotating" and n:
        _mlx_lm.rotating_trim(layer, n)
    elif kind == "list":
        for member in layer.caches:
            _trim(member, n)


def multi_token_calls_exact(layers: list[Any]) -> bool:
    """Whether a call of several tokens gives the logits that one-token steps would: not where a
    rotating cache keeps its first tokens and this mlx-lm's mask for it cannot be adapted
    (:func:`mlx_spec._mlx_lm.rotating_masks`)."""
    keeping = [c for c in _flat(layers) if _kind(c) == "rotating" and c.keep > 0]
    return not keeping or _mlx_lm.rotating_masks()


def _flat(layers: list[Any]) -> list[Any]:
    return [m for c in layers for m in (_flat(list(c.caches)) if _kind(c) == "list" else [c])]


def _snapshot(layer: Any) -> Any:
    """What restores ``layer``: the length of a layer that appends (it is trimmed back to it),
    else its state (held by reference)."""
    kind = _kind(layer)
    if kind == "append":
        return layer.offset
    if kind == "list":
        return [_snapshot(member) for member in layer.caches]
    return _mlx_lm.snapshot(layer)


def _restore(layer: Any, snapshot: Any) -> None:
    """Puts ``layer`` back as ``snapshot`` holds it: a layer that appends drops what it holds
    past its length then (whatever a call cut short left in it)."""
    kind = _kind(layer)
    if kind == "append":
        layer.trim(layer.offset - snapshot)
    elif kind == "list":
        for member, state in zip(layer.caches, snapshot, strict=True):
            _restore(member, state)
    else:
        _mlx_lm.restore(layer, snapshot)


def _tracks(layers: list[Any], tracked: int) -> int:
    """How many recurrent layers of ``layers`` keep their states: ``tracked`` (the count of
    :func:`mlx_spec._mlx_lm.track`) when those are all of them (``ArraysCache`` entries holding
    a convolution's and a recurrence's state, none inside a ``CacheList``), else ``0``."""
    recurrent_layers = [layer for layer in layers if _kind(layer) == "recurrent"]
    every = (
        len(recurrent_layers) == tracked
        and all(isinstance(c, ArraysCache) and len(c.cache) == 2 for c in recurrent_layers)
        and not any(_kind(layer) == "list" and _replays(list(layer.caches)) for layer in layers)
    )
    return tracked if every else 0


@dataclass
class _Checkpoint:
    length: int
    states: list[Any]
    # The recurrent layers' states after each position of the call made from this checkpoint.
    positions: list[_mlx_lm.Positions] | None = None


class ModelCache:
    """One model's caches and the length of text they hold, taken back exactly on request.

    Args:
        layers (list): the caches, one per layer.
        length (int, optional): tokens of the text they hold. Default: ``0``.
        model (nn.Module, optional): the model they serve. Where all its recurrent layers are
            gated delta-net layers that :mod:`mlx_spec._mlx_lm` knows, calls made within
            :meth:`tracking` keep their state after every position, and a rewind into such a
            call needs no replay. Default: none (rewinds restore checkpoints).

    Attributes:
        layers (list): the caches, one per layer, updated in place (quantization replaces some
            of them in this list).
        length (int): tokens of the text the caches hold.
        replays (bool): whether a rejected draft is taken back by restoring a checkpoint (some
            layer keeps a recurrent state that is not tracked) rather than by trimming.
    """

    def __init__(self, layers: list[Any], length: int = 0, model: nn.Module | None = None) -> None:
        self.layers = layers
        self.length = length
        replays = _replays(layers)
        # The recurrent layers that keep their states (all of them, or none).
        tracks = replays and model is not None
        self._tracked = _tracks(layers, _mlx_lm.track(model)) if tracks else 0
        self.replays = replays and not self._tracked
        self._checkpoints: list[_Checkpoint] = []
        # Whether a call was cut short (an error, an interrupt): the layers may then hold some
        # of its tokens, and only the checkpoint before it says what they held.
        self._unsure = False

    def checkpoint(self) -> None:
        """Remembers the caches' state at the current length.

        Cheap: layers that append keep their length (they are trimmed back), and the others are
        held by reference. Checkpoints stack until :meth:`rewind` passes below them or
        :meth:`forget` drops them.
        """
        states = [_snapshot(layer) for layer in self.layers]
        self._checkpoints.append(_Checkpoint(self.length, states))

    @contextmanager
    def feeding(self, count: int) -> Iterator[None]:
        """Within it, the model is called on ``count`` more tokens, after a checkpoint at the
        current length (taken here where there is none). When the call ends, the caches hold
        them; when it raises (``KeyboardInterrupt`` included), :meth:`rewind` restores that
        checkpoint first, whatever the call left in each layer."""
        if not (self._checkpoints and self._checkpoints[-1].length == self.length):
            self.checkpoint()
        self._unsure = True
        yield
        self.fed(count)
        self._unsure = False

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Within it, one call of the model, made just after :meth:`checkpoint`, keeps its
        tracked layers' states after every position for :meth:`rewind`; without tracked layers
        it changes nothing."""
        if not self._tracked or not self._checkpoints:
            yield
            return
        point = self._checkpoints[-1]
        with _mlx_lm.tracking() as records:
            yield
        fed = self.length - point.length
        if fed > 0 and len(records) == self._tracked and all(len(r.states) == fed for r in records):
            point.positions = records

    def forget(self, length: int | None = None) -> None:
        """Drops the checkpoints no longer needed.

        Args:
            length (int, optional): keep the latest checkpoint at or below it, so the caches can
                still be taken back to ``length`` (tokens that may yet be refused). Default: drop
                them all.
        """
        kept = [c for c in self._checkpoints if length is not None and c.length <= length]
        self._checkpoints = kept[-1:]

    def fed(self, count: int) -> None:
        """Records that the model was just called on ``count`` more tokens."""
        self.length += count
        # The states a tracked call kept describe the caches as that call left them.
        for point in self._checkpoints:
            point.positions = None

    def rewind(self, length: int) -> int:
        """Takes the caches back to hold ``length`` tokens, or fewer when only a checkpoint can.

        Trims every layer when that is exact for all of them; otherwise, when ``length`` falls
        inside the last call and it was tracked (:meth:`tracking`), takes each tracked layer's
        state at ``length`` and trims the others; otherwise restores the latest checkpoint at or
        below ``length``. Checkpoints above the result are dropped.

        Args:
            length (int): the tokens to keep.

        Returns:
            int: the tokens the caches now hold, at most ``length``; the caller feeds the rest
            again with its next call.

        Raises:
            RuntimeError: the caches cannot be trimmed exactly and no checkpoint is low enough
                (a caller's bug: checkpoint before every call that may be undone).
        """
        if self._unsure:
            point = self._checkpoints[-1]
            for layer, state in zip(self.layers, point.states, strict=True):
                _restore(layer, state)
            self.length, self._unsure = point.length, False
        n = self.length - length
        if n <= 0:
            return self.length
        # Cut short (an interrupt) midway through the layers, the next rewind restores.
        self._unsure = bool(self._checkpoints)
        if all(_trimmable(layer, n) for layer in self.layers):
            for layer in self.layers:
                _trim(layer, n)
            self.length = length
        else:
            usable = [c for c in self._checkpoints if c.length <= length]
            if not usable:
                raise RuntimeError(
                    f"ModelCache.rewind: no checkpoint at or below {length} tokens (the caches "
                    f"hold {self.length}, checkpoints at {[c.length for c in self._checkpoints]})"
                )
            point = usable[-1]
            if self._within(point, length, n):
                positions = iter(point.positions)
                for layer in self.layers:
                    if _kind(layer) == "recurrent":
                        layer.cache = next(positions).after(length - point.length)
                    else:
                        _trim(layer, n)
                self.length = length
            else:
                for layer, state in zip(self.layers, point.states, strict=True):
                    _restore(layer, state)
                self.length = point.length
        self._checkpoints = [c for c in self._checkpoints if c.length <= self.length]
        self._unsure = False
        return self.length

    def _within(self, point: _Checkpoint, length: int, n: int) -> bool:
        """Whether ``length`` falls inside the tracked call made from ``point`` (the last call),
        and the other layers drop their newest ``n`` tokens exactly."""
        return (
            point.positions is not None
            and point.length < length
            and all(_trimmable(layer, n) for layer in self.layers if _kind(layer) != "recurrent")
        )
