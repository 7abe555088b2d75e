// Helpers shared by the step kernels (see recurrent.cpp for why these kernels exist).
#pragma once

// The few ATen headers used (torch/extension.h would triple the compile time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include <xmmintrin.h>  // _mm_prefetch (SSE: every x86-64; the kernels build only there)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // torch's own vectorised exp (exported by libtorch_cpu)
#endif

namespace baton_step {



// x[i] = exp(x[i] + shift) in place: 16 lanes at a time where AVX-512 is there, else 8 with
// AVX2 unless Avx2 is false (a scalar expf per element was a third of the Mamba2 step at batch
// 32: ~1.5M of them a step); the tail past the last whole vector scalar. The prefill kernels
// keep the scalar exp on AVX2: with Sleef's there, Qwen3.5's prompt logits against
// transformers' at 3,001 tokens read 1.04e-4 apart, over the parity test's 1e-4 (under it
// with the scalar exp).
template <bool Avx2 = true>
inline void exp_(float* x, int64_t n, float shift) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 sh = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_add_ps(_mm512_loadu_ps(x + i), sh)));
#elif defined(__AVX2__)
  if constexpr (Avx2) {
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(x + i, Sleef_expf8_u10(_mm256_add_ps(_mm256_loadu_ps(x + i), sh)));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i] + shift);
}

// out[i] = silu(x[i]) (out may be x); tmp: n floats of scratch.
template <bool Avx2 = true>
inline void silu_(const float* x, float* out, float* tmp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) tmp[i] = -x[i];
  exp_<Avx2>(tmp, n, 0.f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / (1.f + tmp[i]);
}
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

inline void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
}

}  // namespace baton_step
