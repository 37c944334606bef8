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
int device_count();
// Blocks launched per SM (grid = SMs x k, grid-stride over the rows); k >= 1, default 2.
void set_rows_per_sm(int k);
int rows_per_sm();
// 128-bit loads per thread in flight in the row sweeps: 1, 2 or 4 (default 4); bitwise the same results.
void set_unroll(int u);
int unroll();
}  // namespace cuda
}  // namespace fused_rl
