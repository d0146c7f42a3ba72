"""Fused acceptance kernels for MLX's CUDA backend: one or two launches per verification.

On a GPU a verification costs kernel launches more than passes over memory. The composition of MLX
ops in :mod:`mlx_spec.acceptance` stays the reference and the default; ``fused=True`` (and the
generation loop, on CUDA) makes the same decisions with ``mx.fast.cuda_kernel`` launches:

- greedy, two launches: the first takes the argmax of every 4096-column slice of every row, one
  block of 256 threads per slice, so all ``N + 1`` rows are read at the bandwidth of the whole
  chip; the second, one block, combines the slices row by row and stops at the first mismatch;
- sampled, one launch of one 1024-thread block: one warp runs the ratio tests, then the block
  draws ``next`` from the residual of the deciding row by the composition's two-level inverse CDF,
  over the same strided blocks and with the same uniform, so both paths give the same token up to
  the rounding of their sums.

The CUDA sources are files beside this module, shipped as package data: ``common.cuh`` (what
every kernel uses), ``greedy.cuh`` and ``sampled.cuh``; this module holds the constants they see
and the thin Python that launches them. Shapes reach the kernels at run time, so each dtype
combination compiles once. MLX (0.32) has no
``mx.vmap`` rule for custom kernels, and a kernel anywhere in a graph that ``mx.vmap`` traces
fails there, so the kernels serve single verifications: under ``mx.vmap`` use the composition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from importlib import resources

import mlx.core as mx

from .._checks import INVALID_ROW, MASS_TOLERANCE, StreamOrDevice, device_type

THREADS = 1024  # a one-block kernel's threads; the sources assume 32 full warps
SLICE = 4096  # greedy: columns of a row per block of the first launch
SLICE_THREADS = 256  # greedy: threads per block of the first launch
MAX_COLUMNS = 4096  # sampled: the most strided blocks of the draw (they live in shared memory)

#: The largest vocabulary of the sampled kernel: its strided blocks, about ``sqrt(V)``, must fit.
MAX_VOCAB = MAX_COLUMNS**2

# The constants above and the acceptance's checks, as the CUDA sources see them (MASS_TOLERANCE is
# a power of two: its decimal form is the same float32).
_DEFINES = f"""
#define MS_THREADS {THREADS}
#define MS_INVALID {INVALID_ROW:#x}u
#define MS_MASS_TOLERANCE {MASS_TOLERANCE!r}f
#define MS_MAX_COLUMNS {MAX_COLUMNS}
#define MS_SLICE {SLICE}
#define MS_SLICE_THREADS {SLICE_THREADS}
"""


@cache
def header(subject: str) -> str:
    """The header of the kernels of ``subject`` (``"greedy"`` or ``"sampled"``): the constants,
    then ``common.cuh``, then ``{subject}.cuh``."""
    sources = resources.files(__name__)
    return _DEFINES + "".join(
        sources.joinpath(f"{name}.cuh").read_text(encoding="utf-8") for name in ("common", subject)
    )


_SLICES = "ms_slice_argmax<T>(logits, part_max, part_at, logits_shape[0], logits_shape[1]);"
_DECIDE = (
    "if (ms_first_block()) ms_greedy_decide<D, ET>(part_max, part_at, draft, eos, out, "
    "part_max_shape[0], part_max_shape[1], eos_shape[0]);"
)
_SAMPLED = (
    "ms_sampled<T, Q, D, ET, HAS_Q>(probs, q, draft, eos, u, out, probs_shape[0] - 1, "
    "probs_shape[1], eos_shape[0]);"
)


@cache
def no_id() -> mx.array:
    """``[1]`` uint32 ``0xFFFFFFFF``: no token equals it; the kernels' stand-in for a missing eos
    or draft."""
    return mx.array([0xFFFFFFFF], mx.uint32)


_local = threading.local()


def on_cuda(stream: StreamOrDevice = None) -> bool:
    """Whether ``stream`` runs on MLX's CUDA backend (a GPU stream of a CUDA build)."""
    return mx.cuda.is_available() and device_type(stream) == mx.DeviceType.gpu


def available(stream: StreamOrDevice = None) -> bool:
    """Whether the fused kernels can run on ``stream`` (:func:`on_cuda`), and are not turned off
    on this thread (:func:`disabled`)."""
    return not getattr(_local, "off", False) and on_cuda(stream)


@contextmanager
def disabled() -> Iterator[None]:
    """Within it, on this thread, :func:`available` is false: generations made within it decide
    with the composition of MLX ops (to compare the two, as ``benchmarks/generation.py`` does).
    Nothing else changes: a verification's attention runs as it does outside."""
    previous = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = previous


_SOURCES = {
    "greedy_slices": ("greedy", ["logits"], ["part_max", "part_at"], _SLICES),
    "greedy_decide": ("greedy", ["part_max", "part_at", "draft", "eos"], ["out"], _DECIDE),
    "sampled": ("sampled", ["probs", "q", "draft", "eos", "u"], ["out"], _SAMPLED),
}


@cache
def _kernel(name: str) -> Callable[..., list[mx.array]]:
    subject, inputs, outputs, source = _SOURCES[name]
    return mx.fast.cuda_kernel(
        name=f"mlx_spec_{name}",
        input_names=inputs,
        output_names=outputs,
        source=source,
        header=header(subject),
        ensure_row_contiguous=True,
    )


def _one_block(name: str, inputs: list[mx.array], template: list) -> mx.array:
    """One block of ``THREADS`` threads of kernel ``name``: ``[3]`` uint32."""
    return _kernel(name)(
        inputs=inputs,
        template=template,
        grid=(THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(3,)],
        output_dtypes=[mx.uint32],
    )[0]


def _greedy_launches(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
    """The slices' maxima of every row (many blocks), then the decision (one block)."""
    rows, vocab = logits.shape
    slices = -(-vocab // SLICE)
    part_max, part_at = _kernel("greedy_slices")(
        inputs=[logits],
        template=[("T", logits.dtype)],
        grid=(rows * slices * SLICE_THREADS, 1, 1),
        threadgroup=(SLICE_THREADS, 1, 1),
        output_shapes=[(rows, slices), (rows, slices)],
        output_dtypes=[mx.float32, mx.uint32],
    )
    template = [("D", draft.dtype), ("ET", eos.dtype)]
    return _one_block("greedy_decide", [part_max, part_at, draft, eos], template)


def _cuda_launch(name: str, inputs: list[mx.array], template: list) -> mx.array:
    """Kernel ``name`` on ``inputs``: ``[3]`` uint32."""
    if name == "greedy":
        return _greedy_launches(*inputs)
    return _one_block(name, inputs, template)


#: ``(name, inputs, template) -> [3]`` uint32: the launch; the CPU tests swap in a reference.
launch: Callable[[str, list[mx.array], list], mx.array] = _cuda_launch


def greedy(logits: mx.array, draft: mx.array, eos: mx.array) -> mx.array:
    """Greedy acceptance in two launches (see :func:`mlx_spec.accept_greedy`).

    Args:
        logits (array): ``[N + 1, V]`` float32, float16 or bfloat16.
        draft (array): ``[N]`` uint32 or int32 (``[1]``, not read, when ``N = 0``).
        eos (array): ``[E]`` uint32 or int32, ``E >= 1`` (:func:`no_id` for none).

    Returns:
        array: lazy ``[3]`` uint32 ``[accepted, next, eos_hit]``, as the composition's.
    """
    template = [("T", logits.dtype), ("D", draft.dtype), ("ET", eos.dtype)]
    return launch("greedy", [logits, draft, eos], template)


def sampled(
    probs: mx.array,
    q: mx.array,
    draft: mx.array,
    eos: mx.array,
    u: mx.array,
    *,
    has_q: bool,
) -> mx.array:
    """Sampled acceptance in one launch (see :func:`mlx_spec.accept_sampled`).

    Args:
        probs (array): ``[N + 1, V]`` float32, float16 or bfloat16, ``V <= MAX_VOCAB``.
        q (array): ``[N, V]`` draft distributions when ``has_q``, else any float array (not
            read).
        draft (array): ``[N]`` uint32 or int32 (``[1]``, not read, when ``N = 0``).
        eos (array): ``[E]`` uint32 or int32, ``E >= 1`` (:func:`no_id` for none).
        u (array): ``[N + 1]`` float32 uniforms: ``N`` ratio tests, then the draw of ``next``.
        has_q (bool): whether ``q`` holds the draft distributions (else point masses).

    Returns:
        array: lazy ``[3]`` uint32 ``[accepted, next, eos_hit]``, as the composition's.
    """
    template = [
        ("T", probs.dtype),
        ("Q", q.dtype),
        ("D", draft.dtype),
        ("ET", eos.dtype),
        ("HAS_Q", has_q),
    ]
    return launch("sampled", [probs, q, draft, eos, u], template)
