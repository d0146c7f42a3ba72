"""Argument handling shared by the public functions: the acceptance ops and the generation API.

Every check of the ops reads shapes and dtypes only (never values), so it is free, works on lazy
arrays and under ``mx.vmap`` and ``mx.compile``, and its error names the function, the argument,
its shape and its dtype. The generation API's checks run once before any work; of array values,
they read only the prompt's ids (one host read). :func:`device_type` resolves the ops' ``stream``
argument. What cannot be checked without reading values is checked inside the acceptance graphs
(and the kernels) and reported through :data:`INVALID_ROW`; the two constants of that contract
live here, where both see them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx

StreamOrDevice = mx.Stream | mx.Device | mx.DeviceType | None

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ID_DTYPES = (mx.uint32, mx.int32)

#: ``next`` carries this bit when the row that decided the result was invalid (logits without a
#: finite maximum; probabilities that are not a distribution); the low bits hold its position.
INVALID_ROW = 1 << 31

#: How far from 1 the total of a sampled row may be before the row is invalid: ``2**-6``. Rounding
#: the entries of a row that sums to 1 to bfloat16 moves its total by at most ``2**-8`` (each entry
#: by at most ``2**-8`` of itself); to float16 by at most ``2**-11 + V * 2**-25`` (relative
#: rounding, plus the absolute rounding of entries below float16's normal range), 0.0083 for
#: ``V = 2**18``; the float32 block sums that compute the total add less than ``1e-3`` up to
#: ``V = 2**24``. ``2**-6`` (0.0156) is about twice the worst of these, is exact in every float
#: dtype, and still flags a row that sums to 0.98 or 1.02.
MASS_TOLERANCE = 2.0**-6

#: The bits a quantized cache may have: mlx-lm passes ``kv_bits`` on to ``mx.quantize``, and these
#: are the widths from 2 up that it takes.
KV_BITS = (2, 3, 4, 5, 6, 8)


def describe(a: mx.array) -> str:
    """``shape (2, 5) and dtype float32``, for error messages."""
    return f"shape {tuple(a.shape)} and dtype {str(a.dtype).removeprefix('mlx.core.')}"


def _require_array(op: str, name: str, a: object) -> mx.array:
    if not isinstance(a, mx.array):
        raise ValueError(f"{op}: `{name}` must be an mx.array, got {type(a).__name__}")
    return a


def check_rows(op: str, name: str, rows: object) -> tuple[int, int]:
    """Checks the ``[N + 1, V]`` floating-point verification rows.

    Returns:
        tuple[int, int]: the draft length ``N`` and the vocabulary size ``V``.
    """
    rows = _require_array(op, name, rows)
    if rows.ndim != 2 or rows.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: `{name}` must be [N + 1, V] float32, float16 or bfloat16, got {describe(rows)}"
        )
    if rows.shape[0] < 1 or rows.shape[1] < 1:
        raise ValueError(
            f"{op}: `{name}` needs at least one row and one column, got {describe(rows)}"
        )
    return rows.shape[0] - 1, rows.shape[1]


def check_ids(op: str, name: str, ids: object, length: int | None = None) -> mx.array:
    """Checks a ``[n]`` uint32 or int32 token-id array, of ``length`` when given."""
    ids = _require_array(op, name, ids)
    if ids.ndim != 1 or ids.dtype not in ID_DTYPES:
        raise ValueError(f"{op}: `{name}` must be [n] uint32 or int32, got {describe(ids)}")
    if length is not None and ids.shape[0] != length:
        raise ValueError(
            f"{op}: `{name}` must hold {length} tokens (one fewer than the rows), "
            f"got {describe(ids)}"
        )
    return ids


def check_eos(op: str, eos: object) -> mx.array | None:
    """Checks the optional ``[E]`` end-of-sequence ids; ``None`` or an empty array mean none."""
    if eos is None:
        return None
    eos = check_ids(op, "eos", eos)
    return eos if eos.shape[0] > 0 else None


def check_draft_probs(op: str, draft_probs: object, n: int, v: int) -> mx.array | None:
    """Checks the optional ``[N, V]`` floating-point draft distributions."""
    if draft_probs is None:
        return None
    q = _require_array(op, "draft_probs", draft_probs)
    if q.dtype not in FLOAT_DTYPES or tuple(q.shape) != (n, v):
        raise ValueError(
            f"{op}: `draft_probs` must be [{n}, {v}] float32, float16 or bfloat16 (N = {n} draft "
            f"tokens, V = {v}), got {describe(q)}"
        )
    return q


def check_key(op: str, key: object) -> mx.array:
    """Checks a ``[2]`` uint32 key as made by ``mx.random.key``."""
    key = _require_array(op, "key", key)
    if tuple(key.shape) != (2,) or key.dtype != mx.uint32:
        raise ValueError(
            f"{op}: `key` must be a [2] uint32 key from mx.random.key, got {describe(key)}"
        )
    return key


def check_stream(op: str, stream: object) -> StreamOrDevice:
    """Checks the ``stream`` argument: ``None``, or an ``mx.Stream``, ``mx.Device`` or
    ``mx.DeviceType`` of a device this MLX can run on."""
    if stream is None:
        return None
    if not isinstance(stream, (mx.Stream, mx.Device, mx.DeviceType)):
        raise ValueError(
            f"{op}: `stream` must be None, an mx.Stream, an mx.Device or an mx.DeviceType, "
            f"got {stream!r} of type {type(stream).__name__}"
        )
    device = stream.device if isinstance(stream, mx.Stream) else stream
    if not mx.is_available(mx.Device(device) if isinstance(device, mx.DeviceType) else device):
        raise ValueError(f"{op}: `stream` is {stream}, a device this MLX cannot run on")
    return stream


def check_flag(op: str, name: str, value: object) -> bool:
    """Checks a ``bool`` argument (``True`` or ``False`` only: ``1`` or ``"yes"`` are refused)."""
    if not isinstance(value, bool):
        raise ValueError(f"{op}: `{name}` must be True or False, got {value!r}")
    return value


def device_type(stream: StreamOrDevice) -> mx.DeviceType:
    """The kind of device ``stream`` runs on (the default device's for ``None``)."""
    if stream is None:
        stream = mx.default_device()
    if isinstance(stream, mx.Stream):
        stream = stream.device
    return stream if isinstance(stream, mx.DeviceType) else stream.type


# -- the generation API -------------------------------------------------------------------------


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(op: str, name: str, value: object, least: int, most: int | None = None) -> int:
    if not is_int(value) or value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{op}: `{name}` must be an int {bound}, got {value!r}")
    return int(value)


def check_callable(op: str, name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{op}: `{name}` must be callable or None, got {value!r}")


def check_prompt(op: str, prompt: object, vocab: int | None) -> list[int]:
    """Checks the ``[L]`` integer prompt and reads its ids (one host read)."""
    if not isinstance(prompt, mx.array) or prompt.ndim != 1 or prompt.size == 0:
        shown = describe(prompt) if isinstance(prompt, mx.array) else type(prompt).__name__
        raise ValueError(f"{op}: `prompt` must be a non-empty [L] array of token ids, got {shown}")
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise ValueError(f"{op}: `prompt` must hold integer token ids, got dtype {prompt.dtype}")
    ids = prompt.tolist()
    low, high = min(ids), max(ids)
    limit = vocab if vocab is not None else 2**32
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        where = f"the target's vocabulary [0, {vocab})" if vocab is not None else "[0, 2**32)"
        raise ValueError(f"{op}: `prompt` holds token id {bad}, outside {where}")
    return ids


def check_token_list(op: str, name: str, tokens: object) -> list[int]:
    """Checks an optional sequence of token ids (Python ints, or an ``[L]`` integer array, read
    once); returns them as a list (empty for ``None``)."""
    if tokens is None:
        return []
    if isinstance(tokens, mx.array):
        if tokens.ndim != 1 or not mx.issubdtype(tokens.dtype, mx.integer):
            raise ValueError(
                f"{op}: `{name}` must be [L] integer token ids, got {describe(tokens)}"
            )
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise ValueError(f"{op}: `{name}` must be a sequence of token ids, got {tokens!r}")
    tokens = list(tokens)
    if not all(is_int(t) and 0 <= t < 2**32 for t in tokens):
        raise ValueError(f"{op}: `{name}` must hold int token ids in [0, 2**32), got {tokens!r}")
    return tokens


def check_eos_ids(op: str, eos_token_ids: object) -> list[int]:
    if eos_token_ids is None:
        return []
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Iterable):
        raise ValueError(
            f"{op}: `eos_token_ids` must be an iterable of int token ids, got {eos_token_ids!r}"
        )
    try:
        ids = list(eos_token_ids)
    except TypeError:  # iterable by type, not by value: a 0-d array
        raise ValueError(
            f"{op}: `eos_token_ids` must be an iterable of int token ids, got {eos_token_ids!r}"
        ) from None
    for i in ids:
        if not is_int(i) or not 0 <= i < 2**32:
            raise ValueError(f"{op}: `eos_token_ids` must hold int ids in [0, 2**32), got {i!r}")
    return [int(i) for i in ids]


def check_processors(op: str, processors: object) -> list[Callable[..., Any]]:
    if processors is None:
        return []
    if callable(processors) or not isinstance(processors, Sequence):
        raise ValueError(
            f"{op}: `logits_processors` must be a list of callables, got {processors!r}"
        )
    for processor in processors:
        if not callable(processor):
            raise ValueError(
                f"{op}: `logits_processors` must hold callables, got {processor!r} in it"
            )
    return list(processors)


def check_kv_bits(op: str, kv_bits: object, kv_group_size: object, start: object) -> None:
    if kv_bits is not None and (not is_int(kv_bits) or kv_bits not in KV_BITS):
        raise ValueError(
            f"{op}: `kv_bits` must be None or one of {', '.join(map(str, KV_BITS))}, "
            f"got {kv_bits!r}"
        )
    if not is_int(kv_group_size) or kv_group_size not in (32, 64, 128):
        raise ValueError(f"{op}: `kv_group_size` must be 32, 64 or 128, got {kv_group_size!r}")
    check_int(op, "quantized_kv_start", start, 0)


def check_prompt_cache(op: str, prompt_cache: object) -> list[Any] | None:
    if prompt_cache is not None and not isinstance(prompt_cache, list):
        raise ValueError(f"{op}: `prompt_cache` must be a list of caches, got {prompt_cache!r}")
    return prompt_cache
