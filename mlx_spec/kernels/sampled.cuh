// Sampled acceptance in one launch of one block: the ratio tests, then the draw of `next` from
// the residual of the deciding row. Needs common.cuh.

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

// Whether x is a probability: in [0, 1], and not NaN.
__device__ __forceinline__ bool ms_unit(float x) { return x >= 0.0f && x <= 1.0f; }

// Token j's weight in p, in pj, and in the residual, as the composition computes them: a negative
// p entry is NaN (it poisons the sums that check the row); the residual is max(p - q, 0) (NaN
// kept, as mx.maximum does), q subtracted only when `rejected` and NaN where that q entry is not
// a probability, or p without the removed token.
template <typename T, typename Q, bool HAS_Q>
__device__ __forceinline__ float ms_residual(
    const T* p, const Q* q, bool rejected, uint32_t removed, uint32_t j, float& pj) {
  const float x = ms_float(p[j]);
  pj = x < 0.0f ? ms_nan() : x;
  if (HAS_Q) {
    const float qj = rejected ? ms_float(q[j]) : 0.0f;
    if (!ms_unit(qj)) return ms_nan();
    const float d = pj - qj;
    return (isnan(d) || d > 0.0f) ? d : 0.0f;
  }
  return j == removed ? 0.0f : pj;
}

// How many depths of column `col` have a cumulative weight <= bound (< bound when strict), and
// the column's total.
template <typename T, typename Q, bool HAS_Q>
__device__ int ms_column_count(const T* p, const Q* q, bool rejected, uint32_t removed, bool use_p,
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
      const float rj = ms_residual<T, Q, HAS_Q>(p, q, rejected, removed, j, pj);
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
  __shared__ bool s_eos_in_draft, s_bad_draft;
  if (!ms_first_block()) return;
  const int t = threadIdx.x;
  if (t == 0) s_columns = ms_block_count(V);

  // The ratio tests, 32 draft positions at a time: u_i q_i(d_i) < p_i(d_i), where both values are
  // probabilities (else the position is rejected, and reported if it decides).
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
        reject = !(d < (uint32_t)V && ms_unit(p) && ms_unit(qd) && u[i] * qd < p);
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
      bool bad_draft = false;
      if (accepted < N && (uint32_t)draft[accepted] < (uint32_t)V) {
        // The deciding position's ratio test read a value that is not a probability (an id
        // outside the vocabulary reads nothing).
        const size_t at = (size_t)accepted * V + (uint32_t)draft[accepted];
        bad_draft = !ms_unit(ms_float(probs[at])) || (HAS_Q && !ms_unit(ms_float(q[at])));
      }
      s_bad_draft = bad_draft;
    }
  }
  __syncthreads();
  const int C = s_columns, DEPTH = (V + C - 1) / C;
  const int G = C < MS_THREADS ? MS_THREADS / C : 1;  // row groups per column
  const uint32_t accepted = s_accepted;
  const bool rejected = accepted < (uint32_t)N;
  const T* p = probs + (size_t)accepted * V;
  const Q* qrow = q + (size_t)(rejected ? accepted : (uint32_t)(N > 0 ? N - 1 : 0)) * V;
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
        sr += ms_residual<T, Q, HAS_Q>(p, qrow, rejected, removed, j, pj);
        sp += pj;
      }
    }
    s_p[slot] = sp;
    s_r[slot] = sr;
  }
  __syncthreads();
  float p_mass = 0.0f, r_mass = 0.0f;
  for (int c = t; c < C; c += MS_THREADS) {
    float sp = s_p[c], sr = s_r[c];
    for (int g = 1; g < G; ++g) { sp += s_p[g * C + c]; sr += s_r[g * C + c]; }
    s_p[c] = sp;
    s_r[c] = sr;
    p_mass += sp;
    r_mass += sr;
  }
  // Whether the residual has mass, as `!(sum > 0)` decides it in the composition: a sum of
  // non-negative terms is positive in any order, and NaN in any order.
  const bool r_nan = __syncthreads_or(isnan(r_mass));
  const bool use_p = r_nan || !__syncthreads_or(r_mass > 0.0f);
  // p's total, for the check of the row: the threads' partial sums added by a block scan.
  const float p_scan = ms_block_scan(p_mass, 0.0f, s_warp);
  if (t == MS_THREADS - 1) s_carry = p_scan;
  __syncthreads();
  const float p_total = s_carry;
  __syncthreads();

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
  int depth = ms_column_count<T, Q, HAS_Q>(p, qrow, rejected, removed, use_p, V, C, DEPTH, col,
                                           rest, false, s_warp, &s_carry, column_total);
  if (depth >= DEPTH) {
    depth = ms_column_count<T, Q, HAS_Q>(p, qrow, rejected, removed, use_p, V, C, DEPTH, col,
                                         column_total, true, s_warp, &s_carry, column_total);
  }
  if (t == 0) {
    const uint32_t index = min((uint32_t)col + (uint32_t)C * (uint32_t)depth, (uint32_t)V - 1);
    // As the composition: p's total within MS_MASS_TOLERANCE of 1 (a NaN or negative entry makes
    // it NaN, an infinite one infinite), no NaN in the residual (a q entry that is not a
    // probability), and probabilities at the deciding ratio test. A valid p has a positive,
    // finite total, and so has the residual when it is drawn from.
    const bool bad = !(fabsf(p_total - 1.0f) <= MS_MASS_TOLERANCE) || r_nan || s_bad_draft;
    ms_write<ET>(out, accepted, bad ? (MS_INVALID | accepted) : index, s_eos_in_draft, eos, E);
  }
}
