// Device functions every mlx-spec kernel uses. The launchers (mlx_spec/kernels/__init__.py) put
// the MS_* #defines first, then this file, then the kernel's own file, into MLX's kernel header.

__device__ __forceinline__ float ms_float(float x) { return x; }
__device__ __forceinline__ float ms_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float ms_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float ms_nan() { return __int_as_float(0x7FC00000); }

template <typename ET>
__device__ __forceinline__ bool ms_is_eos(uint32_t token, const ET* eos, int E) {
  bool hit = false;
  for (int i = 0; i < E; ++i) hit |= token == (uint32_t)eos[i];
  return hit;
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
