// The alternatives to the shipped greedy kernels that benchmarks/fused_greedy.py times, compiled
// after the shipped greedy header (mlx_spec.kernels.header("greedy")).

// Argmax of one row by the whole block, and whether the row is invalid: a NaN, or a maximum of
// +inf or -inf (then the index is meaningless). 16-byte loads when the row is aligned.
template <typename T>
__device__ void ms_row_argmax(const T* row, int V, uint32_t& index, bool& invalid) {
  __shared__ float s_best[32];
  __shared__ uint32_t s_at[32];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float best = __int_as_float(0xFF800000);  // -inf
  uint32_t at = 0xFFFFFFFFu;
  bool nan = false;
  constexpr int W = 16 / sizeof(T);
  if (V % W == 0 && (reinterpret_cast<size_t>(row) & 15) == 0) {
    const uint4* chunks = reinterpret_cast<const uint4*>(row);
#pragma unroll 4
    for (int k = t; k < V / W; k += MS_THREADS) {
      uint4 raw = chunks[k];
      const T* xs = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        float x = ms_float(xs[j]);
        nan |= isnan(x);
        ms_keep_max(best, at, x, k * W + j);
      }
    }
  } else {
#pragma unroll 4
    for (int k = t; k < V; k += MS_THREADS) {
      float x = ms_float(row[k]);
      nan |= isnan(x);
      ms_keep_max(best, at, x, k);
    }
  }
  ms_warp_max(best, at);
  if (lane == 0) { s_best[warp] = best; s_at[warp] = at; }
  nan = __syncthreads_or(nan);
  if (warp == 0) {
    best = s_best[lane];
    at = s_at[lane];
    ms_warp_max(best, at);
    if (lane == 0) { s_best[0] = best; s_at[0] = at; }
  }
  __syncthreads();
  index = s_at[0];
  invalid = nan || !isfinite(s_best[0]);
  __syncthreads();
}

template <typename T, typename D, typename ET>
__device__ void ms_greedy(const T* logits, const D* draft, const ET* eos, uint32_t* out, int N,
                          int V, int E) {
  if (!ms_first_block()) return;
  uint32_t accepted = 0, token = 0;
  bool eos_in_draft = false;
  for (int r = 0; r <= N; ++r) {
    uint32_t choice;
    bool invalid;
    ms_row_argmax<T>(logits + (size_t)r * V, V, choice, invalid);
    const uint32_t d = r < N ? (uint32_t)draft[r] : 0u;
    const bool d_is_eos = r < N && ms_is_eos<ET>(d, eos, E);
    if (!ms_greedy_row(r, N, choice, invalid, d, d_is_eos, accepted, token, eos_in_draft)) break;
  }
  if (threadIdx.x == 0) ms_write<ET>(out, accepted, token, eos_in_draft, eos, E);
}

// Every block takes the argmax of one slice, as the shipped first launch does, then a ticket from
// `counter`; the last block to take one decides, and zeroes the counter again (for a counter kept
// between calls).
template <typename T, typename D, typename ET>
__device__ void ms_greedy_one_launch(const T* logits, const D* draft, const ET* eos,
                                     uint32_t* counter, uint32_t* out, float* part_max,
                                     uint32_t* part_at, int R, int V, int E) {
  __shared__ bool s_last;
  const int S = (V + MS_SLICE - 1) / MS_SLICE;
  ms_slice_argmax<T>(logits, part_max, part_at, R, V);
  if (threadIdx.x == 0) {
    __threadfence();
    const bool last = atomicAdd(counter, 1u) == (uint32_t)(R * S - 1);
    if (last) *counter = 0u;
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  ms_greedy_decide<D, ET>(part_max, part_at, draft, eos, out, R, S, E);
}
