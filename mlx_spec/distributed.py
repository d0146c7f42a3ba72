"""Speculation on a target split over processes with ``mx.distributed``.

Every process of a distributed group runs the whole loop: the same draft, the same acceptance,
the same caches. Only the target's calls communicate (the all-sums of a tensor-parallel model,
the sends of a pipeline), and they stay in step only while every rank feeds the target the same
tokens. Greedy decoding is deterministic, so ranks agree by themselves; sampled decoding agrees
only when every rank draws from the same key. And every rank must run the same rounds: the same
number of tokens, drafts of the same lengths, a prompt of the same length. This module finds the
group a model runs on, agrees a key on it and checks the arguments that shape a round before the
first round, with one collective, and loads a target sharded the way mlx-lm does.

The loop calls, once at setup::

    key = agree_key(
        op, key, model_group(model, draft_model), stream=stream,
        arguments=round_arguments(max_tokens=..., num_draft_tokens=..., ...),
    )

and derives everything random (draft sampling, acceptance, a drafter's choices) from that key.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ._checks import check_key

__all__ = ["agree_key", "fresh_seed", "load_sharded", "model_group", "round_arguments"]

Group = mx.distributed.Group
StreamLike = mx.Stream | mx.ThreadLocalStream | mx.Device | None


def _groups(model: nn.Module) -> tuple[list[Group], bool]:
    """The groups of size > 1 that ``model``'s layers hold, and whether it is a pipeline stage."""
    # Imported here: the command's early errors check a launch without importing mlx-lm.
    from . import _mlx_lm

    groups: list[Group] = []
    pipeline = False
    for module in _mlx_lm.modules(model):
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


# --- the arguments that shape a round -----------------------------------------------------------

#: Bytes of an argument's description that each rank sends, so that every rank can show what
#: the others had; a checksum of the whole description decides equality.
_SHOWN_BYTES = 60
_WORDS = 1 + _SHOWN_BYTES // 4


def _drafter(drafter: object) -> str:
    """A drafter as the error shows it: its kind, and the options that change its proposals."""
    kinds = {"ModelDrafter": "a draft model", "PromptLookupDrafter": "prompt lookup"}
    name = type(drafter).__name__
    options = [
        f"{option} {getattr(drafter, option)}"
        for option in ("max_ngram", "min_ngram", "distribution")
        if hasattr(drafter, option)
    ]
    shown = kinds.get(name, name)
    return f"{shown} ({', '.join(options)})" if options else shown


def _policy(policy: object | None, adaptive: bool) -> str:
    """A draft-length policy as the error shows it: its kind and the most it drafts."""
    if policy is None:
        return "adaptive" if adaptive else "fixed"
    most = getattr(policy, "most", getattr(policy, "n", None))
    name = type(policy).__name__
    return name if most is None else f"{name}, at most {most}"


def _prompt(ids: Sequence[int]) -> str:
    """A prompt as the error shows it: its length, and a checksum of its ids."""
    checksum = zlib.crc32(np.asarray(ids, dtype=np.uint32).tobytes())
    return f"{len(ids)} tokens (crc32 {checksum:08x})"


def round_arguments(
    *,
    max_tokens: int,
    num_draft_tokens: int,
    drafter: object,
    policy: object | None,
    adaptive: bool,
    prompt: Sequence[int],
    acceptance: str,
) -> dict[str, str]:
    """What shapes a generation's rounds, described for :func:`agree_key` to compare.

    On a group, every rank must call the target with the same number of positions each round:
    the rounds follow from these arguments (and from the text, which follows from them and the
    key). Each is described by a short text, which the error shows for every rank.

    Args:
        max_tokens (int): tokens to generate.
        num_draft_tokens (int): the most draft tokens a round.
        drafter (Drafter): the generation's drafter (its class, and prompt lookup's options).
        policy (DraftPolicy, optional): the draft-length policy given (its class and ``most``
            or ``n``); ``None`` for the one ``adaptive`` chooses.
        adaptive (bool): whether lengths adapt, when no ``policy`` is given.
        prompt (sequence of int): the prompt's ids (its length and a checksum).
        acceptance (str): the rule's kind: ``"greedy"``, ``"coupled"`` or ``"residual"``.

    Returns:
        dict: from each argument's name, as the error names it, to its description.
    """
    return {
        "`max_tokens`": str(max_tokens),
        "`num_draft_tokens`": str(num_draft_tokens),
        "the drafter (`draft_model` or `drafter`)": _drafter(drafter),
        "the draft-length policy (`adaptive` or `policy`)": _policy(policy, adaptive),
        "`prompt`": _prompt(prompt),
        "the acceptance rule (`sampler` and `acceptance`)": acceptance,
    }


def _encoded(description: str) -> list[int]:
    """``description`` as ``_WORDS`` uint32 words: a checksum of it, then its first bytes."""
    data = description.encode("utf-8")
    shown = data[:_SHOWN_BYTES].ljust(_SHOWN_BYTES, b"\0")
    words = [int.from_bytes(shown[i : i + 4], "little") for i in range(0, _SHOWN_BYTES, 4)]
    return [zlib.crc32(data), *words]


def _decoded(words: list[int]) -> str:
    data = b"".join(int(w).to_bytes(4, "little") for w in words[1:]).rstrip(b"\0")
    text = data.decode("utf-8", errors="replace")
    return text if len(data) < _SHOWN_BYTES else f"{text}..."


def _ranks(values: list[str]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values[:8])) + (
        ", ..." if len(values) > 8 else ""
    )


def _differing(op: str, names: list[str], rows: list[list[int]]) -> str | None:
    """The error for the arguments whose descriptions differ between ``rows``, or ``None``."""
    differ = []
    for i, name in enumerate(names):
        fields = [row[3 + i * _WORDS : 3 + (i + 1) * _WORDS] for row in rows]
        if any(field != fields[0] for field in fields):
            differ.append(f"{name}: {_ranks([_decoded(field) for field in fields])}")
    if not differ:
        return None
    return (
        f"{op}: the {len(rows)} ranks of the distributed group the model runs on were given "
        f"different arguments, so their target calls would stop matching; {'; '.join(differ)}. "
        "Pass the same arguments on every rank"
    )


def _shown(rows: list[list[int]]) -> str:
    return _ranks([str(row[1:3]) if row[0] else "no key" for row in rows])


def agree_key(
    op: str,
    key: mx.array | None,
    group: Group | None,
    *,
    stream: StreamLike = None,
    arguments: Mapping[str, str] | None = None,
) -> mx.array:
    """The key every rank of ``group`` uses, after checking that the ranks run the same rounds.

    One ``all_gather`` of ``[given, key0, key1, arguments...]`` from every rank, read on the
    host, decides it the same way on every rank. First the ``arguments`` (from
    :func:`round_arguments`): where any differs, each rank raises the same error naming every
    argument that differs and what each rank had. Then the key: when no rank was given one, all
    take rank 0's draw; when all were given the same key, they keep it; otherwise each raises
    the same error. Either error comes before any target call, so no rank is left waiting in a
    collective. Without a group (one process) it communicates nothing.

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
        arguments (mapping, optional): from an argument's name, as the error names it, to a
            text describing its value, which must be equal on every rank; each rank must give
            the same names in the same order. Default: none.

    Returns:
        array: ``[2]`` uint32 key, equal on every rank of ``group``.

    Raises:
        ValueError: ``key`` is not a ``[2]`` uint32 array; an argument differs between the ranks
            (the message names each that does, and what each rank had); or the ranks' keys
            differ (some ranks given one and others not, or different ones). Every message
            names ``op``.
    """
    if key is not None:
        key = check_key(op, key)
    if group is None or group.size() == 1:
        return key if key is not None else _global_state()
    arguments = dict(arguments or {})
    mine = key if key is not None else _global_state()
    given = mx.array([key is not None], dtype=mx.uint32)
    described = [word for text in arguments.values() for word in _encoded(text)]
    sent = mx.concatenate([given, mine, mx.array(described, dtype=mx.uint32)])[None]
    rows = mx.distributed.all_gather(sent, group=group, stream=stream).tolist()
    error = _differing(op, list(arguments), rows)
    if error is not None:
        raise ValueError(error)
    keys = [row[:3] for row in rows]
    if not any(row[0] for row in keys):
        return mx.array(keys[0][1:], dtype=mx.uint32)
    if all(row == keys[0] for row in keys):
        return key
    raise ValueError(
        f"{op}: `key` differs between the {len(rows)} ranks of the distributed group the model "
        f"runs on ({_shown(keys)}); sampling would desynchronise them. Pass the same key on "
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
