// Greedy acceptance in two launches: the argmax of every slice of every row, then the decision.
// Needs common.cuh.

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
    part_max[b] = nan ? ms_nan() : best;
    part_at[b] = at;
  }
}

// Greedy acceptance, row r of N + 1 given its argmax, whether it is invalid (a NaN, or a maximum
// of +inf or -inf, as the composition decides), and (for r < N) its draft token and whether that
// token ends the sequence: updates the result and says whether the rows after it are needed.
__device__ __forceinline__ bool ms_greedy_row(int r, int N, uint32_t choice, bool invalid,
                                              uint32_t d, bool d_is_eos, uint32_t& accepted,
                                              uint32_t& token, bool& eos_in_draft) {
  accepted = r;
  token = invalid ? (MS_INVALID | (uint32_t)r) : choice;
  // After an accepted end-of-sequence token, this row only supplies `next`.
  if (r == N || eos_in_draft || invalid || d != choice) return false;
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
  __shared__ bool s_invalid[32], s_draft_eos[32], s_more;
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
        // The row's maximum (over the slices without NaN) must be finite.
        s_invalid[warp] = nan || !isfinite(best);
        s_draft[warp] = d;
        s_draft_eos[warp] = r < R - 1 && ms_is_eos<ET>(d, eos, E);
      }
    }
    __syncthreads();
    if (t == 0) {
      bool more = true;
      for (int i = 0; more && i < W && base + i < R; ++i) {
        more = ms_greedy_row(base + i, R - 1, s_choice[i], s_invalid[i], s_draft[i], s_draft_eos[i],
                             accepted, token, eos_in_draft);
      }
      s_more = more;
    }
    __syncthreads();
    if (!s_more) break;
  }
  if (t == 0) ms_write<ET>(out, accepted, token, eos_in_draft, eos, E);
}
