// pybind11 module fused_rl._C: raw pointers (tensor.data_ptr()), sizes, strides in elements and dtype
// codes only, so the extension does not depend on the torch C++ ABI. Python allocates every output.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_kernels.h"
#include "policy_epilogue.h"
#ifdef FRL_WITH_CUDA
#include "cuda_kernels.h"
#endif

namespace py = pybind11;
using namespace fused_rl;

namespace {

template <class T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

RowsView rows(uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st) {
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("fused_rl._C: bad logits dtype code");
  return RowsView{ptr<const void>(x), dtype, B, T, V, sb, st};
}

StatsArgs stats_args(uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                     uintptr_t targets, int tdtype, float inv_tau, uintptr_t logp, uintptr_t ent, uintptr_t lse,
                     int nthreads) {
  return StatsArgs{rows(x, dtype, B, T, V, sb, st), ptr<const void>(targets), tdtype, inv_tau,
                   ptr<float>(logp), ptr<float>(ent), ptr<float>(lse), nthreads};
}

GradArgs grad_args(uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                   uintptr_t targets, int tdtype, float inv_tau, uintptr_t lse, uintptr_t g_logp, uintptr_t ent,
                   uintptr_t g_ent, uintptr_t out, int64_t osb, int64_t ost, int nthreads) {
  return GradArgs{rows(x, dtype, B, T, V, sb, st), ptr<const void>(targets), tdtype, inv_tau,
                  ptr<const float>(lse), ptr<const float>(g_logp), ptr<const float>(ent),
                  ptr<const float>(g_ent), ptr<void>(out), osb, ost, nthreads};
}

PolicyArgs policy_args(uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                       uintptr_t targets, int tdtype, float inv_tau, uintptr_t adv, uintptr_t old, uintptr_t ref,
                       uintptr_t rollout, uintptr_t w, EpilogueParams ep, uintptr_t logp, uintptr_t ent,
                       uintptr_t out, int64_t osb, int64_t ost, int odtype, int nthreads) {
  if (ep.policy == kGspo) throw std::invalid_argument("fused_rl._C: gspo is sequence-level; not fused");
  if (odtype != dtype && !(dtype == kFloat32 && (odtype == kBFloat16 || odtype == kFloat16)))
    throw std::invalid_argument("fused_rl._C: dlogits in the logits dtype, or 16-bit for fp32 logits only");
  if (ep.rollout != kRolloutNone && rollout == 0)
    throw std::invalid_argument("fused_rl._C: the rollout correction needs the rollout log-probs");
  ep.has_old = old != 0 ? 1 : 0;
  return PolicyArgs{rows(x, dtype, B, T, V, sb, st), ptr<const void>(targets), tdtype, inv_tau,
                    ptr<const float>(adv), ptr<const float>(old), ptr<const float>(ref), ptr<const float>(rollout),
                    ptr<const float>(w), ep, ptr<float>(logp), ptr<float>(ent), ptr<void>(out), osb, ost, odtype,
                    nthreads};
}

#define FRL_STATS_ARGS                                                                                    \
  py::arg("x"), py::arg("dtype"), py::arg("B"), py::arg("T"), py::arg("V"), py::arg("sb"), py::arg("st"), \
      py::arg("targets"), py::arg("tdtype"), py::arg("inv_tau"), py::arg("logp"), py::arg("ent"),         \
      py::arg("lse"), py::arg("nthreads")
#define FRL_GRAD_ARGS                                                                                     \
  py::arg("x"), py::arg("dtype"), py::arg("B"), py::arg("T"), py::arg("V"), py::arg("sb"), py::arg("st"), \
      py::arg("targets"), py::arg("tdtype"), py::arg("inv_tau"), py::arg("lse"), py::arg("g_logp"),      \
      py::arg("ent"), py::arg("g_ent"), py::arg("out"), py::arg("osb"), py::arg("ost"), py::arg("nthreads")
#define FRL_POLICY_ARGS                                                                                   \
  py::arg("x"), py::arg("dtype"), py::arg("B"), py::arg("T"), py::arg("V"), py::arg("sb"), py::arg("st"), \
      py::arg("targets"), py::arg("tdtype"), py::arg("inv_tau"), py::arg("adv"), py::arg("old"),         \
      py::arg("ref"), py::arg("rollout"), py::arg("w"), py::arg("ep"), py::arg("logp"), py::arg("ent"),  \
      py::arg("out"), py::arg("osb"), py::arg("ost"), py::arg("odtype")

#ifdef FRL_WITH_CUDA
void check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error("fused_rl._C CUDA kernel failed: " + err);
}
#endif

}  // namespace

#ifndef FRL_MODULE
#define FRL_MODULE _C  // tests/cuda_sim builds these bindings over the CPU emulation of the CUDA kernels
#endif

PYBIND11_MODULE(FRL_MODULE, m) {
  m.doc() = "fused_rl native kernels (CPU, optionally CUDA); raw-pointer interface, see fused_rl/backends/native.py";

  m.def("cpu_token_stats", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                              uintptr_t targets, int tdtype, float inv_tau, uintptr_t logp, uintptr_t ent,
                              uintptr_t lse, int nthreads) {
    const StatsArgs a = stats_args(x, dtype, B, T, V, sb, st, targets, tdtype, inv_tau, logp, ent, lse, nthreads);
    py::gil_scoped_release nogil;
    cpu::token_stats(a);
  }, FRL_STATS_ARGS);

  m.def("cpu_token_grad", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                             uintptr_t targets, int tdtype, float inv_tau, uintptr_t lse, uintptr_t g_logp,
                             uintptr_t ent, uintptr_t g_ent, uintptr_t out, int64_t osb, int64_t ost, int nthreads) {
    const GradArgs a = grad_args(x, dtype, B, T, V, sb, st, targets, tdtype, inv_tau, lse, g_logp, ent, g_ent,
                                 out, osb, ost, nthreads);
    py::gil_scoped_release nogil;
    cpu::token_grad(a);
  }, FRL_GRAD_ARGS);

  py::class_<EpilogueParams>(m, "EpilogueParams", "Settings of the shared loss epilogue (policy_epilogue.h)")
      .def(py::init<>())
      .def_readwrite("policy", &EpilogueParams::policy)
      .def_readwrite("kl", &EpilogueParams::kl)
      .def_readwrite("kl_straight", &EpilogueParams::kl_straight)
      .def_readwrite("kl_bias", &EpilogueParams::kl_bias)
      .def_readwrite("has_kl_clamp", &EpilogueParams::has_kl_clamp)
      .def_readwrite("has_kl_is", &EpilogueParams::has_kl_is)
      .def_readwrite("kl_clamp", &EpilogueParams::kl_clamp)
      .def_readwrite("kl_is_clip", &EpilogueParams::kl_is_clip)
      .def_readwrite("has_dual", &EpilogueParams::has_dual)
      .def_readwrite("has_delta", &EpilogueParams::has_delta)
      .def_readwrite("rollout", &EpilogueParams::rollout)
      .def_readwrite("clip_low", &EpilogueParams::clip_low)
      .def_readwrite("clip_high", &EpilogueParams::clip_high)
      .def_readwrite("dual_clip", &EpilogueParams::dual_clip)
      .def_readwrite("delta", &EpilogueParams::delta)
      .def_readwrite("sapo_pos", &EpilogueParams::sapo_pos)
      .def_readwrite("sapo_neg", &EpilogueParams::sapo_neg)
      .def_readwrite("beta", &EpilogueParams::beta)
      .def_readwrite("entropy_coef", &EpilogueParams::entropy_coef)
      .def_readwrite("rollout_min", &EpilogueParams::rollout_min)
      .def_readwrite("rollout_max", &EpilogueParams::rollout_max);

  m.def("cpu_policy_fused", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                               uintptr_t targets, int tdtype, float inv_tau, uintptr_t adv, uintptr_t old,
                               uintptr_t ref, uintptr_t rollout, uintptr_t w, const EpilogueParams& ep,
                               uintptr_t logp, uintptr_t ent, uintptr_t out, int64_t osb, int64_t ost, int odtype,
                               int nthreads) {
    const PolicyArgs a = policy_args(x, dtype, B, T, V, sb, st, targets, tdtype, inv_tau, adv, old, ref, rollout, w,
                                     ep, logp, ent, out, osb, ost, odtype, nthreads);
    py::gil_scoped_release nogil;
    cpu::policy_fused(a);
  }, FRL_POLICY_ARGS, py::arg("nthreads"));

  m.def("epilogue", [](int64_t n, uintptr_t logp, uintptr_t ent, uintptr_t adv, uintptr_t old, uintptr_t ref,
                       uintptr_t rollout, uintptr_t w, EpilogueParams p, uintptr_t loss, uintptr_t g_logp,
                       uintptr_t g_ent) {
    if (p.rollout != kRolloutNone && rollout == 0)
      throw std::invalid_argument("fused_rl._C: the rollout correction needs the rollout log-probs");
    p.has_old = old != 0 ? 1 : 0;
    const float *lp = ptr<const float>(logp), *h = ptr<const float>(ent), *a = ptr<const float>(adv),
                *o = ptr<const float>(old), *r = ptr<const float>(ref), *q = ptr<const float>(rollout),
                *ww = ptr<const float>(w);
    float *l = ptr<float>(loss), *gl = ptr<float>(g_logp), *ge = ptr<float>(g_ent);
    for (int64_t i = 0; i < n; ++i) {
      const EpilogueOut e = policy_epilogue(p, lp[i], h[i], a[i], o ? o[i] : 0.0f, r ? r[i] : 0.0f,
                                            q ? q[i] : 0.0f, ww[i]);
      l[i] = e.loss; gl[i] = e.g_logp; ge[i] = e.g_ent;
    }
  }, "Evaluate the shared loss epilogue (policy_epilogue.h) on per-token fp32 arrays (for tests).");

  m.def("advise_hugepages", [](uintptr_t p, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Ask for transparent huge pages on a fresh, untouched output buffer: first-touch page faults
    // of a multi-GB dlogits buffer otherwise cost as much as the kernel itself.
    const uintptr_t huge = uintptr_t(2) << 20;
    const uintptr_t start = (p + huge - 1) & ~(huge - 1), end = (p + uintptr_t(nbytes)) & ~(huge - 1);
    if (end > start) return madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE) == 0;
#endif
    (void)p; (void)nbytes;
    return false;
  }, py::arg("ptr"), py::arg("nbytes"), "madvise(MADV_HUGEPAGE) on the 2 MiB-aligned interior of a buffer");

  m.def("cpu_set_isa", &cpu::set_isa, py::arg("mode"),
        "-1: the default (FUSED_RL_CPU_ISA=baseline, else auto), 0: auto (AVX2 when available), 1: baseline build");
  m.def("cpu_isa", &cpu::isa_name);
  m.def("cpu_max_threads", &cpu::max_threads);

#ifdef FRL_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("cuda_device_count", &cuda::device_count);
  m.def("cuda_set_rows_per_sm", [](int k) {
    if (k < 1 || k > 64) throw std::invalid_argument("rows per SM must be in [1, 64], got " + std::to_string(k));
    cuda::set_rows_per_sm(k);
  }, py::arg("k"), "blocks per SM of the CUDA kernels' grid (default 2; a tuning knob)");
  m.def("cuda_rows_per_sm", &cuda::rows_per_sm);
  m.def("cuda_set_threads", [](int n) {
    if (n < 64 || n > 1024 || n % 32 != 0)
      throw std::invalid_argument("threads must be a multiple of 32 in [64, 1024], got " + std::to_string(n));
    cuda::set_threads(n);
  }, py::arg("n"), "threads per block of the CUDA kernels (one row at a time; default 1024; a tuning knob)");
  m.def("cuda_threads", &cuda::threads);
  m.def("cuda_set_reverse", &cuda::set_reverse, py::arg("on"),
        "the CUDA kernels' gradient sweep from each row's end (default on; a tuning knob, same results)");
  m.def("cuda_reverse", &cuda::reverse);
  m.def("cuda_set_streaming", &cuda::set_streaming, py::arg("on"),
        "evict-first loads and stores in the CUDA kernels' gradient sweep (default on; a tuning knob, same results)");
  m.def("cuda_streaming", &cuda::streaming);
  m.def("cuda_set_unroll", [](int u) {
    if (u != 1 && u != 2 && u != 4) throw std::invalid_argument("unroll must be 1, 2 or 4, got " + std::to_string(u));
    cuda::set_unroll(u);
  }, py::arg("u"), "128-bit loads per thread in flight in the CUDA kernels' row sweeps (default 4; a tuning knob)");
  m.def("cuda_unroll", &cuda::unroll);
  m.def("cuda_token_stats", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                               uintptr_t targets, int tdtype, float inv_tau, uintptr_t logp, uintptr_t ent,
                               uintptr_t lse, uintptr_t stream) {
    const StatsArgs a = stats_args(x, dtype, B, T, V, sb, st, targets, tdtype, inv_tau, logp, ent, lse, 0);
    check(cuda::token_stats(a, stream));
  });
  m.def("cuda_token_grad", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                              uintptr_t targets, int tdtype, float inv_tau, uintptr_t lse, uintptr_t g_logp,
                              uintptr_t ent, uintptr_t g_ent, uintptr_t out, int64_t osb, int64_t ost,
                              uintptr_t stream) {
    const GradArgs a = grad_args(x, dtype, B, T, V, sb, st, targets, tdtype, inv_tau, lse, g_logp, ent, g_ent,
                                 out, osb, ost, 0);
    check(cuda::token_grad(a, stream));
  });
  m.def("cuda_policy_fused", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                                uintptr_t targets, int tdtype, float inv_tau, uintptr_t adv, uintptr_t old,
                                uintptr_t ref, uintptr_t rollout, uintptr_t w, const EpilogueParams& ep,
                                uintptr_t logp, uintptr_t ent, uintptr_t out, int64_t osb, int64_t ost,
                                int odtype, uintptr_t stream) {
    const PolicyArgs a = policy_args(x, dtype, B, T, V, sb, st, targets, tdtype, inv_tau, adv, old, ref, rollout, w,
                                     ep, logp, ent, out, osb, ost, odtype, 0);
    check(cuda::policy_fused(a, stream));
  }, FRL_POLICY_ARGS, py::arg("stream"));
  m.def("cuda_scale_", [](uintptr_t x, int dtype, int64_t B, int64_t T, int64_t V, int64_t sb, int64_t st,
                          uintptr_t g, uintptr_t stream) {
    check(cuda::scale_rows(cuda::ScaleArgs{rows(x, dtype, B, T, V, sb, st), ptr<const float>(g)}, stream));
  }, py::arg("x"), py::arg("dtype"), py::arg("B"), py::arg("T"), py::arg("V"), py::arg("sb"), py::arg("st"),
     py::arg("g"), py::arg("stream"), "rows of x *= *g (an fp32 device scalar) in place; nothing when g == 1");
#else
  m.attr("has_cuda") = false;
#endif
}
