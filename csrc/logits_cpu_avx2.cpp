// AVX2 + FMA build of the CPU kernels (selected at run time when the CPU supports it).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"  // before the target pragma: its inline functions stay baseline

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma")
#endif
#define FRL_NS cpu_avx2
#define FRL_VEC_BYTES 32
#include "logits_cpu_impl.h"
