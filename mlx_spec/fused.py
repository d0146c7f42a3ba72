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

Shapes reach the kernels at run time, so each dtype combination compiles once. MLX (0.32) has no
``mx.vmap`` rule for custom kernels, and a kernel anywhere in a graph that ``mx.vmap`` traces
fails there, so the kernels serve single verifications: under ``mx.vmap`` use the composition.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx

from ._checks import StreamOrDevice, device_type

THREADS = 1024  # a one-block kernel's threads; the sources assume 32 full warps
SLICE = 4096  # greedy: columns of a row per block of the first launch
SLICE_THREADS = 256  # greedy: threads per block of the first launch
MAX_COLUMNS = 4096  # sampled: the most strided blocks of the draw (they live in shared memory)

#: The largest vocabulary of the sampled kernel: its strided blocks, about ``sqrt(V)``, must fit.
MAX_VOCAB = MAX_COLUMNS**2

# The constants above, as the CUDA sources see them.
_DEFINES = f"""
#define MS_THREADS {THREADS}
#define MS_INVALID 0x80000000u
#define MS_MAX_COLUMNS {MAX_COLUMNS}
#define MS_SLICE {SLICE}
#define MS_SLICE_THREADS {SLICE_THREADS}
"""

_FUNCTIONS = r"""
__device__ __forceinline__ float ms_float(float x) { return x; }
__device__ __forceinline__ float ms_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float ms_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename ET>
__device__ __forceinline__ bool ms_is_eos(uint32_t token, const ET* eos, int E) {
  bool hit = false;
  for (int i = 0; i < E; ++i) hit |= token == (uint32_t)eos[i];
  return hit;
}

// The first maximal index wins a tie, as in mx.argmax.
__device__ __forceinline__ void ms_keep_max(float& best, uint32_t& at, float x, uint32_t i) {
  if (x > best || (x == best && i < at)) { best = x; at = i; }
}

// The warp's maximum and its first index, left in lane 0.
__device__ __forceinline__ void ms_warp_max(float& best, uint32_t& at) {
  for (int d = 16; d > 0; d >>= 1) {
    const float other = __shfl_down_sync(0xFFFFFFFFu, best, d);
    const uint32_t other_at = __shfl_down_sync(0xFFFFFFFFu, at, d);
    ms_keep_max(best, at, other, other_at);
  }
}

// The argmax of one slice of a row (block b: row b / S, columns [s L, s L + L), s = b % S,
// L = ceil(V / S) rounded up to 8), as the slice's maximum (NaN when the slice holds a NaN) and its
// first index. 16-byte loads when the rows are aligned.
template <typename T>
__device__ void ms_slice_argmax(const T* logits, float* part_max, uint32_t* part_at, int R,
                                int V) {
  __shared__ float s_best[MS_SLICE_THREADS / 32];
  __shared__ uint32_t s_at[MS_SLICE_THREADS / 32];
  const int S = (V + MS_SLICE - 1) / MS_SLICE;
  const int b = blockIdx.x;
  if (b >= R * S) return;
  const int r = b / S, s = b % S, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int width = ((V + S - 1) / S + 7) / 8 * 8;
  const int lo = min(V, s * width), hi = min(V, lo + width);
  const T* row = logits + (size_t)r * V;
  float best = __int_as_float(0xFF800000);  // -inf
  uint32_t at = 0xFFFFFFFFu;
  bool nan = false;
  constexpr int W = 16 / sizeof(T);
  if (V % W == 0 && (reinterpret_cast<size_t>(logits) & 15) == 0) {
    const uint4* chunks = reinterpret_cast<const uint4*>(row);
    for (int k = lo / W + t; k < hi / W; k += MS_SLICE_THREADS) {
      uint4 raw = chunks[k];
      const T* xs = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float x = ms_float(xs[j]);
        nan |= isnan(x);
        ms_keep_max(best, at, x, k * W + j);
      }
    }
  } else {
#pragma unroll 4
    for (int k = lo + t; k < hi; k += MS_SLICE_THREADS) {
      const float x = ms_float(row[k]);
      nan |= isnan(x);
      ms_keep_max(best, at, x, k);
    }
  }
  ms_warp_max(best, at);
  if (lane == 0) { s_best[warp] = best; s_at[warp] = at; }
  nan = __syncthreads_or(nan);
  if (t == 0) {
    for (int w = 1; w < MS_SLICE_THREADS / 32; ++w) ms_keep_max(best, at, s_best[w], s_at[w]);
    part_max[b] = nan ? __int_as_float(0x7FC00000) : best;
    part_at[b] = at;
  }
}

// One block does the work; any other block leaves at once.
__device__ __forceinline__ bool ms_first_block() {
  return blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
}

// The [accepted, next, eos_hit] result.
template <typename ET>
__device__ __forceinline__ void ms_write(uint32_t* out, uint32_t accepted, uint32_t token,
                                         bool eos_in_draft, const ET* eos, int E) {
  out[0] = accepted;
  out[1] = token;
  out[2] = (eos_in_draft || ms_is_eos<ET>(token, eos, E)) ? 1u : 0u;
}

// Greedy acceptance, row r of N + 1 given its argmax, whether it holds a NaN, and (for r < N) its
// draft token and whether that token ends the sequence: updates the result and says whether the
// rows after it are needed.
__device__ __forceinline__ bool ms_greedy_row(int r, int N, uint32_t choice, bool nan, uint32_t d,
                                              bool d_is_eos, uint32_t& accepted, uint32_t& token,
                                              bool& eos_in_draft) {
  accepted = r;
  token = nan ? (MS_INVALID | (uint32_t)r) : choice;
  // After an accepted end-of-sequence token, this row only supplies `next`.
  if (r == N || eos_in_draft || nan || d != choice) return false;
  eos_in_draft = d_is_eos;
  return true;
}

// Greedy acceptance from the slices' maxima ([R, S] each), by one block of W warps: W rows at a
// time, warp w combines the slices of row w and reads its draft token, then thread 0 walks the
// rows in order (in shared memory) until the first that stops. The maxima are read through L2,
// so a block of the launch that wrote them may call it.
template <typename D, typename ET>
__device__ void ms_greedy_decide(const float* part_max, const uint32_t* part_at, const D* draft,
                                 const ET* eos, uint32_t* out, int R, int S, int E) {
  __shared__ uint32_t s_choice[32], s_draft[32];
  __shared__ bool s_nan[32], s_draft_eos[32], s_more;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, W = blockDim.x >> 5;
  uint32_t accepted = 0, token = 0;
  bool eos_in_draft = false;
  for (int base = 0; base < R; base += W) {
    const int r = base + warp;
    if (r < R) {
      const uint32_t d = r < R - 1 ? (uint32_t)draft[r] : 0u;
      float best = __int_as_float(0xFF800000);
      uint32_t at = 0xFFFFFFFFu;
      bool nan = false;
      for (int i = lane; i < S; i += 32) {
        const float x = __ldcg(part_max + (size_t)r * S + i);
        nan |= isnan(x);
        ms_keep_max(best, at, x, __ldcg(part_at + (size_t)r * S + i));
      }
      ms_warp_max(best, at);
      nan = __any_sync(0xFFFFFFFFu, nan);
      if (lane == 0) {
        s_choice[warp] = at;
        s_nan[warp] = nan;
        s_draft[warp] = d;
        s_draft_eos[warp] = r < R - 1 && ms_is_eos<ET>(d, eos, E);
      }
    }
    __syncthreads();
    if (t == 0) {
      bool more = true;
      for (int i = 0; more && i < W && base + i < R; ++i) {
        more = ms_greedy_row(base + i, R - 1, s_choice[i], s_nan[i], s_draft[i], s_draft_eos[i],
                             accepted, token, eos_in_draft);
      }
      s_more = more;
    }
    __syncthreads();
    if (!s_more) break;
  }
  if (t == 0) ms_write<ET>(out, accepted, token, eos_in_draft, eos, E);
}

// Inclusive scan of one value per thread over the block; `carry` is added to every result.
__device__ float ms_block_scan(float x, float carry, float* s_warp) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    float other = __shfl_up_sync(0xFFFFFFFFu, x, d);
    if (lane >= d) x += other;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float w = s_warp[lane];
    for (int d = 1; d < 32; d <<= 1) {
      float other = __shfl_up_sync(0xFFFFFFFFu, w, d);
      if (lane >= d) w += other;
    }
    s_warp[lane] = w;
  }
  __syncthreads();
  if (warp > 0) x += s_warp[warp - 1];
  __syncthreads();
  return carry + x;
}

// The residual weight of token j: max(p - scale q, 0) (NaN kept, as mx.maximum does), or p without
// the removed token.
template <typename T, typename Q, bool HAS_Q>
__device__ __forceinline__ float ms_residual(
    const T* p, const Q* q, float scale, uint32_t removed, uint32_t j, float& pj) {
  pj = ms_float(p[j]);
  if (HAS_Q) {
    float d = pj - scale * ms_float(q[j]);
    return (isnan(d) || d > 0.0f) ? d : 0.0f;
  }
  return j == removed ? 0.0f : pj;
}

// How many depths of column `col` have a cumulative weight <= bound (< bound when strict), and
// the column's total.
template <typename T, typename Q, bool HAS_Q>
__device__ int ms_column_count(const T* p, const Q* q, float scale, uint32_t removed, bool use_p,
                               int V, int C, int DEPTH, int col, float bound, bool strict,
                               float* s_warp, float* s_carry, float& total) {
  const int t = threadIdx.x;
  float carry = 0.0f;
  int count = 0;
  for (int base = 0; base < DEPTH; base += MS_THREADS) {
    const int k = base + t;
    const uint32_t j = (uint32_t)k * C + col;
    float w = 0.0f;
    if (k < DEPTH && j < (uint32_t)V) {
      float pj;
      const float rj = ms_residual<T, Q, HAS_Q>(p, q, scale, removed, j, pj);
      w = use_p ? pj : rj;
    }
    const float cum = ms_block_scan(w, carry, s_warp);
    count += __syncthreads_count(k < DEPTH && (strict ? cum < bound : cum <= bound));
    if (t == MS_THREADS - 1) *s_carry = cum;
    __syncthreads();
    carry = *s_carry;
    __syncthreads();
  }
  total = carry;
  return count;
}

// The composition's number of strided blocks: a divisor of V near sqrt(V) (down to a quarter of
// it), else sqrt(V) (acceptance._block_count).
__device__ int ms_block_count(int V) {
  long long root = (long long)sqrtf((float)V);
  while (root * root > V) --root;
  while ((root + 1) * (root + 1) <= V) ++root;
  if (root < 1) root = 1;
  const long long low = root / 4 > 1 ? root / 4 : 1;
  for (long long blocks = root; blocks >= low; --blocks) {
    if (V % blocks == 0) return (int)blocks;
  }
  return (int)root;
}

template <typename T, typename Q, typename D, typename ET, bool HAS_Q>
__device__ void ms_sampled(const T* probs, const Q* q, const D* draft, const ET* eos,
                           const float* u, uint32_t* out, int N, int V, int E) {
  __shared__ float s_p[MS_MAX_COLUMNS];
  __shared__ float s_r[MS_MAX_COLUMNS];
  __shared__ float s_warp[32];
  __shared__ float s_carry;
  __shared__ int s_columns;
  __shared__ uint32_t s_accepted;
  __shared__ bool s_eos_in_draft, s_nan_draft;
  if (!ms_first_block()) return;
  const int t = threadIdx.x;
  if (t == 0) s_columns = ms_block_count(V);

  // The ratio tests, 32 draft positions at a time: u_i q_i(d_i) < p_i(d_i).
  if (t < 32) {
    uint32_t first_reject = N, first_eos = N;
    for (int base = 0; base < N; base += 32) {
      const int i = base + t;
      bool reject = false, is_eos = false;
      if (i < N) {
        const uint32_t d = (uint32_t)draft[i];
        const uint32_t at = d < (uint32_t)V ? d : V - 1;
        const float p = ms_float(probs[(size_t)i * V + at]);
        const float qd = HAS_Q ? ms_float(q[(size_t)i * V + at]) : 1.0f;
        reject = !(d < (uint32_t)V && u[i] * qd < p);
        is_eos = ms_is_eos<ET>(d, eos, E);
      }
      const uint32_t rejects = __ballot_sync(0xFFFFFFFFu, reject);
      const uint32_t eoses = __ballot_sync(0xFFFFFFFFu, is_eos);
      if (first_reject == N && rejects) first_reject = base + __ffs(rejects) - 1;
      if (first_eos == N && eoses) first_eos = base + __ffs(eoses) - 1;
    }
    const uint32_t accepted = min(first_reject, first_eos + 1u);
    if (t == 0) {
      s_accepted = accepted;
      s_eos_in_draft = first_eos < accepted;
      bool nan_draft = false;
      if (!HAS_Q && accepted < N) {
        // The residual drops the draft token, so a NaN there is caught here, not by the draw.
        const uint32_t d = (uint32_t)draft[accepted];
        nan_draft = isnan(ms_float(probs[(size_t)accepted * V + (d < (uint32_t)V ? d : V - 1)]));
      }
      s_nan_draft = nan_draft;
    }
  }
  __syncthreads();
  const int C = s_columns, DEPTH = (V + C - 1) / C;
  const int G = C < MS_THREADS ? MS_THREADS / C : 1;  // row groups per column
  const uint32_t accepted = s_accepted;
  const bool rejected = accepted < (uint32_t)N;
  const T* p = probs + (size_t)accepted * V;
  const Q* qrow = q + (size_t)(rejected ? accepted : (uint32_t)(N > 0 ? N - 1 : 0)) * V;
  const float scale = rejected ? 1.0f : 0.0f;
  const uint32_t removed = (!HAS_Q && rejected) ? (uint32_t)draft[accepted] : 0xFFFFFFFFu;

  // Column sums of p and of the residual over the table [DEPTH, C] (token k C + c), each column
  // split among G row groups, then the groups added in order.
  for (int slot = t; slot < G * C; slot += MS_THREADS) {
    const int c = slot % C, g = slot / C;
    float sp = 0.0f, sr = 0.0f;
#pragma unroll 8
    for (int k = g; k < DEPTH; k += G) {
      const uint32_t j = (uint32_t)k * C + c;
      if (j < (uint32_t)V) {
        float pj;
        sr += ms_residual<T, Q, HAS_Q>(p, qrow, scale, removed, j, pj);
        sp += pj;
      }
    }
    s_p[slot] = sp;
    s_r[slot] = sr;
  }
  __syncthreads();
  float r_mass = 0.0f;
  for (int c = t; c < C; c += MS_THREADS) {
    float sp = s_p[c], sr = s_r[c];
    for (int g = 1; g < G; ++g) { sp += s_p[g * C + c]; sr += s_r[g * C + c]; }
    s_p[c] = sp;
    s_r[c] = sr;
    r_mass += sr;
  }
  // Whether the residual has mass, as `!(sum > 0)` decides it in the composition: a sum of
  // non-negative terms is positive in any order, and NaN in any order.
  const bool r_nan = __syncthreads_or(isnan(r_mass));
  const bool use_p = r_nan || !__syncthreads_or(r_mass > 0.0f);

  // Cumulative column sums (in s_r), the total, and the column b holding the target.
  float carry = 0.0f;
  for (int base = 0; base < C; base += MS_THREADS) {
    const int c = base + t;
    const float w = c < C ? (use_p ? s_p[c] : s_r[c]) : 0.0f;
    const float cum = ms_block_scan(w, carry, s_warp);
    if (c < C) s_r[c] = cum;
    if (t == MS_THREADS - 1) s_carry = cum;
    __syncthreads();
    carry = s_carry;
    __syncthreads();
  }
  const float total = s_r[C - 1];
  const float target = fminf(u[N] * total, total * (1.0f - 1.1920928955078125e-07f));
  int below_count = 0;
  for (int base = 0; base < C; base += MS_THREADS) {
    const int c = base + t;
    below_count += __syncthreads_count(c < C && s_r[c] <= target);
  }
  const int col = min(below_count, C - 1);
  const float below = col > 0 ? s_r[col - 1] : 0.0f;
  const float rest = target - below;

  // Down column `col`: the first depth whose cumulative weight passes the rest. Sums in another
  // order can leave the column at or below the rest: then take its last token with weight, the
  // first depth where its scan reaches its end.
  float column_total;
  int depth = ms_column_count<T, Q, HAS_Q>(p, qrow, scale, removed, use_p, V, C, DEPTH, col,
                                           rest, false, s_warp, &s_carry, column_total);
  if (depth >= DEPTH) {
    depth = ms_column_count<T, Q, HAS_Q>(p, qrow, scale, removed, use_p, V, C, DEPTH, col,
                                         column_total, true, s_warp, &s_carry, column_total);
  }
  if (t == 0) {
    const uint32_t index = min((uint32_t)col + (uint32_t)C * (uint32_t)depth, (uint32_t)V - 1);
    const bool bad = !isfinite(total) || !(total > 0.0f) || s_nan_draft;
    ms_write<ET>(out, accepted, bad ? (MS_INVALID | accepted) : index, s_eos_in_draft, eos, E);
  }
}
"""

#: What every kernel's source sees: the constants, then the device functions.
_HEADER = _DEFINES + _FUNCTIONS

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


def available(stream: StreamOrDevice = None) -> bool:
    """Whether the fused kernels can run on ``stream`` (MLX's CUDA backend, a GPU stream)."""
    return mx.cuda.is_available() and device_type(stream) == mx.DeviceType.gpu


_SOURCES = {
    "greedy_slices": (["logits"], ["part_max", "part_at"], _SLICES),
    "greedy_decide": (["part_max", "part_at", "draft", "eos"], ["out"], _DECIDE),
    "sampled": (["probs", "q", "draft", "eos", "u"], ["out"], _SAMPLED),
}


@cache
def _kernel(name: str) -> Callable[..., list[mx.array]]:
    inputs, outputs, source = _SOURCES[name]
    return mx.fast.cuda_kernel(
        name=f"mlx_spec_{name}",
        input_names=inputs,
        output_names=outputs,
        source=source,
        header=_HEADER,
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
