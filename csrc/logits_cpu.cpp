// Baseline (x86-64-v2 / any target) build of the CPU kernels and the run-time ISA dispatch.
#define FRL_NS cpu_baseline
#include "logits_cpu_impl.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace fused_rl {
namespace cpu {
namespace {
int g_mode = -1;  // -1: not decided yet

bool have_avx2() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(FRL_HAVE_AVX2_TU)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool use_avx2() {
  if (g_mode < 0) {
    const char* env = std::getenv("FUSED_RL_CPU_ISA");
    g_mode = (env && std::string(env) == "baseline") ? 1 : 0;
  }
  static const bool avx2 = have_avx2();
  return g_mode == 0 && avx2;
}
}  // namespace

// -1: the default again (FUSED_RL_CPU_ISA=baseline, else auto; read at the next call), 0: auto, 1: baseline
void set_isa(int mode) {
  if (mode < -1 || mode > 1) throw std::invalid_argument("cpu_set_isa: mode must be -1, 0 or 1");
  g_mode = mode;
}
const char* isa_name() { return use_avx2() ? "avx2+fma" : "baseline"; }
int max_threads() { return omp_get_max_threads(); }

#if defined(FRL_HAVE_AVX2_TU)
void token_stats(const StatsArgs& a) { use_avx2() ? cpu_avx2::token_stats(a) : cpu_baseline::token_stats(a); }
void token_grad(const GradArgs& a) { use_avx2() ? cpu_avx2::token_grad(a) : cpu_baseline::token_grad(a); }
void policy_fused(const PolicyArgs& a) { use_avx2() ? cpu_avx2::policy_fused(a) : cpu_baseline::policy_fused(a); }
#else
void token_stats(const StatsArgs& a) { cpu_baseline::token_stats(a); }
void token_grad(const GradArgs& a) { cpu_baseline::token_grad(a); }
void policy_fused(const PolicyArgs& a) { cpu_baseline::policy_fused(a); }
#endif

}  // namespace cpu
}  // namespace fused_rl
