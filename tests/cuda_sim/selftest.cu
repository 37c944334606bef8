// Kernels with the bugs the emulation must catch (tests/test_cuda_sim.py::test_the_emulation_catches_*),
// and their correct forms. Compiled by g++ over include/cuda_sim.h only; called through ctypes.
#include <cuda_runtime.h>

#include <cstring>

namespace {
constexpr int kThreads = 64;

struct Args {
  const float* x;
  float* out;
};

// out[b] = sum of the block's 64 inputs, through shared memory and thread 0.
__global__ void block_sum(Args a) {
  FRL_SHARED(float, s, kThreads);
  s[threadIdx.x] = a.x[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (unsigned i = 0; i < blockDim.x; ++i) t += s[i];
    a.out[blockIdx.x] = t;
  }
}

// The same without the barrier: thread 0 may read entries not yet written.
__global__ void block_sum_missing_barrier(Args a) {
  FRL_SHARED(float, s, kThreads);
  s[threadIdx.x] = a.x[blockIdx.x * blockDim.x + threadIdx.x];
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (unsigned i = 0; i < blockDim.x; ++i) t += s[i];
    a.out[blockIdx.x] = t;
  }
}

// block_sum where block 0 writes all its entries and every other block only its first warp's: thread 0 of
// blocks >= 1 reads 32 entries its block never wrote (block 0 wrote them, in the same buffer).
__global__ void block_sum_half_written(Args a) {
  FRL_SHARED(float, s, kThreads);
  if (blockIdx.x == 0 || threadIdx.x < 32) s[threadIdx.x] = a.x[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (unsigned i = 0; i < blockDim.x; ++i) t += s[i];
    a.out[blockIdx.x] = t;
  }
}

// block_sum with a second shared array declared on the same line, zeroed after the first is written.
__global__ void block_sum_two_arrays(Args a) {
  FRL_SHARED(float, s, kThreads); FRL_SHARED(float, z, kThreads);  // NOLINT: two on one line on purpose
  s[threadIdx.x] = a.x[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  z[threadIdx.x] = 0.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (unsigned i = 0; i < blockDim.x; ++i) t += s[i] + z[i];
    a.out[blockIdx.x] = t;
  }
}

// out[i] = the sum over i's warp, by butterfly shuffles.
__global__ void warp_sum(Args a) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = a.x[i];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  a.out[i] = v;
}

// A barrier only half of the block reaches.
__global__ void divergent_barrier(Args a) {
  if (threadIdx.x < kThreads / 2) __syncthreads();
  a.out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// A full-mask shuffle only half of each warp reaches.
__global__ void divergent_shuffle(Args a) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = a.x[i];
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  a.out[i] = v;
}
}  // namespace

// Runs kernel `which` on `blocks` blocks of 64 threads; returns the launch error text ("" if none).
extern "C" const char* cuda_sim_selftest(int which, int blocks, const float* x, float* out) {
  void (*const kernels[])(Args) = {block_sum, block_sum_missing_barrier, warp_sum, divergent_barrier,
                                   divergent_shuffle, block_sum_half_written, block_sum_two_arrays};
  cudaStream_t stream = nullptr;
  FRL_LAUNCH(kernels[which], blocks, kThreads, stream, (Args{x, out}));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : cudaGetErrorString(e);
}
