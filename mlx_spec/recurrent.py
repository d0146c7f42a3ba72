"""The recurrent state of gated delta-net layers after every position of a call.

A verification feeds the target ``S`` tokens in one call, and a recurrent layer's cache then holds
its state after all of them. When the draft is cut short, the state after an earlier position is
wanted. Without it, the cache is restored from a checkpoint taken before the call and the kept
tokens are fed again (a replay, :mod:`mlx_spec.caches`), which costs a position of the next call
for each of them: about a step each where scoring a position costs what a step does (a CPU).

For the gated delta-net layers of mlx-lm's ``qwen3_next`` and ``qwen3_5`` models (Qwen3-Next,
Qwen3.5 / 3.6, and the models that reuse their layers) this module keeps, within
:func:`tracking`, what their ``ArraysCache`` would hold after each position:

- the convolution's state after ``j`` tokens is ``K - 1`` rows of the convolution's input (the
  old state followed by the new tokens' rows), so the input is recorded;
- mlx-lm's recurrence without a kernel (CPU, CUDA) already computes one position at a time: each
  step's state is noted as it is made, at no cost;
- mlx-lm's Metal kernel returns only the last state: there the recurrence is run one position at
  a time (the kernel on each, as plain decoding's one-token steps run it) and each state noted.

:func:`track` installs what records them, once per model: each such layer's ``conv1d`` gets a
subclass of its class that notes its input, the module that defines the layer calls
``gated_delta_update`` through a wrapper, and mlx-lm's ``gated_delta`` module its one-position
step. Outside :func:`tracking` (other threads, other callers) all do exactly what they did.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["Positions", "track", "tracking"]

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
    return gated_delta_update


def track(model: nn.Module) -> int:
    """Makes ``model``'s gated delta-net layers record their states within :func:`tracking`.

    Idempotent, and changes nothing outside :func:`tracking`.

    Args:
        model (nn.Module): any mlx-lm model.

    Returns:
        int: how many of its layers are tracked (``0`` for a model without such layers).
    """
    from mlx_lm.models import gated_delta

    classes = _layer_classes()
    layers = [m for m in model.modules() if isinstance(m, classes)]
    step = getattr(gated_delta, "_gated_delta_step_ops", None)
    if layers and step is not None and not getattr(step, "notes", False):
        gated_delta._gated_delta_step_ops = _noting_step(step)
    for layer in layers:
        module = sys.modules[type(layer).__call__.__module__]
        if not getattr(module.gated_delta_update, "stepwise", False):
            module.gated_delta_update = _stepwise(module.gated_delta_update)
        if not getattr(layer.conv1d, "_notes", False):
            layer.conv1d.__class__ = _noting(type(layer.conv1d))
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
