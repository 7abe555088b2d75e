// Helpers shared by the step kernels (see recurrent.cpp for why these kernels exist).
#pragma once

// The few ATen headers used (torch/extension.h would triple the compile time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include <xmmintrin.h>  // _mm_prefetch (SSE: every x86-64; the kernels build only there)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // torch's own vectorised exp (exported by libtorch_cpu)
#endif

namespace baton_step {



#if defined(__AVX2__) && defined(__FMA__)
// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c) on 8 floats: its FMA build (__expf_fma, what
// std::exp runs on every CPU with FMA) step for step in double lanes: the same table, the
// same constants, the same fused and unfused operations in its machine code's order, so the
// same bits as std::exp (checked over all 2^32 inputs on glibc 2.36), at about a quarter of
// its time. Lanes glibc sends to its special cases (|x| >= 2^6 * 1.375 and over: overflow,
// underflow, inf, NaN) are computed by std::exp itself.
namespace glibc_expf {
alignas(32) inline constexpr uint64_t kTab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
inline __m256d bits(uint64_t u) { return _mm256_castsi256_pd(_mm256_set1_epi64x((long long)u)); }

// exp of 4 floats, as doubles before the final rounding (cvtpd_ps rounds as glibc's cvtsd2ss)
inline __m128 exp4(__m128 x) {
  const __m256d inv_ln2_n = bits(0x40471547652b82fe), shift = bits(0x4338000000000000);
  const __m256d c0 = bits(0x3ebc6af84b912394), c1 = bits(0x3f2ebfce50fac4f3),
                c2 = bits(0x3f962e42ff0c52d6), one = _mm256_set1_pd(1.0);
  const __m256d xd = _mm256_cvtps_pd(x);
  const __m256d kd0 = _mm256_fmadd_pd(inv_ln2_n, xd, shift);  // round(x N / ln2) + SHIFT
  const __m256i ki = _mm256_castpd_si256(kd0);
  const __m256d r = _mm256_fmsub_pd(inv_ln2_n, xd, _mm256_sub_pd(kd0, shift));
  __m256i t = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kTab),
                                     _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
  t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 47));
  const __m256d z = _mm256_fmadd_pd(r, c0, c1), r2 = _mm256_mul_pd(r, r);
  __m256d y = _mm256_fmadd_pd(r, c2, one);
  y = _mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), _mm256_castsi256_pd(t));
  return _mm256_cvtpd_ps(y);
}

// std::exp of each lane, bit for bit
inline __m256 exp8(__m256 x) {
  const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20),
                                       _mm256_set1_epi32(0x7ff));
  const int special = _mm256_movemask_ps(
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))));
  const __m256 y = _mm256_set_m128(exp4(_mm256_extractf128_ps(x, 1)),
                                   exp4(_mm256_castps256_ps128(x)));
  if (!special) return y;
  alignas(32) float in[8], out[8];
  _mm256_store_ps(in, x);
  _mm256_store_ps(out, y);
  for (int j = 0; j < 8; ++j)
    if (special >> j & 1) out[j] = std::exp(in[j]);
  return _mm256_load_ps(out);
}

// out[0..8) = std::exp(in[0..8)), bit for bit (in and out may be the same)
inline void exp8(const float* in, float* out) { _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in))); }

// silu(x) = x / (1 + exp(-x)) of each lane, exp as std::exp: silu_<false>'s bits
inline __m256 silu8(__m256 x) {
  const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));  // exp(-x)
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
}  // namespace glibc_expf
#endif

// x[i] = exp(x[i] + shift) in place. Sleef true: Sleef's vectorised exp (~1 ulp), 16 lanes at
// a time where AVX-512 is there, else 8 with AVX2 (a scalar expf per element was a third of the
// Mamba2 step at batch 32: ~1.5M of them a step). Sleef false: std::exp's bits, 8 lanes at a
// time (glibc_expf::exp8) wherever AVX2 and FMA are, AVX-512 builds included. The tail past
// the last whole vector is scalar. The prefill kernels keep std::exp's bits: with Sleef's
// there, Qwen3.5's prompt logits against transformers' at 3,001 tokens read 1.04e-4 apart,
// over the parity test's 1e-4 (under it with std::exp).
template <bool Sleef = true>
inline void exp_(float* x, int64_t n, float shift) {
  int64_t i = 0;
  if constexpr (Sleef) {
#ifdef __AVX512F__
    const __m512 sh = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_add_ps(_mm512_loadu_ps(x + i), sh)));
#elif defined(__AVX2__)
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(x + i, Sleef_expf8_u10(_mm256_add_ps(_mm256_loadu_ps(x + i), sh)));
#endif
  } else {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), sh));
      glibc_expf::exp8(x + i, x + i);
    }
#endif
  }
  for (; i < n; ++i) x[i] = std::exp(x[i] + shift);
}

// out[i] = silu(x[i]) (out may be x); tmp: n floats of scratch. One pass, 8 lanes at a time,
// where it keeps the bits of the passes below (exp_<Sleef>(-x) then x / (1 + e)) without two
// trips through tmp: Sleef false with AVX2 and FMA (glibc_expf::silu8; AVX-512 builds too),
// Sleef true on an AVX2 build that is not AVX-512 (Sleef's 8-lane exp; AVX-512's exp_ takes
// 16 lanes, so it keeps the passes).
template <bool Sleef = true>
inline void silu_(const float* x, float* out, float* tmp, int64_t n) {
#if defined(__AVX2__)
#if defined(__AVX512F__)
  constexpr bool one_pass = !Sleef;
#elif defined(__FMA__)
  constexpr bool one_pass = true;
#else
  constexpr bool one_pass = Sleef;
#endif
  if constexpr (one_pass) {
    int64_t i = 0;
    const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      __m256 o;
      if constexpr (Sleef) {
        o = _mm256_div_ps(v, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(v, sign))));
      } else {
#ifdef __FMA__
        o = glibc_expf::silu8(v);
#endif
      }
      _mm256_storeu_ps(out + i, o);
    }
    for (; i < n; ++i) out[i] = x[i] / (1.f + std::exp(-x[i]));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) tmp[i] = -x[i];
  exp_<Sleef>(tmp, n, 0.f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / (1.f + tmp[i]);
}
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// Stored KV rows (`cache.kv_dtype`, baton/model/paged.py): a (token, kv head) row is hd
// float32 (KV_F32), hd bfloat16 (KV_BF16), or hd float8_e4m3fn then its float32 scale
// (KV_FP8, hd + 4 bytes). Widened to float32 exactly as `paged.dequantize`: bf16 by its bits,
// fp8 as value * scale (one rounding).
constexpr int64_t KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2;
inline int64_t kv_head_bytes(int64_t fmt, int64_t hd) {
  return fmt == KV_FP8 ? hd + 4 : fmt == KV_BF16 ? 2 * hd : 4 * hd;
}
inline const float* fp8_e4m3_table() {
  static const std::vector<float> t = [] {
    std::vector<float> a(256);
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 15 && m == 7 ? NAN
                : e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.f + m / 8.f, e - 7);
      a[b] = (b & 128) ? -x : x;
    }
    return a;
  }();
  return t.data();
}
// With AVX-512, 16 values at a time by their bits (the table's values exactly: a normal
// e4m3 (e, m) is the float with exponent e + 120 and mantissa m << 20, a subnormal m * 2^-9,
// 0x7f NaN), then the same multiply.
inline void kv_widen(const uint8_t* src, int64_t fmt, int64_t hd, float* out) {
  int64_t d0 = 0;
  if (fmt == KV_FP8) {
    float s;
    std::memcpy(&s, src + hd, 4);
    const float* lut = fp8_e4m3_table();
#ifdef __AVX512F__
    const __m512 sv = _mm512_set1_ps(s);
    for (; d0 + 16 <= hd; d0 += 16) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(src + d0)));
      const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
      const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512.f));
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)),
                                   _mm512_castps_si512(sub));
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                                   _mm512_set1_epi32(0x7FC00000));
      bits = _mm512_or_si512(bits, sign);
      _mm512_storeu_ps(out + d0, _mm512_mul_ps(_mm512_castsi512_ps(bits), sv));
    }
#endif
    for (int64_t d = d0; d < hd; ++d) out[d] = lut[src[d]] * s;
  } else if (fmt == KV_BF16) {
#ifdef __AVX512F__
    for (; d0 + 16 <= hd; d0 += 16) {
      const __m512i h = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256((const __m256i*)(src + 2 * d0)));
      _mm512_storeu_si512(out + d0, _mm512_slli_epi32(h, 16));
    }
#endif
    for (int64_t d = d0; d < hd; ++d) {
      uint16_t h;
      std::memcpy(&h, src + 2 * d, 2);
      const uint32_t u = (uint32_t)h << 16;
      std::memcpy(out + d, &u, 4);
    }
  } else {
    std::memcpy(out, src, 4 * hd);
  }
}

inline void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
}

}  // namespace baton_step
