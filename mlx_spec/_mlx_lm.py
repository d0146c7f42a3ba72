"""Everything mlx-spec takes from the private side of mlx-lm and MLX, in one place.

mlx-lm changes every few weeks. What it exposes (``make_prompt_cache``, a cache's ``state`` and
``trim``, ``generate_step``) is a contract; what it keeps private is not. Each use of the private
side lives here, behind a probe that checks, once, that it still holds for the installed
versions, with a fallback that stays exact and one warning naming what the fallback costs:

- **Rotating caches** (``RotatingKVCache._idx``, ``_temporal_order``): trimmed in place after a
  rejected draft. Fallback: restored from a checkpoint and the kept tokens fed again (a replay).
- **Rotating caches that keep their first tokens** (a per-instance ``make_mask``): a call of
  several tokens sees what one-token steps see. Fallback: no draft on such a model (plain steps).
- **Gated delta-net states** (``gated_delta._gated_delta_step_ops``, each model module's
  ``gated_delta_update``, a layer's ``conv1d`` class): the state after every position of a
  verification is kept. Fallback: a replay after a rejection.
- **Batch caches** (``BatchKVCache.prepare(right_padding=...)`` then ``finalize``, which roll
  each row right and grow its left padding): after a batched verification each row is taken back
  to its own kept length in place. Fallback: each row extracted, trimmed and merged back (a copy).
- **Batched sliding windows** (``BatchRotatingKVCache._temporal_order``, ``_idx``, ``_offset``
  and ``left_padding``): each row taken back as a batch cache's are, the buffer cut to what the
  rows keep. Fallback: such models do not batch speculatively.
- **Snapshots**: a cache is checkpointed through its ``state`` where that holds everything it
  keeps, else through its attributes (always exact; no warning).
- **Caches of a model's own** (deepseek-v4's ``LayerCache``, matched by name): restored from a
  checkpoint.
- **Chunked attention** (``mx.fast.scaled_dot_product_attention``): replaced only while a
  verification that asks for it runs, and restored after the last one. Fallback: unchunked.
- **mlx-lm's own functions** (``stream_generate``, ``speculative_generate_step``,
  ``make_sampler``, ``greedy_sampler``, ``maybe_quantize_kv_cache``, ``load``): kept as they were
  at import, for the patch to replace and restore, and for the benchmarks to compare with.
- **How mlx-lm's command and server load a model** (the ``load`` that ``mlx_lm.generate.main``
  and ``ModelProvider._load`` call by name): replaced, so that they load a model's MTP head.
  Fallback: they load models without it, with a warning.
- **mlx-lm's server** (``APIHandler.handle_completion``, ``ResponseGenerator.generate`` and
  ``_run_generate``, the ``LRUPromptCache`` it makes, ``ModelProvider._load`` and the
  ``is_batchable`` it sets): every request answered, a prompt its prompt cache holds exactly fed
  its last token again, the generation thread ending with ``mx.clear_streams()``, the requests
  batched speculatively, and those to a model whose own drafter does not batch served one at a
  time. Fallback: mlx-lm's server as it is, with a warning for each.

:func:`report` runs every probe and says which hold (``python -m mlx_spec._mlx_lm``).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import logging
import queue
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    dynamic_roll,
    trim_prompt_cache,
)

__all__ = [
    "Positions",
    "batch_rows_kept",
    "batch_windows_kept",
    "decode_masks",
    "decoder_layer",
    "is_greedy_sampler",
    "keep_rows",
    "lm",
    "modules",
    "replace_load",
    "report",
    "restore",
    "rotating_held",
    "rotating_masks",
    "rotating_trim",
    "rotating_trims",
    "scoped_attention",
    "server_cached_tokens",
    "snapshot",
    "split",
    "track",
    "tracking",
    "windows_in_order",
]

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _lost(what: str, why: BaseException | str) -> None:
    """Warns once per ``what`` that a probe failed and its fallback runs."""
    with _warn_lock:
        if what in _warned:
            return
        _warned.add(what)
    warnings.warn(
        f"mlx-spec: this mlx-lm ({_version()}) changed what {what} relies on ({why}); "
        "falling back to a slower path that gives the same tokens",
        RuntimeWarning,
        stacklevel=3,
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"mlx-lm {version('mlx-lm')}, mlx {mx.__version__}"
    except Exception:  # metadata missing: an editable or vendored copy
        return f"mlx {mx.__version__}"


# --- mlx-lm's own functions ----------------------------------------------------------------


@dataclass(frozen=True)
class _Originals:
    """mlx-lm's functions as they were when mlx-spec was imported (before any patch).

    Attributes:
        stream_generate (callable): ``mlx_lm.generate.stream_generate``.
        speculative_generate_step (callable): ``mlx_lm.generate.speculative_generate_step``.
        generate_step (callable): ``mlx_lm.generate.generate_step``.
        make_sampler (callable): ``mlx_lm.sample_utils.make_sampler``.
        greedy_sampler (callable, optional): ``mlx_lm.sample_utils.greedy_sampler``.
        maybe_quantize_kv_cache (callable): swaps a model's caches for quantized ones past a
            length (mlx-lm's, or an equivalent through the caches' ``to_quantized``).
        generation_stream (Stream): the stream mlx-lm generates on.
        wired_limit (callable): mlx-lm's context that wires the model's memory (or none).
        quantized_kv_start (int): mlx-lm's default ``quantized_kv_start``.
        load (callable): ``mlx_lm.utils.load``.
    """

    stream_generate: Callable[..., Any]
    speculative_generate_step: Callable[..., Any]
    generate_step: Callable[..., Any]
    make_sampler: Callable[..., Any]
    greedy_sampler: Callable[..., Any] | None
    maybe_quantize_kv_cache: Callable[..., Any]
    generation_stream: Any
    wired_limit: Callable[..., Any]
    quantized_kv_start: int
    load: Callable[..., Any]


def _quantize_kv_cache(
    prompt_cache: list[Any], quantized_kv_start: int, kv_group_size: int, kv_bits: int | None
) -> None:
    """mlx-lm's ``maybe_quantize_kv_cache`` through the public ``to_quantized`` alone."""
    if kv_bits is None:
        return
    for i, layer in enumerate(prompt_cache):
        if hasattr(layer, "to_quantized") and layer.offset >= quantized_kv_start:
            prompt_cache[i] = layer.to_quantized(group_size=kv_group_size, bits=kv_bits)


def _originals() -> _Originals:
    generate = importlib.import_module("mlx_lm.generate")
    samplers = importlib.import_module("mlx_lm.sample_utils")
    quantize = getattr(generate, "maybe_quantize_kv_cache", None)
    if quantize is None:
        quantize = _quantize_kv_cache
    return _Originals(
        stream_generate=generate.stream_generate,
        speculative_generate_step=generate.speculative_generate_step,
        generate_step=generate.generate_step,
        make_sampler=samplers.make_sampler,
        greedy_sampler=getattr(samplers, "greedy_sampler", None),
        maybe_quantize_kv_cache=quantize,
        generation_stream=getattr(generate, "generation_stream", None)
        or mx.new_stream(mx.default_device()),
        wired_limit=getattr(generate, "wired_limit", lambda *args, **kwargs: nullcontext()),
        quantized_kv_start=getattr(generate, "DEFAULT_QUANTIZED_KV_START", 5000),
        load=importlib.import_module("mlx_lm.utils").load,
    )


#: mlx-lm's functions as they were when mlx-spec was first imported.
lm = _originals()


def is_greedy_sampler(sampler: Any) -> bool:
    """Whether ``sampler`` is mlx-lm's greedy sampler (``make_sampler(temp=0)``'s)."""
    return lm.greedy_sampler is not None and sampler is lm.greedy_sampler


def replace(modules: tuple[str, ...], name: str, value: Any, original: Any) -> None:
    """Sets ``name`` to ``value`` in each loaded module of ``modules`` that holds ``original``."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, name, None) is original:
            setattr(module, name, value)


def restore_everywhere(replacements: dict[Any, Any], names: tuple[str, ...]) -> None:
    """Puts back each original of ``replacements`` (``{replacement: original}``) wherever an
    mlx-lm module holds the replacement under one of ``names``, also in modules imported after
    the replacement (which took it)."""
    for module_name, module in list(sys.modules.items()):
        if module_name == "mlx_lm" or module_name.startswith("mlx_lm."):
            for name in names:
                value = getattr(module, name, None)
                for patched, original in replacements.items():
                    if value is patched:
                        setattr(module, name, original)


# --- how mlx-lm's command and server load a model ----------------------------------------------

#: The modules whose ``load`` :func:`replace_load` replaces: mlx-lm's own (``mlx_lm.load``), and
#: those whose ``load`` the ``mlx_lm.generate`` command and the server call.
_LOADERS = ("mlx_lm.utils", "mlx_lm", "mlx_lm.generate", "mlx_lm.server")
#: Who loads through ``load`` by name: the function, as a module and a path in it.
_LOAD_CALLERS = {
    "the mlx_lm.generate command": ("mlx_lm.generate", "main"),
    "the server": ("mlx_lm.server", "ModelProvider._load"),
}


def replace_load(load: Callable[..., Any]) -> bool:
    """Puts ``load`` in the place of mlx-lm's ``load`` in the loaded modules of mlx-lm that hold
    it: ``mlx_lm.load``, and the name that the ``mlx_lm.generate`` command and the server call.

    Args:
        load (callable): takes the parameters of mlx-lm's ``load``, in its order.

    Returns:
        bool: whether it was put in place: not where this mlx-lm's ``load`` takes other
        parameters (with a warning). A caller that no longer loads through that name gets a
        warning too: it loads models as mlx-lm does.
    """
    theirs = list(inspect.signature(lm.load).parameters)
    ours = list(inspect.signature(load).parameters)
    cost = "models are loaded without their MTP heads (load them with mlx_spec.load)"
    if theirs != ours:
        _part_lost("mlx_lm.utils", "load", f"it takes {theirs}", cost)
        return False
    replace(_LOADERS, "load", load, lm.load)
    for what, (module_name, path) in _LOAD_CALLERS.items():
        if module_name in sys.modules and not _loads_by_name(module_name, path):
            _part_lost(module_name, "loading a model", f"{path} calls no load", f"{what}: {cost}")
    return True


def _loads_by_name(module_name: str, path: str) -> bool:
    """Whether the function at ``path`` in the module (imported here), as mlx-lm defines it,
    calls a global ``load``."""
    function: Any = importlib.import_module(module_name)
    for name in path.split("."):
        function = _unpatched(function, name)
    return "load" in getattr(getattr(function, "__code__", None), "co_names", ())


# --- rotating caches -------------------------------------------------------------------------


def rotating_held(layer: RotatingKVCache) -> int:
    """The entries of a rotating buffer that hold tokens."""
    if layer.keys is None:
        return 0
    size = layer.keys.shape[2]
    return size if layer._idx == size or layer._idx < layer.offset else layer._idx


def rotating_trim(layer: RotatingKVCache, n: int) -> None:
    """Drops the newest ``n`` tokens of a rotating buffer by putting it in temporal order and
    cutting it (exact where :func:`mlx_spec.caches` says so)."""
    held = rotating_held(layer)
    layer.keys = layer._temporal_order(layer.keys)[..., : held - n, :]
    layer.values = layer._temporal_order(layer.values)[..., : held - n, :]
    layer.offset -= n
    layer._idx = held - n


def _rotating_feed(layer: RotatingKVCache, values: list[float]) -> None:
    x = mx.array(values, dtype=mx.float32).reshape(1, 1, len(values), 1)
    layer.update_and_fetch(x, x)


def _in_order(layer: RotatingKVCache) -> list[float]:
    return layer._temporal_order(layer.keys)[0, 0, :, 0].tolist()


@cache
def rotating_trims() -> bool:
    """Whether this mlx-lm's rotating buffer is laid out as :func:`rotating_trim` assumes:
    after one-token steps that wrap it and a call of several tokens, trimming gives the buffer
    that the shorter call leaves."""
    try:
        probe, shorter = RotatingKVCache(max_size=4, keep=1), RotatingKVCache(max_size=4, keep=1)
        for layer in (probe, shorter):
            for token in range(6):
                _rotating_feed(layer, [float(token)])
        _rotating_feed(probe, [6.0, 7.0, 8.0])
        _rotating_feed(shorter, [6.0])
        rotating_trim(probe, 2)
        if probe.offset != shorter.offset or _in_order(probe)[-4:] != _in_order(shorter)[-4:]:
            raise AssertionError(f"trimmed to {_in_order(probe)}, not {_in_order(shorter)}")
        return True
    except Exception as error:
        _lost("trimming a rotating (sliding-window) cache in place", error)
        return False


def _decode_mask(
    layer: RotatingKVCache, n: int, window_size: int | None = None, return_array: bool = False
) -> Any:
    """The mask of ``n`` new tokens that gives each of them, in a rotating cache with
    ``keep > 0``, the context of a one-token step: the ``keep`` first tokens and the newest
    others.

    mlx-lm's mask for several tokens is a plain sliding window over the buffer, which hides the
    kept tokens from the later queries and shows them older ones instead; one token at a time
    (how plain decoding runs) sees the kept ones. Falls back to mlx-lm's mask where the two agree
    or where a window narrower than the buffer applies.
    """
    if n == 1 or (window_size is not None and window_size != layer.max_size):
        return RotatingKVCache.make_mask(layer, n, window_size, return_array)
    held = rotating_held(layer)
    # The buffer after this call (mlx-lm's _update_concat): the kept tokens, the newest old ones,
    # then the new ones; by absolute position.
    old = held - max(held - layer.max_size + 1, 0)
    keep = min(layer.keep, old)
    positions = mx.concatenate(
        [
            mx.arange(keep),
            mx.arange(layer.offset - (old - keep), layer.offset),
            mx.arange(layer.offset, layer.offset + n),
        ]
    )
    queries = mx.arange(layer.offset, layer.offset + n)[:, None]
    recent = positions[None, :] > queries - (layer.max_size - layer.keep)
    kept = positions[None, :] < layer.keep
    return mx.logical_and(mx.logical_or(recent, kept), positions[None, :] <= queries)


def _attend(layer: RotatingKVCache, tokens: list[float], mask: Any) -> list[float]:
    """One head of attention over ``layer`` for queries of ``tokens``: each output is the mean
    position (a key's value) the query sees, weighing every visible key alike."""
    x = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
    keys, values = layer.update_and_fetch(x, x)
    out = mx.fast.scaled_dot_product_attention(x * 0, keys, values, scale=1.0, mask=mask)
    return out[0, 0, :, 0].tolist()


@cache
def rotating_masks() -> bool:
    """Whether, for a rotating cache that keeps its first tokens, :func:`_decode_mask` gives a
    call of several tokens what one-token steps see (mlx-lm's buffer layout and mask hook)."""
    try:
        steps, call = RotatingKVCache(max_size=4, keep=1), RotatingKVCache(max_size=4, keep=1)
        for layer in (steps, call):
            for token in range(6):
                _rotating_feed(layer, [float(token)])
        one_at_a_time = [
            _attend(steps, [t], steps.make_mask(1, return_array=True)) for t in (6.0, 7.0, 8.0)
        ]
        with decode_masks([call]):
            together = _attend(call, [6.0, 7.0, 8.0], call.make_mask(3))
        got = [round(v, 4) for v in together]
        want = [round(v[0], 4) for v in one_at_a_time]
        if got != want:
            raise AssertionError(f"a call saw {got}, one-token steps {want}")
        return True
    except Exception as error:
        _lost("giving a sliding-window cache that keeps its first tokens a verification", error)
        return False


@contextmanager
def decode_masks(layers: list[Any]) -> Iterator[None]:
    """Within it, calls of several tokens see in every rotating cache of ``layers`` with
    ``keep > 0`` the context that one-token steps would (see :func:`_decode_mask`)."""
    rotating = [c for c in layers if isinstance(c, RotatingKVCache) and c.keep > 0]
    for layer in rotating:
        layer.make_mask = lambda *args, layer=layer, **kwargs: _decode_mask(layer, *args, **kwargs)
    try:
        yield
    finally:
        for layer in rotating:
            del layer.make_mask


# --- snapshots ---------------------------------------------------------------------------------


def _frozen(value: Any) -> Any:
    """``value`` with every array held through a new object and containers copied: an array that
    a cache overwrites in place (``a[i] = x`` rebinds the array object) then leaves the copy as
    it was."""
    if isinstance(value, mx.array):
        return copy.copy(value)
    if isinstance(value, list):
        return [_frozen(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def snapshot(layer: Any) -> tuple[str, Any]:
    """What restores ``layer`` exactly: its ``state`` (and ``meta_state``) where those set every
    attribute it keeps, else its attributes (always exact)."""
    names = frozenset(vars(layer))
    if _state_covers(layer, names):
        meta = layer.meta_state if hasattr(layer, "meta_state") else None
        return "state", _frozen((layer.state, meta))
    return "vars", _frozen(vars(layer))


_covers: dict[tuple[type, frozenset[str]], bool] = {}


def _state_covers(layer: Any, names: frozenset[str]) -> bool:
    """Whether setting ``layer``'s state on a bare instance sets all of ``names`` (decided on the
    first cache of its class and attributes, then remembered)."""
    key = (type(layer), names)
    if key not in _covers:
        try:
            prop = getattr(type(layer), "state", None)
            if not isinstance(prop, property) or prop.fset is None:
                raise AttributeError("state cannot be set")
            clone = type(layer).__new__(type(layer))
            clone.state = layer.state
            if hasattr(layer, "meta_state"):
                clone.meta_state = layer.meta_state
            _covers[key] = set(vars(clone)) == set(names)
        except Exception:  # a state that cannot be set back: take the attributes
            _covers[key] = False
    return _covers[key]


def restore(layer: Any, saved: tuple[str, Any]) -> None:
    """Puts ``layer`` back as :func:`snapshot` saw it."""
    how, value = saved
    if how == "state":
        state, meta = _frozen(value)
        layer.state = state
        if meta is not None:
            layer.meta_state = meta
    else:
        vars(layer).clear()
        vars(layer).update(_frozen(value))


#: Cache classes that models define for themselves and that a checkpoint restores (every update
#: rebinds their attributes), matched by name since their modules are optional.
RESTORED_BY_NAME = frozenset({"LayerCache"})


# --- gated delta-net states ------------------------------------------------------------------

_local = threading.local()


@dataclass
class Positions:
    """What one gated delta-net layer's cache holds after each position of one call.

    Attributes:
        conv_input (array): ``[B, K - 1 + S, C]``: the convolution's state before the call
            followed by the rows of the ``S`` tokens fed.
        states (list): ``S`` arrays ``[B, Hv, Dv, Dk]``: the recurrent state after each token.
    """

    conv_input: mx.array
    states: list[mx.array] = field(default_factory=list)

    def after(self, count: int) -> list[mx.array]:
        """The layer's cache entries ``[conv state, recurrent state]`` after ``count`` tokens of
        the call, ``1 <= count <= S``."""
        width = self.conv_input.shape[1] - len(self.states)
        return [mx.contiguous(self.conv_input[:, count : count + width]), self.states[count - 1]]


def _layer_classes() -> tuple[type, ...]:
    """The layer classes whose call this module knows: the state lives in ``cache[0]`` (the
    convolution's last ``K - 1`` input rows) and ``cache[1]`` (``gated_delta_update``'s)."""
    from mlx_lm.models import qwen3_5, qwen3_next

    return (qwen3_next.Qwen3NextGatedDeltaNet, qwen3_5.GatedDeltaNet)


def _recording() -> list[Positions] | None:
    return getattr(_local, "records", None)


@cache
def _noting(conv_class: type) -> type:
    """A subclass of ``conv_class`` that notes its input while :func:`tracking` runs."""

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        records = _recording()
        if records is not None:
            records.append(Positions(x))
        return conv_class.__call__(self, x)

    return type(conv_class.__name__, (conv_class,), {"__call__": __call__, "_notes": True})


def _noting_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` (mlx-lm's one-position recurrence), noting each state it makes for the layer
    whose call :func:`_stepwise` runs."""

    def noted(*args: Any, **kwargs: Any) -> tuple[mx.array, mx.array]:
        y, state = step(*args, **kwargs)
        positions = getattr(_local, "noting", None)
        if positions is not None:
            positions.states.append(state)
        return y, state

    noted.notes = True
    noted.unnoted = step
    return noted


def _stepwise(update: Callable[..., Any]) -> Callable[..., Any]:
    """``update`` (mlx-lm's ``gated_delta_update``), each position's state noted beside the
    layer's convolution input while :func:`tracking` runs."""

    def gated_delta_update(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,  # mlx-lm's argument names
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        **options: Any,
    ) -> tuple[mx.array, mx.array]:
        records = _recording()
        if records is None or not records or records[-1].states:
            return update(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
        positions = records[-1]
        _local.noting = positions
        try:
            out = update(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
        finally:
            _local.noting = None
        if len(positions.states) == q.shape[1]:
            return out
        # A kernel made only the last state: that call, lazy, is dropped unevaluated.
        positions.states.clear()
        ys = []
        for t in range(q.shape[1]):
            position = slice(t, t + 1)
            y, state = update(
                q[:, position],
                k[:, position],
                v[:, position],
                a[:, position],
                b[:, position],
                A_log,
                dt_bias,
                state,
                None if mask is None else mask[:, position],
                **options,
            )
            ys.append(y)
            positions.states.append(state)
        return mx.concatenate(ys, axis=1), state

    gated_delta_update.stepwise = True
    gated_delta_update.unwrapped = update
    return gated_delta_update


def _install(layers: list[nn.Module]) -> None:
    """Makes ``layers`` (gated delta-net layers) record their states within :func:`tracking`."""
    from mlx_lm.models import gated_delta

    step = gated_delta._gated_delta_step_ops
    if not getattr(step, "notes", False):
        gated_delta._gated_delta_step_ops = _noting_step(step)
    for layer in layers:
        module = sys.modules[type(layer).__call__.__module__]
        if not getattr(module.gated_delta_update, "stepwise", False):
            module.gated_delta_update = _stepwise(module.gated_delta_update)
        if not getattr(layer.conv1d, "_notes", False):
            layer.conv1d.__class__ = _noting(type(layer.conv1d))


def _uninstall(layers: list[nn.Module]) -> None:
    for layer in layers:
        if getattr(layer.conv1d, "_notes", False):
            layer.conv1d.__class__ = type(layer.conv1d).__bases__[0]


def _tracked_layer_works(layer: nn.Module) -> None:
    """Raises unless ``layer``, called on three positions within :func:`tracking`, records the
    states that three one-position calls leave (checked on a fresh cache)."""
    from mlx_lm.models.cache import ArraysCache

    x = mx.random.normal((1, 3, layer.hidden_size), key=mx.random.key(0)) * 0.1
    whole, steps = ArraysCache(size=2), ArraysCache(size=2)
    with tracking() as records:
        layer(x, cache=whole)
    for t in range(3):
        layer(x[:, t : t + 1], cache=steps)
    if len(records) != 1 or len(records[0].states) != 3:
        raise AssertionError(f"recorded {[len(r.states) for r in records]} states, not [3]")
    kept = records[0].after(3)
    for mine, theirs in zip(kept, steps.cache, strict=True):
        scale = float(mx.abs(theirs).max().item()) or 1.0
        if float(mx.abs(mine.astype(mx.float32) - theirs.astype(mx.float32)).max()) > 1e-2 * scale:
            raise AssertionError("the recorded states are not the one-position states")


_track_lock = threading.Lock()


def track(model: nn.Module) -> int:
    """Makes ``model``'s gated delta-net layers record their states within :func:`tracking`.

    Idempotent, and changes nothing outside :func:`tracking`. The first time a model is
    tracked, one of its layers is checked on three positions (:func:`_tracked_layer_works`);
    where that fails, nothing is tracked and a warning says so once.

    Args:
        model (nn.Module): any mlx-lm model.

    Returns:
        int: how many of its layers are tracked (``0`` for a model without such layers, or
        where the check failed).
    """
    try:
        classes = _layer_classes()
    except (ImportError, AttributeError) as error:
        _lost("keeping gated delta-net states", error)
        return 0
    layers = [m for m in modules(model) if isinstance(m, classes)]
    if not layers:
        return 0
    with _track_lock:
        try:
            _install(layers)
            if not getattr(model, "_mlx_spec_tracked", False):
                _tracked_layer_works(layers[0])
        except Exception as error:
            _uninstall(layers)
            _lost("keeping gated delta-net states", error)
            return 0
        object.__setattr__(model, "_mlx_spec_tracked", True)
    return len(layers)


@contextmanager
def tracking() -> Iterator[list[Positions]]:
    """Within it, on this thread, each call of a tracked layer (see :func:`track`) appends its
    :class:`Positions` to the list it gives, in the order the layers run."""
    previous = _recording()
    records: list[Positions] = []
    _local.records = records
    try:
        yield records
    finally:
        _local.records = previous


# --- models ----------------------------------------------------------------------------------


def modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module of ``model``, in the order of ``model.modules()``, found by walking its
    members (an ``nn.Module`` is a dict of them): ``modules()`` flattens each module's whole tree
    of members, arrays included, and a generation asks for a model's modules several times, so
    walking them is several times faster on models of many layers. Lazily, so that a search
    that stops at the first match (a model's embedding comes early) walks no further."""
    stack = [model]
    while stack:
        module = stack.pop()
        yield module
        _push_children(stack, module.values())


def _push_children(stack: list[nn.Module], members: Any) -> None:
    """Pushes the modules among ``members`` (in lists and dicts too), in their order."""
    for member in members:
        if isinstance(member, nn.Module):
            stack.append(member)
        elif isinstance(member, list | tuple):
            _push_children(stack, member)
        elif isinstance(member, dict):
            _push_children(stack, member.values())


# --- hidden states ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """A model as its backbone and its LM head: ``model(x, cache)`` is
    ``head(backbone(x, cache))``, and the backbone's output (the input of the head, after the
    final norm) is the hidden state drafters that read the target's states take.

    Attributes:
        backbone (callable): ``(tokens [B, L], cache) -> [B, L, H]``.
        head (callable): ``[..., H] -> [..., V]`` logits.
        embed (callable): ``[...] ids -> [..., H]``: the token embedding.
        text (nn.Module): the language model whose ``model`` is the backbone (a model that wraps
            one, as Qwen3.5's does, has it as ``language_model``).
    """

    backbone: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]
    embed: Callable[[mx.array], mx.array]
    text: nn.Module


def split(model: nn.Module) -> Split | None:
    """``model`` as backbone and head (see :class:`Split`), or ``None`` where it is not built so:
    checked once per model, on two tokens, by comparing ``head(backbone(x))`` with ``model(x)``
    (a model whose logits are more than its head's output, a soft cap say, fails)."""
    known = getattr(model, "_mlx_spec_split", None)
    if known is not None:
        return known or None
    text = getattr(model, "language_model", model)
    backbone = getattr(text, "model", None)
    found = None
    if backbone is not None and hasattr(backbone, "embed_tokens"):
        lm_head = getattr(text, "lm_head", None)
        head = lm_head if lm_head is not None else backbone.embed_tokens.as_linear
        candidate = Split(backbone, head, backbone.embed_tokens, text)
        try:
            from mlx_lm.models.cache import make_prompt_cache

            x = mx.array([[0, 1]])
            whole = model(x, cache=make_prompt_cache(model))
            parts = head(backbone(x, cache=make_prompt_cache(model)))
            if whole.shape == parts.shape and mx.array_equal(whole, parts).item():
                found = candidate
        except Exception as error:  # a model of another build: its states are not read
            _lost("reading the target's hidden states", error)
    object.__setattr__(model, "_mlx_spec_split", found or False)
    return found


def decoder_layer(model: nn.Module) -> nn.Module:
    """A new decoder layer of ``model``'s own kind, for an MTP head: full attention (a hybrid's
    attention layer), and the MLP or MoE of the model's last layers; called ``layer(x, mask,
    cache)``.

    Raises:
        ValueError: ``model``'s family is not one this knows (the message names it).
    """
    text = getattr(model, "language_model", model)
    module = sys.modules[type(text).__module__]
    args = text.args
    family = module.__name__.rsplit(".", 1)[-1]
    if family == "qwen3_next":
        return module.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)
    if family == "qwen3_5":
        return module.DecoderLayer(args, args.full_attention_interval - 1)
    if family == "deepseek_v3":
        return module.DeepseekV3DecoderLayer(args, args.num_hidden_layers)
    if family == "glm4_moe":
        return module.DecoderLayer(args, args.num_hidden_layers)
    if hasattr(module, "TransformerBlock"):  # llama, qwen2, qwen3, mistral and their kin
        return module.TransformerBlock(args)
    raise ValueError(f"an MTP head for a {family} model is not known (its decoder layer)")


# --- attention ---------------------------------------------------------------------------------

_attention_lock = threading.Lock()
_attention_users = 0
_attention_original: Callable[..., mx.array] | None = None


@contextmanager
def scoped_attention(wrap: Callable[[Callable[..., mx.array]], Callable[..., mx.array]]):
    """Within it, ``mx.fast.scaled_dot_product_attention`` is ``wrap(original)`` (mlx-lm's
    models look it up at every call); MLX's own is put back when the last user leaves.

    ``wrap``'s function must do what the original does outside the thread and calls it means
    to change: other threads may attend meanwhile.
    """
    global _attention_users, _attention_original
    with _attention_lock:
        if _attention_users == 0:
            _attention_original = mx.fast.scaled_dot_product_attention
            mx.fast.scaled_dot_product_attention = wrap(_attention_original)
        _attention_users += 1
    try:
        yield
    finally:
        with _attention_lock:
            _attention_users -= 1
            if _attention_users == 0:
                mx.fast.scaled_dot_product_attention = _attention_original
                _attention_original = None


# --- mlx-lm's server -------------------------------------------------------------------------
#
# mlx_lm.server's request handler (``APIHandler.handle_completion``) asks its generation thread
# for a request's context, then sends the 200 status line (a stream) or buffers it (a whole
# body) before it reads the first token. An error the generation raises after that escapes the
# handler, and the client's connection is closed with no answer. Its prompt cache
# (``LRUPromptCache``, made by name in the server's ``run``) returns, for a prompt it holds
# exactly, the cache and no token to feed, which no loop can generate from: a cache holds no
# logits. Its generation thread (``ResponseGenerator._run_generate``) must end with
# ``mx.clear_streams()`` (docs/design.md, "Working around MLX 0.32"). And it batches the requests
# to a model without a draft model (``ModelProvider._load`` sets ``is_batchable``, which
# ``ResponseGenerator._is_batchable`` reads), through a generation that does not draft.


class _Refused(BaseException):
    """A request's generation failed before the handler sent anything: carried past mlx-lm's
    handler (whose ``except Exception`` would answer 404) to :func:`_answering`'s wrapper.

    Attributes:
        error (Exception): what the generation raised.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _RequestRefused(ValueError):
    """A request the patched server refuses before it starts the generation (answered 400)."""


class _CheckedResponses:
    """A handler's ``ResponseGenerator`` whose ``generate`` reads a request's first event (a
    stream) or all of them (a whole body) before it returns, so that an error raised by then
    becomes a :class:`_Refused`; everything else is the generator's own."""

    def __init__(self, generator: Any, stream: bool) -> None:
        self._generator = generator
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def generate(
        self, request: Any, args: Any, progress_callback: Callable[..., None] | None = None
    ) -> tuple[Any, Iterator[Any]]:
        if not self._stream:
            # A whole body is sent once the generation ends: read it all now, in this thread.
            ctx, responses = self._started(request, args, progress_callback)
            try:
                return ctx, iter(list(responses))
            except Exception as error:
                raise _Refused(error) from error
        # A stream: read on another thread until the generation starts (its first prompt
        # progress, after the loop checked its arguments) or fails; then hand on what it read.
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        ctx, responses = self._started(request, args, lambda *done: events.put(("progress", done)))

        def pump() -> None:
            try:
                for response in responses:
                    events.put(("response", response))
            except Exception as error:  # the generation's, or "generation thread died"
                events.put(("error", error))
            else:
                events.put(("end", None))

        threading.Thread(target=pump, name="mlx-spec request", daemon=True).start()
        first = events.get()
        if first[0] == "error":
            raise _Refused(first[1]) from first[1]

        def handed_on() -> Iterator[Any]:
            kind, value = first
            while kind != "end":
                if kind == "error":
                    raise value
                if kind == "response":
                    yield value
                elif progress_callback is not None:
                    progress_callback(*value)
                kind, value = events.get()

        return ctx, handed_on()

    def _started(self, request: Any, args: Any, progress: Any) -> tuple[Any, Iterator[Any]]:
        """The generator's ``generate``, a request it refused before starting a :class:`_Refused`
        (mlx-lm's handler would answer it 404)."""
        try:
            return self._generator.generate(request, args, progress)
        except _RequestRefused as error:
            raise _Refused(error) from error


def _status(error: BaseException) -> int:
    """400 for an argument the loop refused, 500 for anything else."""
    return 400 if isinstance(error, ValueError) else 500


def _log(error: BaseException) -> None:
    if _status(error) == 400:
        logging.warning("mlx-spec: refused a request: %s", error)
    else:
        logging.error("mlx-spec: a request failed", exc_info=error)


def _answer(handler: Any, error: BaseException) -> None:
    """Answers ``handler``'s request, of which nothing was sent yet, with ``error``."""
    _log(error)
    body = json.dumps({"error": str(error)}).encode()
    status = _status(error)
    set_headers = getattr(handler, "_set_completion_headers", None)
    if callable(set_headers):  # mlx-lm's: the status, the JSON type, its CORS headers
        set_headers(status)
    else:
        handler.send_response(status)
        handler.send_header("Content-type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()


def _answer_in_stream(handler: Any, error: BaseException) -> None:
    """Ends ``handler``'s stream, whose 200 status was sent, with an error event and [DONE]."""
    _log(error)
    event = json.dumps({"error": str(error), "code": _status(error)})
    handler.wfile.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
    handler.wfile.flush()


def _answering(handle_completion: Callable[..., None]) -> Callable[..., None]:
    """``APIHandler.handle_completion`` answering every error of the generation: a 400 (an
    argument the loop refused: a ``ValueError``) or 500 with ``{"error": message}`` before
    anything was sent, else an error event ending the stream. A client that hung up is left as
    mlx-lm leaves it."""

    def answering(self: Any, request: Any, stop_words: list[str]) -> None:
        generator = self.response_generator
        self.response_generator = _CheckedResponses(generator, bool(self.stream))
        try:
            handle_completion(self, request, stop_words)
        except _Refused as refused:
            _answer(self, refused.error)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as error:
            if not self.stream:
                raise  # mlx-lm's own formatting failed, its status line buffered: its case
            _answer_in_stream(self, error)
        finally:
            self.response_generator = generator

    return answering


def _refeeding(prompt_cache_class: type) -> type:
    """A subclass of mlx-lm's ``LRUPromptCache`` that never returns an empty rest: for a prompt
    it holds exactly, the cache less its last token (trimmed) and that token to feed again, or,
    where the cache cannot be trimmed, the nearest cache of the prompt less that token."""

    class RefeedingPromptCache(prompt_cache_class):
        """mlx-lm's prompt cache, which never answers a prompt with no token to feed."""

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            cache, rest = self._nearest(model, tokens)
            # What the cache holds, for drafters that copy from the text (server_cached_tokens).
            _fetched.record = (cache, list(tokens[: len(tokens) - len(rest)]))
            return cache, rest

        def _nearest(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is None or len(rest) or not len(tokens):
                return cache, rest
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                return cache, list(tokens[-1:])
            cache, rest = self._nearest(model, tokens[:-1])
            return cache, [*rest, *tokens[-1:]]

    return RefeedingPromptCache


_fetched = threading.local()


def server_cached_tokens(prompt_cache: Any) -> list[int] | None:
    """The tokens the patched server's prompt cache said ``prompt_cache`` holds, when this thread
    fetched it last (the server then generates from it on the same thread); else ``None``."""
    record = getattr(_fetched, "record", None)
    if record is None or record[0] is not prompt_cache or prompt_cache is None:
        return None
    return record[1]


def _refeeding_works(prompt_cache_class: type) -> None:
    """Raises unless :func:`_refeeding`'s subclass of ``prompt_cache_class`` answers a prompt of
    two tokens that it holds exactly with the cache of the first and the second to feed."""
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 1, 2, 1)), mx.zeros((1, 1, 2, 1)))
    prompt_cache = _refeeding(prompt_cache_class)()
    prompt_cache.insert_cache("probe", [7, 8], [layer])
    cache, rest = prompt_cache.fetch_nearest_cache("probe", [7, 8])
    if rest != [8] or [c.offset for c in cache] != [1]:
        raise AssertionError(f"an exact hit gave {rest} to feed after {cache}")


def _clearing_streams(run_generate: Callable[[Any], None]) -> Callable[[Any], None]:
    """``ResponseGenerator._run_generate`` ending with ``mx.clear_streams()``."""

    def run_then_clear_streams(self: Any) -> None:
        try:
            run_generate(self)
        finally:
            mx.clear_streams()

    return run_then_clear_streams


def _part_lost(module: str, what: str, why: BaseException | str, cost: str) -> None:
    """Warns once per ``what`` that a patch of ``module`` cannot do it, and what that costs."""
    with _warn_lock:
        if what in _warned:
            return
        _warned.add(what)
    warnings.warn(
        f"mlx-spec: this mlx-lm ({_version()}) changed what {what} in {module} relies on "
        f"({why}); {cost}",
        RuntimeWarning,
        stacklevel=4,
    )


def _never(model: Any) -> bool:
    return False


def _no_batches(model: Any, draft_model: Any) -> None:
    return None


#: What the patched server asks of each model it loads (set by :func:`patch_server`):
#: ``serial(model)``, whether it serves the model's requests one at a time; and
#: ``batches(model, draft_model)``, the maker of the generator that batches them speculatively,
#: or ``None``.
_choices: dict[str, Callable[..., Any]] = {"serial": _never, "batches": _no_batches}

#: The loaded model whose requests batch speculatively, if any: ``model`` (a weak reference),
#: ``make`` (its generator's maker) and ``most`` (the server's ``--num-draft-tokens``).
_speculating: dict[str, Any] = {}


class DraftTokens(list):
    """A request's logits processors (a list, as mlx-lm's server makes them) that also carry its
    ``num_draft_tokens`` to the generator that batches it.

    Attributes:
        num_draft_tokens (int): the most draft tokens a round the request asked for.
    """

    def __init__(self, processors: Any, num_draft_tokens: int) -> None:
        super().__init__(processors)
        self.num_draft_tokens = num_draft_tokens


def _speculating_on(model: Any) -> bool:
    """Whether ``model`` is the loaded model whose requests batch speculatively."""
    return bool(_speculating) and model is not None and _speculating["model"]() is model


def _choosing(load: Callable[..., None]) -> Callable[..., None]:
    """``ModelProvider._load`` that makes a model which ``serial`` names not batchable (its
    requests then go one at a time through ``stream_generate``, which drafts for them), and one
    for which ``batches`` gives a maker batchable, with a draft model too (its requests then
    batch speculatively: :func:`_batching`)."""

    def load_and_choose(self: Any, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        _speculating.clear()
        if self.model is None:
            return
        if _choices["serial"](self.model):
            self.is_batchable = False
            return
        make = _choices["batches"](self.model, getattr(self, "draft_model", None))
        if make is not None and _batching_patched():
            most = getattr(getattr(self, "cli_args", None), "num_draft_tokens", None)
            most = 3 if most is None else most  # mlx-lm's default, where it has no such option
            _speculating.update(model=weakref.ref(self.model), make=make, most=most)
            self.is_batchable = True

    return load_and_choose


#: The server's keyword arguments to ``BatchGenerator`` that a speculative generator takes.
_GENERATOR_ARGUMENTS = frozenset(
    {"completion_batch_size", "prefill_batch_size", "prefill_step_size", "stream"}
)


def _batching(batch_generator: type) -> Callable[..., Any]:
    """``BatchGenerator`` as the server calls it: the speculative generator for the model whose
    requests batch speculatively, mlx-lm's own for any other or other arguments."""

    def make(model: Any, **kwargs: Any) -> Any:
        if _speculating_on(model) and set(kwargs) <= _GENERATOR_ARGUMENTS:
            logging.info("mlx-spec: batching speculative requests")
            return _speculating["make"](model, num_draft_tokens=_speculating["most"], **kwargs)
        return batch_generator(model, **kwargs)

    return make


def _batchable_request(is_batchable: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    """``ResponseGenerator._is_batchable`` that, for a model whose requests batch speculatively,
    also leaves to be served one at a time a request with more draft tokens than the server's
    ``--num-draft-tokens``, and every request of a server split over processes (whose batches
    mlx-spec has not run)."""

    def batchable(self: Any, args: Any) -> bool:
        if not is_batchable(self, args):
            return False
        if not _speculating_on(getattr(self.model_provider, "model", None)):
            return True
        if getattr(self, "_is_distributed", False):
            return False
        n = args.num_draft_tokens
        return isinstance(n, int) and 0 <= n <= _speculating["most"]

    return batchable


def _carrying_draft_tokens(make_processors: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The server's ``_make_logits_processors(args)`` giving a :class:`DraftTokens`."""

    def make(args: Any) -> DraftTokens:
        return DraftTokens(make_processors(args), args.num_draft_tokens)

    return make


def _refusing_empty_prompts(tokenize: Callable[..., Any]) -> Callable[..., Any]:
    """``ResponseGenerator._tokenize`` refusing a request whose prompt has no token, with a
    ``ValueError`` the server answers (a batch given an empty prompt would end the generation
    thread: mlx-lm's raises there, outside the ``try`` that answers errors)."""

    def tokenize_non_empty(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        tokenized = tokenize(self, tokenizer, request, args)
        if not len(tokenized[0]):
            raise _RequestRefused(
                "mlx_lm.server (patched): `prompt` must be a non-empty list of tokens, got a "
                "request whose text gives none"
            )
        return tokenized

    return tokenize_non_empty


#: The names :func:`_batching_probes` replaces, which batch speculative requests all together.
_BATCHING_NAMES = frozenset(
    {"BatchGenerator", "_is_batchable", "_make_logits_processors", "_tokenize"}
)


def _batching_patched() -> bool:
    """Whether :func:`patch_server` replaced every part that batches speculative requests."""
    return _BATCHING_NAMES <= {name for _, name in _server_originals}


#: What :func:`patch_server` replaced: ``(owner, name) -> original``.
_server_originals: dict[tuple[Any, str], Any] = {}


def _unpatched(owner: Any, name: str) -> Any:
    """``owner.name`` as mlx-lm defines it, also while :func:`patch_server` replaces it (so that a
    probe run again tests mlx-lm's, not the replacement); ``None`` where there is none."""
    return _server_originals.get((owner, name), getattr(owner, name, None))


def _server_probes(server: Any) -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """What :func:`patch_server` replaces, where this mlx-lm's server still has it as expected:
    the owner, the name and the replacement's maker of each (a warning for each missing)."""
    found = []
    handler = getattr(server, "APIHandler", None)
    generator = getattr(server, "ResponseGenerator", None)
    try:
        parameters = list(inspect.signature(_unpatched(handler, "handle_completion")).parameters)
        generate = inspect.signature(generator.generate).parameters
        if parameters != ["self", "request", "stop_words"] or "progress_callback" not in generate:
            raise AttributeError(f"handle_completion{parameters}, generate{list(generate)}")
        if "response_generator" not in inspect.signature(handler.__init__).parameters:
            raise AttributeError("APIHandler takes no response_generator")
        found.append((handler, "handle_completion", _answering))
    except (AttributeError, TypeError, ValueError) as error:
        _part_lost(
            "mlx_lm.server",
            "answering every request",
            error,
            "an error during a generation may close the connection without an answer",
        )
    try:
        _refeeding_works(_unpatched(server, "LRUPromptCache"))
        found.append((server, "LRUPromptCache", _refeeding))
    except Exception as error:
        _part_lost(
            "mlx_lm.server",
            "answering a prompt its prompt cache holds exactly",
            error,
            "such a request is refused (an empty prompt) instead of answered",
        )
    if callable(getattr(generator, "_run_generate", None)):
        found.append((generator, "_run_generate", _clearing_streams))
    else:
        _part_lost(
            "mlx_lm.server",
            "ending its generation thread with mx.clear_streams()",
            "no ResponseGenerator._run_generate",
            "the server may abort at exit ('terminate called without an active exception')",
        )
    provider = getattr(server, "ModelProvider", None)
    try:
        sets = _unpatched(provider, "_load").__code__.co_names
        reads = _unpatched(generator, "_is_batchable").__code__.co_names
        if "is_batchable" not in sets or "is_batchable" not in reads:
            raise AttributeError("ModelProvider._load or _is_batchable has no is_batchable")
        found.append((provider, "_load", _choosing))
    except AttributeError as error:
        _part_lost(
            "mlx_lm.server",
            "serving a model's requests one at a time",
            error,
            "the requests to a model with an MTP head are batched, without drafts",
        )
        return found
    try:
        found += _batching_probes(server, generator)
    except (AttributeError, TypeError, ValueError) as error:
        _part_lost(
            "mlx_lm.server",
            "batching speculative requests",
            error,
            "the requests with a draft model are served one at a time, and prompt lookup "
            "leaves batched requests alone",
        )
    return found


def _batching_probes(server: Any, generator: Any) -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """The parts that batch speculative requests, where the server makes its ``BatchGenerator``
    by that name with the arguments :class:`mlx_spec.serving.ServerBatchGenerator` takes, asks
    ``_is_batchable(args)`` of each request and makes its processors with
    ``_make_logits_processors(args)``; else raises."""
    source = inspect.getsource(_unpatched(generator, "_generate"))
    for needed in ("BatchGenerator(", "_make_logits_processors(args)", "insert_segments("):
        if needed not in source:
            raise AttributeError(f"ResponseGenerator._generate has no {needed}")
    if not isinstance(_unpatched(server, "BatchGenerator"), type):
        raise TypeError("mlx_lm.server.BatchGenerator is not a class")
    if list(inspect.signature(_unpatched(server, "_make_logits_processors")).parameters) != [
        "args"
    ]:
        raise TypeError("mlx_lm.server._make_logits_processors does not take (args)")
    if list(inspect.signature(_unpatched(generator, "_is_batchable")).parameters) != [
        "self",
        "args",
    ]:
        raise TypeError("ResponseGenerator._is_batchable does not take (self, args)")
    tokenize = list(inspect.signature(_unpatched(generator, "_tokenize")).parameters)
    if tokenize != ["self", "tokenizer", "request", "args"] or "prompt, " not in source:
        raise TypeError(f"ResponseGenerator._tokenize{tokenize} does not give the prompt first")
    return [
        (server, "BatchGenerator", _batching),
        (generator, "_is_batchable", _batchable_request),
        (server, "_make_logits_processors", _carrying_draft_tokens),
        (generator, "_tokenize", _refusing_empty_prompts),
    ]


def patch_server(
    *,
    serial: Callable[[Any], bool] = _never,
    batches: Callable[[Any, Any], Callable[..., Any] | None] = _no_batches,
) -> bool:
    """Makes ``mlx_lm.server`` (imported here) answer every request; idempotent.

    - ``APIHandler.handle_completion`` answers an error raised by a generation with an HTTP
      error (400 for a ``ValueError``, else 500, with ``{"error": message}``), or, once a
      stream's 200 status was sent, with an error event and ``data: [DONE]``.
    - ``LRUPromptCache``, as the server makes it, answers a prompt it holds exactly with the
      cache less the last token and that token, so that the next token is computed again.
    - ``ResponseGenerator._run_generate`` ends the generation thread with ``mx.clear_streams()``.
    - ``ModelProvider._load`` marks a model for which ``serial(model)`` holds not batchable, so
      that its requests go one at a time through ``stream_generate`` (which drafts), not through
      batched generation (which does not); and one for which ``batches(model, draft_model)``
      gives a maker batchable, also with a draft model.
    - The server's ``BatchGenerator(model, ...)`` gives, for that model, what the maker makes
      (:class:`mlx_spec.serving.ServerBatchGenerator`), with ``num_draft_tokens`` the server's
      ``--num-draft-tokens``; ``_make_logits_processors`` gives a :class:`DraftTokens`, which
      carries each request's ``num_draft_tokens`` to it (with its logits processors); and
      ``_is_batchable`` leaves a request with more draft tokens than that to be served one at a
      time.

    Args:
        serial (callable): ``serial(model) -> bool``, asked of each model the server loads.
            Default: no model.
        batches (callable): ``batches(model, draft_model)``, asked of each model the server
            loads that is not served one at a time: ``None``, or ``make(model, *,
            num_draft_tokens, completion_batch_size, prefill_batch_size, prefill_step_size,
            stream)`` making the generator that batches its requests. Default: none.

    Returns:
        bool: whether mlx-lm's server could be imported (an mlx-lm without it changes nothing).
    """
    try:
        server = importlib.import_module("mlx_lm.server")
    except ImportError:
        return False
    _choices.update(serial=serial, batches=batches)
    for owner, name, make in _server_probes(server):
        if (owner, name) not in _server_originals:
            original = getattr(owner, name)
            _server_originals[owner, name] = original
            setattr(owner, name, make(original))
    return True


def unpatch_server() -> None:
    """Restores what :func:`patch_server` replaced; idempotent."""
    for (owner, name), original in _server_originals.items():
        setattr(owner, name, original)
    _server_originals.clear()
    _speculating.clear()
    _choices.update(serial=_never, batches=_no_batches)


# --- batch caches ----------------------------------------------------------------------------


def _kept_in_place(layer: BatchKVCache, fed: int, kept: list[int]) -> BatchKVCache:
    """:func:`keep_rows` through the cache's ``trim``, ``prepare(right_padding=...)`` and
    ``finalize``: each row's newest entries past what it keeps are cut, and the row is moved right
    by as many columns, the columns moved in becoming its left padding (what mlx-lm's prompt
    processing does to right-padded prompts)."""
    most = max(kept)
    layer.trim(fed - most)
    shifts = [most - k for k in kept]
    if any(shifts):
        layer.prepare(right_padding=shifts)
        layer.finalize()
    return layer


def _kept_by_rows(layer: BatchKVCache, fed: int, kept: list[int]) -> BatchKVCache:
    """:func:`keep_rows` through public calls alone: each row extracted, trimmed and merged back
    (a copy of the whole cache)."""
    rows = [layer.extract(i) for i in range(len(kept))]
    for row, k in zip(rows, kept, strict=True):
        row.trim(fed - k)
    return BatchKVCache.merge(rows)


def _rows(layer: BatchKVCache) -> list[list[float]]:
    """Each row's first key value per position, as :meth:`BatchKVCache.extract` gives them."""
    return [layer.extract(i).keys[0, 0, :, 0].tolist() for i in range(layer.offset.size)]


@cache
def batch_rows_kept() -> bool:
    """Whether :func:`_kept_in_place` gives what per-row trims give on this mlx-lm: after two
    rows of different lengths are fed three columns and keep 1 and 3 of them, each row holds its
    tokens and the next call's positions follow them."""
    try:
        layer = BatchKVCache([1, 0])
        first = mx.array([[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]).reshape(2, 1, 3, 1)
        layer.update_and_fetch(first, first)
        fed = mx.array([[3.0, -1.0, -1.0], [13.0, 14.0, 15.0]]).reshape(2, 1, 3, 1)
        layer.update_and_fetch(fed, fed)
        layer = _kept_in_place(layer, 3, [1, 3])
        want = [[1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]]
        if _rows(layer) != want or layer.offset.tolist() != [3, 6]:
            raise AssertionError(f"rows {_rows(layer)} at {layer.offset.tolist()}, not {want}")
        return True
    except Exception as error:
        _lost("taking each row of a batch cache back to its own length in place", error)
        return False


def _window_kept(layer: BatchRotatingKVCache, fed: int, kept: list[int]) -> None:
    """:func:`keep_rows` for a batch of sliding windows: the buffer put in temporal order and
    cut to what it holds, its newest ``fed - max(kept)`` columns dropped, then each row that keeps
    fewer moved right, the columns moved in becoming its left padding (as ``finalize`` moves a
    right-padded row)."""
    layer._temporal_order()
    most = max(kept)
    end = layer._idx - (fed - most)
    layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
    layer._idx, layer._offset = end, layer._offset - (fed - most)
    layer.offset = layer.offset - (fed - most)
    if most != min(kept):
        shifts = mx.array([most - k for k in kept])
        layer.keys = dynamic_roll(layer.keys, shifts[:, None], axis=2)
        layer.values = dynamic_roll(layer.values, shifts[:, None], axis=2)
        layer.left_padding = layer.left_padding + shifts
        layer.offset = layer.offset - shifts


def windows_in_order(layers: list[Any]) -> None:
    """Puts each batch of sliding windows among ``layers`` in temporal order, before a call of
    several positions: ``BatchRotatingKVCache.make_mask`` places that call's columns from where
    the buffer's writes have reached (``_idx``), which a rotated buffer's one-position writes
    leave short of its length, so its rows' left padding would not move with the oldest column
    the call drops (mlx-lm's own batches make such calls only on a new batch)."""
    for layer in layers:
        if isinstance(layer, BatchRotatingKVCache) and layer.keys is not None:
            layer._temporal_order()


@cache
def batch_windows_kept() -> bool:
    """Whether :func:`_window_kept` and :func:`windows_in_order` leave each row the window its
    own tokens give on this mlx-lm. A window of 6 holds a short row (one token, left padded) and
    a long one; they keep 1 and 3 of 3 columns, take two one-column steps (which rotate the
    buffer), then a two-column call: each query of each row must see its own newest tokens, up
    to 6, and nothing else."""
    try:
        layer = BatchRotatingKVCache(6, [6, 0])

        def feed(rows: list[list[float]]) -> None:
            x = mx.array(rows).reshape(2, 1, len(rows[0]), 1)
            layer.update_and_fetch(x, x)

        feed([[-1.0] * 6 + [1.0], [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0]])
        feed([[2.0, -1.0, -1.0], [17.0, 18.0, 19.0]])
        _window_kept(layer, 3, [1, 3])
        feed([[3.0], [20.0]])
        feed([[4.0], [21.0]])
        windows_in_order([layer])
        mask = layer.make_mask(2, return_array=True)
        feed([[5.0, 6.0], [22.0, 23.0]])
        seen = [
            [[v for v, m in zip(row, mask[i, 0, q].tolist(), strict=True) if m] for q in (0, 1)]
            for i, row in enumerate(layer.keys[:, 0, :, 0].tolist())
        ]
        want = [
            [[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]],
            [[17.0, 18.0, 19.0, 20.0, 21.0, 22.0], [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]],
        ]
        if seen != want or layer.offset.tolist() != [6, 14]:
            raise AssertionError(f"rows see {seen} at {layer.offset.tolist()}, not {want}")
        return True
    except Exception as error:
        _lost("taking each row of a batch of sliding windows back to its own length", error)
        return False


def keep_rows(layer: Any, fed: int, kept: list[int]) -> Any:
    """Takes each row of a batch cache back after a call that fed ``fed`` columns to every row:
    row ``i`` keeps the first ``kept[i]`` of them.

    A ``BatchKVCache`` has one length for all its rows, each row's tokens ending there after its
    left padding; a row that keeps fewer columns than the most is moved right, its padding
    growing by the difference. Where this mlx-lm's cache does not behave as
    :func:`batch_rows_kept` checks, each row is extracted, trimmed and merged back (exact, with a
    copy of the cache). A ``BatchRotatingKVCache`` (sliding windows) is put in temporal order and
    taken back the same way, where :func:`batch_windows_kept` holds (the caller checks it: a
    window cannot be trimmed row by row).

    Args:
        layer (BatchKVCache or BatchRotatingKVCache): one layer's cache of the batch.
        fed (int): the columns the last call fed every row.
        kept (list of int): for each row, how many of them it keeps, in ``[0, fed]``.

    Returns:
        BatchKVCache or BatchRotatingKVCache: the cache (``layer`` itself, or its replacement).
    """
    if layer.keys is None:
        return layer
    if isinstance(layer, BatchRotatingKVCache):
        _window_kept(layer, fed, kept)
        return layer
    if batch_rows_kept():
        return _kept_in_place(layer, fed, kept)
    return _kept_by_rows(layer, fed, kept)


# --- MLX's categorical draw ------------------------------------------------------------------


def categorical_rows(scores: mx.array, keys: mx.array) -> mx.array:
    """Each row of ``scores`` drawn, in one graph, as ``mx.random.categorical`` draws a
    ``[1, V]`` row with that row's key, where :func:`rows_by_inverse_cdf` holds: the first token
    whose cumulative ``exp(score - max)`` exceeds ``u`` times their sum, ``u`` the key's
    uniform draw, all in float32.

    Args:
        scores (array): ``[n, V]`` float scores (log-probabilities, or a sampler's logits).
        keys (array): ``[n, 2]`` uint32, each row's key.

    Returns:
        array: lazy ``[n]`` uint32 tokens.
    """
    u = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))(keys)
    rows = scores.astype(mx.float32)
    weights = mx.exp(rows - mx.max(rows, axis=-1, keepdims=True))
    below = mx.cumsum(weights, axis=-1) < u * mx.sum(weights, axis=-1, keepdims=True)
    return mx.sum(below, axis=-1).astype(mx.uint32)


@cache
def rows_by_inverse_cdf() -> bool:
    """Whether :func:`categorical_rows` draws what ``mx.random.categorical`` draws row by row
    on this MLX and device, for rows of three float types, masked tokens and ties (MLX 0.32
    draws by inverse CDF; the Gumbel-max draw of earlier versions does not match, and a batch's
    rows are then drawn one call each). Uses no global random state."""
    try:
        count, width = 6, 257
        for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
            rows = 4 * mx.random.normal((count, width), key=mx.random.key(100 + i))
            masked = mx.random.uniform(shape=(count, width), key=mx.random.key(200 + i)) < 0.3
            rows = mx.where(masked, -mx.inf, mx.round(rows) if i else rows).astype(dtype)
            keys = mx.stack([mx.random.key(300 + 7 * i + j) for j in range(count)])
            alone = [mx.random.categorical(rows[j : j + 1], key=keys[j]) for j in range(count)]
            want = mx.concatenate(alone).astype(mx.uint32)
            got = categorical_rows(rows, keys)
            if not mx.array_equal(got, want).item():
                raise AssertionError(f"{got.tolist()} drawn, not {want.tolist()}, for {dtype}")
        return True
    except Exception as error:
        _lost("drawing a batch's rows in one graph as mx.random.categorical draws each", error)
        return False


# --- the report --------------------------------------------------------------------------------


def _tiny_delta_net() -> nn.Module:
    """A qwen3-next model of two tiny layers (a gated delta-net and attention), for the report."""
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=16,
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=2,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[0, 1],
        moe_intermediate_size=0,
        rms_norm_eps=1e-6,
        vocab_size=16,
        num_key_value_heads=1,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        head_dim=8,
        full_attention_interval=2,
    )
    return qwen3_next.Model(args)


def report() -> dict[str, bool]:
    """Runs every probe on tiny inputs (each warns once where it fails).

    Returns:
        dict: for each use of mlx-lm's private side, whether it holds for the installed mlx-lm.
    """
    from mlx_lm.models.cache import ArraysCache

    from . import mtp_convert

    arrays = ArraysCache(size=2)
    rotating = RotatingKVCache(max_size=4)
    server = importlib.import_module("mlx_lm.server")
    return {
        "rotating caches trimmed in place": rotating_trims(),
        "batch cache rows taken back in place": batch_rows_kept(),
        "batched sliding windows taken back in place": batch_windows_kept(),
        "a batch's rows drawn in one graph": rows_by_inverse_cdf(),
        "rotating caches that keep tokens verified in one call": rotating_masks(),
        "gated delta-net states kept": track(_tiny_delta_net()) == 1,
        "ArraysCache snapshots through state": snapshot(arrays)[0] == "state",
        "RotatingKVCache snapshots through state": snapshot(rotating)[0] == "state",
        "mlx-lm's functions found": lm.greedy_sampler is not None,
        "mlx-lm's server patched whole": len(_server_probes(server)) == 8,
        "mlx-lm's load takes mlx_spec.load's parameters": (
            list(inspect.signature(lm.load).parameters)
            == list(inspect.signature(mtp_convert.load).parameters)
        ),
        "mlx-lm's command and server load through load": all(
            _loads_by_name(*where) for where in _LOAD_CALLERS.values()
        ),
    }


if __name__ == "__main__":
    results = report()
    for what, holds in results.items():
        print(f"{'holds' if holds else 'FAILS'}  {what}")
    sys.exit(0 if all(results.values()) else 1)
