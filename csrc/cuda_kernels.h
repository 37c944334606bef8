// Host-side launchers of the CUDA kernels (implemented in logits_cuda.cu); same argument structs as
// the CPU kernels, pointers are device pointers, `stream` a cudaStream_t as an integer.
#pragma once

#include <cstdint>
#include <string>

#include "cpu_kernels.h"

namespace fused_rl {
namespace cuda {
// Each returns an empty string on success, else the CUDA error text.
std::string token_stats(const StatsArgs& a, uintptr_t stream);
std::string token_grad(const GradArgs& a, uintptr_t stream);
std::string policy_fused(const PolicyArgs& a, uintptr_t stream);

// rows *= *g in place (in.x is written), g read on the device: no host sync, and nothing done when
// g == 1 (the usual loss.backward() of a loss whose single pass stored its dlogits).
struct ScaleArgs {
  RowsView in;
  const float* g;
};
std::string scale_rows(const ScaleArgs& a, uintptr_t stream);
int device_count();
// The gradient sweep from each row's end (default on) and with evict-first loads and stores (default
// on); bitwise the same results.
void set_reverse(bool on);
bool reverse();
void set_streaming(bool on);
bool streaming();
// Threads per block (one block per row at a time): a multiple of 32 in [64, 1024], default 1024.
void set_threads(int n);
int threads();
// Blocks launched per SM (grid = SMs x k, grid-stride over the rows); k >= 1, default 2.
void set_rows_per_sm(int k);
int rows_per_sm();
// 128-bit loads per thread in flight in the row sweeps: 1, 2 or 4 (default 4); bitwise the same results.
void set_unroll(int u);
int unroll();
}  // namespace cuda
}  // namespace fused_rl
