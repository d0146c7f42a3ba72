"""Speculation on a target split over processes with ``mx.distributed``.

Every process of a distributed group runs the whole loop: the same draft, the same acceptance,
the same caches. Only the target's calls communicate (the all-sums of a tensor-parallel model,
the sends of a pipeline), and they stay in step only while every rank feeds the target the same
tokens. Greedy decoding is deterministic, so ranks agree by themselves; sampled decoding agrees
only when every rank draws from the same key. This module finds the group a model runs on, agrees
a key on it before the first round, and loads a target sharded the way mlx-lm does.

The loop calls, once at setup::

    key = agree_key(op, key, model_group(model, draft_model), stream=stream)

and derives everything random (draft sampling, acceptance, a drafter's choices) from that key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ._checks import check_key

__all__ = ["agree_key", "fresh_seed", "load_sharded", "model_group"]

Group = mx.distributed.Group
StreamLike = mx.Stream | mx.ThreadLocalStream | mx.Device | None


def _groups(model: nn.Module) -> tuple[list[Group], bool]:
    """The groups of size > 1 that ``model``'s layers hold, and whether it is a pipeline stage."""
    groups: list[Group] = []
    pipeline = False
    for module in model.modules():
        # Sharded layers keep their group as a plain attribute (``group`` for mlx.nn's sharded
        # linears, ``sharding_group`` for mlx-lm's mixture-of-experts blocks).
        for value in vars(module).values():
            if isinstance(value, Group) and value.size() > 1:
                if not any(value is g for g in groups):
                    groups.append(value)
        pipeline = pipeline or getattr(module, "pipeline_size", 1) > 1
    return groups, pipeline


def model_group(*models: nn.Module, group: Group | None = None) -> Group | None:
    """The distributed group whose ranks must run ``models`` in step, or ``None``.

    A model is on a group when its own layers communicate: mlx-lm's ``model.shard(group)``
    replaces linears by ``mlx.nn`` sharded layers that hold ``group`` (and its mixture-of-experts
    blocks keep a ``sharding_group``); ``model.model.pipeline(group)`` sets ``pipeline_size``, and
    a pipeline sends on the global group. Whether ``mx.distributed.init()`` has more than one
    rank does not decide it: ranks that each run a whole model on their own prompts (data
    parallel, as ``mlx_lm.evaluate`` does) must not be made to wait for each other.

    Args:
        models (nn.Module): the target, and any other model of the loop (a replicated draft
            holds no group and changes nothing).
        group (Group, optional): the group, when the caller knows it; detection is skipped.
            Default: detect it from the models.

    Returns:
        Group or None: ``group`` if given; else the one group of size > 1 the layers hold, or
        the global group when they hold several or form a pipeline; ``None`` when no layer
        communicates (one process, or a group of one).
    """
    if group is not None:
        return group if group.size() > 1 else None
    found: list[Group] = []
    pipeline = False
    for model in models:
        groups, stage = _groups(model)
        found.extend(g for g in groups if not any(g is f for f in found))
        pipeline = pipeline or stage
    if pipeline or len(found) > 1:
        return mx.distributed.init()
    return found[0] if found else None


def _global_state() -> mx.array:
    # mx.random's global state, so that mx.random.seed reproduces a run without a key.
    return mx.random.state[0]


def _shown(rows: list[list[int]]) -> str:
    return ", ".join(
        f"rank {r}: {row[1:] if row[0] else 'no key'}" for r, row in enumerate(rows[:8])
    ) + (", ..." if len(rows) > 8 else "")


def agree_key(
    op: str, key: mx.array | None, group: Group | None, *, stream: StreamLike = None
) -> mx.array:
    """The key every rank of ``group`` uses: the caller's, or rank 0's ``mx.random`` state.

    One ``all_gather`` of ``[given, key0, key1]`` from every rank, read on the host, decides it
    the same way on every rank: when no rank was given a key, all take rank 0's draw; when all
    were given the same key, they keep it; otherwise each raises the same error, before any
    target call, so no rank is left waiting in a collective. Without a group (one process) it
    communicates nothing.

    The gather must run on ``stream``, the stream of the models' own collectives: a rank runs
    the collectives of one stream in order, but those of two streams in any order, and work may
    still be in flight there (mlx-lm's ``generate_step`` leaves its next step computing). On
    another stream, one rank could pair the gather with the other's pending all-sum.

    Args:
        op (str): the calling function's name, for the error message.
        key (array, optional): ``[2]`` uint32 key from ``mx.random.key``. Default:
            ``mx.random``'s global state (rank 0's, for a group).
        group (Group, optional): the group the models run on, from :func:`model_group`.
        stream (Stream, optional): the stream the models run on. Default: the default stream.

    Returns:
        array: ``[2]`` uint32 key, equal on every rank of ``group``.

    Raises:
        ValueError: ``key`` is not a ``[2]`` uint32 array, or the ranks' keys differ (some ranks
            given one and others not, or different ones); the message names ``op``, ``key``
            and what each rank had.
    """
    if key is not None:
        key = check_key(op, key)
    if group is None or group.size() == 1:
        return key if key is not None else _global_state()
    mine = key if key is not None else _global_state()
    given = mx.array([key is not None], dtype=mx.uint32)
    sent = mx.concatenate([given, mine])[None]
    rows = mx.distributed.all_gather(sent, group=group, stream=stream).tolist()
    if not any(row[0] for row in rows):
        return mx.array(rows[0][1:], dtype=mx.uint32)
    if all(row == rows[0] for row in rows):
        return key
    raise ValueError(
        f"{op}: `key` differs between the {len(rows)} ranks of the distributed group the model "
        f"runs on ({_shown(rows)}); sampling would desynchronise them. Pass the same key on "
        "every rank, or none on every rank (rank 0 then draws one for all)"
    )


def fresh_seed(group: Group | None, *, stream: StreamLike = None) -> int:
    """A random seed from ``os.urandom``, rank 0's on every rank of ``group`` (one all-sum).

    For a command that prints the seed it used, so that the run can be repeated.

    Args:
        group (Group, optional): the group the command runs on. Default: one process.
        stream (Stream, optional): the stream the models run on (see :func:`agree_key`).
            Default: the default stream.

    Returns:
        int: a seed in ``[0, 2**32)``, equal on every rank.
    """
    seed = int.from_bytes(os.urandom(4), "little")
    if group is None or group.size() == 1:
        return seed
    mine = mx.array([seed if group.rank() == 0 else 0], dtype=mx.uint32)
    return int(mx.distributed.all_sum(mine, group=group, stream=stream).item())


def load_sharded(
    path: str | Path, group: Group | None = None, *, pipeline: bool = False
) -> tuple[nn.Module, Any]:
    """Loads a target split over ``group`` with mlx-lm's ``sharded_load``.

    Every rank loads the model lazily and keeps its share: ``model.shard(group)`` splits each
    layer's matrices, ``model.model.pipeline(group)`` keeps a stage of layers (and fetches only
    the files that hold them). A local folder is read as it is, with no network.

    Args:
        path (str or Path): an mlx-lm model folder, or a name mlx-lm resolves.
        group (Group, optional): the ranks to split over. Default: ``mx.distributed.init()``.
        pipeline (bool): split the layers into stages (``model.model.pipeline``) rather than
            each layer's matrices (``model.shard``). Default: ``False``.

    Returns:
        tuple: the model and its ``TokenizerWrapper``; on a group of one, ``mlx_lm.load``'s.

    Raises:
        ValueError: the model's class cannot be split that way (mlx-lm's message).
    """
    from mlx_lm.utils import load, sharded_load

    group = group if group is not None else mx.distributed.init()
    if group.size() == 1:
        return load(str(path))
    if pipeline:
        return sharded_load(str(path), pipeline_group=group)
    return sharded_load(str(path), tensor_group=group)
