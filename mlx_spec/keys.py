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

The chain is computed on the host, with the Threefry-2x32 hash MLX's random bits come from: each
state depends on the one before, so on the device every position took a few small operations,
each launched apart (``benchmarks/key_chain.py`` times both ways). Where MLX's own split disagrees
with the host's on a probe key (a generator MLX might change), each split is MLX's, read back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx

__all__ = ["KeyChain", "seed_of", "set_global_state"]

_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
# Two 32-bit lanes of one Python int, 64 bits apart: a carry out of either lane, and what a
# rotation shifts out of either, land in bits the mask clears, so one operation hashes both.
_LANE = 64
_LANES = _MASK | _MASK << _LANE


def _both(word: int) -> int:
    """``word`` in both lanes."""
    return word | word << _LANE


def _host_split(k0: int, k1: int) -> tuple[int, int, int, int]:
    """``mx.random.split`` of the key ``(k0, k1)``, flattened: its first half (the next state),
    then its second (the draw key).

    MLX fills the ``[2, 2]`` words with Threefry-2x32 (20 rounds) under the key, at the counters
    ``(0, 2)`` and ``(1, 3)``, each hash giving a word of either half; the two hashes run here as
    the two lanes of each word.
    """
    k2 = k0 ^ k1 ^ 0x1BD11BDA
    schedule = (_both(k0), _both(k1), _both(k2))
    x0 = (schedule[0] + (1 << _LANE)) & _LANES  # counters 0 and 1
    x1 = (schedule[1] + (2 | 3 << _LANE)) & _LANES  # counters 2 and 3
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = (x0 + x1) & _LANES
            x1 = (((x1 << r) | (x1 >> (32 - r))) & _LANES) ^ x0
        x0 = (x0 + schedule[(i + 1) % 3]) & _LANES
        x1 = (x1 + schedule[(i + 2) % 3] + _both(i + 1)) & _LANES
    return x0 & _MASK, x0 >> _LANE, x1 & _MASK, x1 >> _LANE


def _device_split(k0: int, k1: int) -> tuple[int, int, int, int]:
    """``mx.random.split`` of the key ``(k0, k1)`` by MLX, flattened (one device read)."""
    return tuple(mx.random.split(mx.array([k0, k1], dtype=mx.uint32)).reshape(-1).tolist())


@cache
def _split() -> Callable[[int, int], tuple[int, int, int, int]]:
    """The host's split where it agrees with MLX's on a probe key, else MLX's."""
    probe = (0x01234567, 0x89ABCDEF)
    return _host_split if _host_split(*probe) == _device_split(*probe) else _device_split


#: Positions whose states and keys go to the device together, as one array that steps and rounds
#: slice: a key array made from host data for every step slowed pipelined plain steps on a CUDA
#: GPU, where the chain on the device had not (``benchmarks/plain_steps.py``).
BLOCK = 32


class KeyChain:
    """The chain of random states ``S_0, S_1, ...`` of one generation's text positions, and the
    key ``K_t = split(S_t)[1]`` that a draw at each position takes.

    Args:
        state (array): ``[2]`` uint32 ``S_0``, the state before the first generated token (read
            once: the chain is computed on the host).
        steps (int): the keys a sampler call draws (how far apart consecutive states are).
            Default: ``1``, as ``mx.random.categorical`` draws.
        global_state (bool): whether ``state`` is ``mx.random``'s global state, which the
            generation then advances as mlx-lm's loop would. Default: ``False``.
    """

    def __init__(self, state: mx.array, steps: int = 1, global_state: bool = False) -> None:
        self.steps = steps
        self.global_state = global_state
        self._next = tuple(state.tolist())
        # Block b: [BLOCK, 4] uint32, row t the words of S_{b * BLOCK + t}, then of its key.
        self._blocks: list[mx.array] = []

    def _rows(self, start: int, count: int, words: slice) -> mx.array:
        """``[count, 2]`` uint32: the ``words`` (``0:2`` the state, ``2:4`` its key) of positions
        ``start`` on, sliced once."""
        first, last = start // BLOCK, max(start + count - 1, start) // BLOCK
        while len(self._blocks) <= last:
            split, rows, state = _split(), [], self._next
            for _ in range(BLOCK):
                halves = split(*state)
                rows.append((*state, *halves[2:]))
                state = halves[:2]
                for _ in range(self.steps - 1):
                    state = split(*state)[:2]
            self._next = state
            self._blocks.append(mx.array(rows, dtype=mx.uint32))
        block = (
            self._blocks[first] if first == last else mx.concatenate(self._blocks[first : last + 1])
        )
        return block[start - first * BLOCK : start - first * BLOCK + count, words]

    def states(self, start: int, count: int) -> mx.array:
        """``[count, 2]`` uint32: ``S_start, ..., S_{start + count - 1}``."""
        return self._rows(start, count, slice(0, 2))

    def keys(self, start: int, count: int) -> mx.array:
        """``[count, 2]`` uint32: ``K_start, ..., K_{start + count - 1}``, the keys that
        ``mx.random.categorical`` takes at those positions in mlx-lm's sequence."""
        return self._rows(start, count, slice(2, 4))

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
