"""The random state of every text position of a generation.

mlx-lm's plain sampling draws each token with the next key of ``mx.random``'s global key sequence:
before the token at position ``t`` (counted from the first generated token) the sequence's state
is ``S_t``; the draw takes ``split(S_t)[1]`` and leaves ``S_{t + 1} = split(S_t)[0]`` (a sampler
that draws several keys a call advances the state as many times). :class:`KeyChain` computes that
chain from the generation's starting state (the caller's key, or ``mx.random``'s state), so that
every sampled decision at position ``t`` takes its randomness from ``S_t`` alone: how the rounds
fall (the drafter, ``N``, timing, ``max_tokens``) cannot change the text, and a seed reproduces
the text of mlx-lm's own plain sampling. It also keeps each position's draw key
``K_t = split(S_t)[1]``, which the split that advances the chain computes anyway, as mlx-lm's
sequence computes the key and the next state with one split.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

__all__ = ["KeyChain", "seed_of", "set_global_state"]

#: Positions computed at a time, as one small graph. Each state costs a split, as much as the
#: call of the graph itself does, and a chunk is computed whether or not its positions are
#: reached: a short generation (a request of a few tokens) would pay for every state a long
#: chunk computes past its end.
CHUNK = 16


@cache
def _advance(steps: int):
    """``state -> (states, keys, following)``: the ``CHUNK`` states from ``state`` on, each
    reached from the one before by ``steps`` splits, the draw key of each (the second half of its
    first split), and the state after them (compiled once)."""

    def chain(state: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        states, keys = [], []
        for _ in range(CHUNK):
            states.append(state)
            state, key = mx.random.split(state)
            keys.append(key)
            for _ in range(steps - 1):
                state = mx.random.split(state)[0]
        return mx.stack(states), mx.stack(keys), state

    return mx.compile(chain)


class KeyChain:
    """The chain of random states ``S_0, S_1, ...`` of one generation's text positions, and the
    key ``K_t = split(S_t)[1]`` that a draw at each position takes.

    Args:
        state (array): ``[2]`` uint32 ``S_0``, the state before the first generated token.
        steps (int): the keys a sampler call draws (how far apart consecutive states are).
            Default: ``1``, as ``mx.random.categorical`` draws.
        global_state (bool): whether ``state`` is ``mx.random``'s global state, which the
            generation then advances as mlx-lm's loop would. Default: ``False``.
    """

    def __init__(self, state: mx.array, steps: int = 1, global_state: bool = False) -> None:
        self.steps = steps
        self.global_state = global_state
        self._states = mx.zeros((0, 2), dtype=mx.uint32)
        self._keys = mx.zeros((0, 2), dtype=mx.uint32)
        self._next = state

    def _reach(self, end: int) -> None:
        """Computes the chain up to position ``end`` (excluded), a chunk at a time."""
        while self._states.shape[0] < end:
            states, keys, self._next = _advance(self.steps)(self._next)
            self._states = mx.concatenate([self._states, states])
            self._keys = mx.concatenate([self._keys, keys])
            # Computed meanwhile, not waited for: a chunk is small, and the rounds read it.
            mx.async_eval(self._states, self._keys, self._next)

    def states(self, start: int, count: int) -> mx.array:
        """``[count, 2]`` uint32: ``S_start, ..., S_{start + count - 1}``."""
        self._reach(start + count)
        return self._states[start : start + count]

    def keys(self, start: int, count: int) -> mx.array:
        """``[count, 2]`` uint32: ``K_start, ..., K_{start + count - 1}``, the keys that
        ``mx.random.categorical`` takes at those positions in mlx-lm's sequence."""
        self._reach(start + count)
        return self._keys[start : start + count]

    def state(self, position: int) -> mx.array:
        """``[2]`` uint32: ``S_position``."""
        return self.states(position, 1)[0]


def seed_of(state: mx.array) -> int:
    """The seed ``s`` with ``mx.random.key(s)`` equal to ``state`` (``[2]`` uint32): one read."""
    high, low = state.tolist()
    return high << 32 | low


def set_global_state(state: mx.array) -> None:
    """Makes ``state`` (``[2]`` uint32) ``mx.random``'s global state, as ``mx.random.seed``
    does (MLX has no other way to set it)."""
    mx.random.seed(seed_of(state))
