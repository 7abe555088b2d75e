// A MoE layer's small element-wise glue (the softmax router and the sigmoid group one,
// top-k, the renormalising sum, SwiGLU's silu, the shared expert's sigmoid gate) as plain
// loops, each rounding every element exactly as the ATen op it replaces rounds it on a CPU
// where torch runs its AVX-512 or its AVX2 kernels (the vector replicas come in both widths,
// 16 and 8 lanes, chosen by torch's capability). At batch 1 the ~20 ATen calls of
// `softmax_moe` cost ~0.1 ms a layer, run with cold caches after every weight stream (dispatch, allocation,
// views): a sixth of the layer. Included by gemv_moe.h.
//
// What each replica follows (torch's CPU kernels, float32; `available()` says when they apply):
//   softmax (last dim, `_vec_softmax_lastdim`): max = reduce_all(maximum), out = exp(x - max)
//     (Sleef's expf16_u10, as Vectorized<float>::exp), sum = reduce_all(+), out *= 1 / sum;
//     reduce_all: a row under one vector (16 lanes; 8 on AVX2) folds lane by lane into lane
//     0, a longer one folds whole vectors (a masked tail blends in), then the shuffle tree
//     (4 steps; 3 on AVX2).
//   topk (largest, sorted; `topk_impl_loop`): (value, index) pairs, std::partial_sort when
//     k * 64 <= E, else std::nth_element and a sort of the first k - 1, NaN ranking on top.
//   the renormalising sum of k < 16 weights: `weight_sum`, torch's order (its AVX2 kernel);
//   the divisions, products and sums: one IEEE operation each, as torch's.
//   silu (`cpu_kernel_vec`): along a row, whole chunks of two vectors (32; 16 on AVX2) on the
//     vector path (x / (1 + exp(-x)), Sleef's exp), the tail on the scalar one (std::exp); one call's
//     elements all in one thread (rows * width under torch's grain, 32768), else torch splits
//     the range and the chunks move: the caller keeps ATen then.
//   sigmoid through `sigmoid_by_element`'s stride-2 view: the scalar path, 1 / (1 + exp(-x));
//   scalars added to or multiplying a float32 tensor (1e-20, the routed scale): rounded to
//   float32 first.
// tests/unit/model/layers/test_moe_route.py holds each against the ATen op, bit for bit.
#pragma once

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/Version.h>  // at::get_cpu_capability
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace baton_route {

constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE: TensorIterator's serial limit

// The width of torch's vector kernels here: 16 (AVX-512), 8 (AVX2), 0 (other: no replicas).
inline int lanes() {
  static const int n = [] {
    __builtin_cpu_init();
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512" && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return 16;
    if (cap == "AVX2" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return 8;
    return 0;
  }();
  return n;
}

// torch runs its AVX-512 or AVX2 kernels here, and this CPU has what the replicas use.
inline bool available() { return lanes() != 0; }

// The sigmoid group router alone: its replicas (the scalar sigmoid, top-k's selection, the
// renormalising sum, which is torch's AVX2 sum kernel under either capability, one IEEE op
// each for the rest) use no AVX-512 and follow torch wherever it runs its AVX2 or AVX-512
// kernels.
inline bool sigmoid_available() {
  static const bool ok = [] {
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX512" || cap == "AVX2";
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

extern "C" __m512 Sleef_expf16_u10(__m512);  // exported by libtorch_cpu: torch's own exp

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// Vectorized<float>::maximum: max, NaN (all bits set) where either side is NaN.
inline __m512 vmax(__m512 a, __m512 b) {
  const __m512 m = _mm512_max_ps(a, b);
  const __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  return _mm512_or_ps(m, _mm512_castsi512_ps(_mm512_mask_set1_epi32(_mm512_setzero_si512(),
                                                                    nan, -1)));
}
inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }

// vec::reduce_all(op, data, n) of float with AVX-512 (functional_base.h).
template <class Op>
inline float reduce_all(Op op, const float* d, int64_t n) {
  if (n < 16) {
    const __m512 v = _mm512_maskz_loadu_ps(first(n), d);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    __m512 acc = v;
    for (int64_t i = 1; i < n; ++i)
      acc = op(acc, _mm512_maskz_loadu_ps(first(1), lanes + i));
    return _mm512_cvtss_f32(acc);
  }
  __m512 acc = _mm512_loadu_ps(d);
  int64_t i = 16;
  for (; i < n - n % 16; i += 16) acc = op(acc, _mm512_loadu_ps(d + i));
  if (n - i > 0)
    acc = _mm512_mask_blend_ps(first(n - i), acc, op(acc, _mm512_maskz_loadu_ps(first(n - i),
                                                                                 d + i)));
  __m512 v1 = _mm512_shuffle_f32x4(acc, acc, 0x4E);
  acc = op(acc, v1);
  v1 = _mm512_shuffle_f32x4(acc, acc, 0xB1);
  acc = op(acc, v1);
  v1 = _mm512_shuffle_ps(acc, acc, 0x4E);
  acc = op(acc, v1);
  v1 = _mm512_shuffle_ps(acc, acc, 0xB1);
  acc = op(acc, v1);
  return _mm512_cvtss_f32(acc);
}

// vec::map(f, out, in, n): whole vectors, then a masked tail.
template <class F>
inline void map(F f, float* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i < n - n % 16; i += 16) _mm512_storeu_ps(out + i, f(_mm512_loadu_ps(in + i)));
  if (n - i > 0)
    _mm512_mask_storeu_ps(out + i, first(n - i), f(_mm512_maskz_loadu_ps(first(n - i), in + i)));
}

// softmax of one row of n (contiguous) into out, torch's AVX-512 kernel.
inline void softmax_row16(const float* x, float* out, int64_t n) {
  const float mx = reduce_all(vmax, x, n);
  const __m512 vm = _mm512_set1_ps(mx);
  map([vm](__m512 v) { return Sleef_expf16_u10(_mm512_sub_ps(v, vm)); }, out, x, n);
  float s = reduce_all(vadd, out, n);
  s = 1 / s;
  const __m512 vs = _mm512_set1_ps(s);
  map([vs](__m512 v) { return _mm512_mul_ps(v, vs); }, out, out, n);
}

// silu along a row of n, torch's AVX-512 kernel.
inline void silu_row16(const float* x, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  int64_t i = 0;
  for (const int64_t vec_end = n - n % 32; i < vec_end; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, Sleef_expf16_u10(
                                                                   _mm512_xor_ps(sign, v)))));
  }
  for (; i < n; ++i) out[i] = x[i] / (1.f + std::exp(-x[i]));
}

#pragma GCC pop_options

// The same four on torch's AVX2 kernels: Vectorized<float> is 8 lanes.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

extern "C" __m256 Sleef_expf8_u10(__m256);  // torch's exp of Vectorized<float> on AVX2

// Vectorized<float>::loadu(p, count) and store(p, count): through a zeroed 8-float buffer.
inline __m256 load8(const float* p, int64_t n) {
  alignas(32) float b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  std::memcpy(b, p, n * sizeof(float));
  return _mm256_load_ps(b);
}
inline void store8(float* p, __m256 v, int64_t n) {
  alignas(32) float b[8];
  _mm256_store_ps(b, v);
  std::memcpy(p, b, n * sizeof(float));
}

inline __m256 vmax8(__m256 a, __m256 b) {
  return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
inline __m256 vadd8(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }

// Vectorized<float>::set(a, b, count): b's first count lanes, a's others.
inline __m256 set8(__m256 a, __m256 b, int64_t count) {
  alignas(32) float x[8], y[8];
  _mm256_store_ps(x, a);
  _mm256_store_ps(y, b);
  for (int64_t i = 0; i < count; ++i) x[i] = y[i];
  return _mm256_load_ps(x);
}

template <class Op>
inline float tree8(Op op, __m256 v) {  // VecReduceAllSIMD<float> on AVX2
  v = op(v, _mm256_permute2f128_ps(v, v, 0x1));
  v = op(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = op(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

template <class Op>
inline float reduce_all8(Op op, const float* d, int64_t n) {
  if (n < 8) {
    alignas(32) float lanes[8];
    __m256 acc = load8(d, n);
    _mm256_store_ps(lanes, acc);
    for (int64_t i = 1; i < n; ++i) acc = op(acc, load8(lanes + i, 1));
    return _mm256_cvtss_f32(acc);
  }
  __m256 acc = _mm256_loadu_ps(d);
  int64_t i = 8;
  for (; i < n - n % 8; i += 8) acc = op(acc, _mm256_loadu_ps(d + i));
  if (n - i > 0) acc = set8(acc, op(acc, load8(d + i, n - i)), n - i);
  return tree8(op, acc);
}

template <class F>
inline void map8(F f, float* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i < n - n % 8; i += 8) _mm256_storeu_ps(out + i, f(_mm256_loadu_ps(in + i)));
  if (n - i > 0) store8(out + i, f(load8(in + i, n - i)), n - i);
}

inline void softmax_row8(const float* x, float* out, int64_t n) {
  const float mx = reduce_all8(vmax8, x, n);
  const __m256 vm = _mm256_set1_ps(mx);
  map8([vm](__m256 v) { return Sleef_expf8_u10(_mm256_sub_ps(v, vm)); }, out, x, n);
  float s = reduce_all8(vadd8, out, n);
  s = 1 / s;
  const __m256 vs = _mm256_set1_ps(s);
  map8([vs](__m256 v) { return _mm256_mul_ps(v, vs); }, out, out, n);
}

inline void silu_row8(const float* x, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (const int64_t vec_end = n - n % 16; i < vec_end; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, Sleef_expf8_u10(
                                                                   _mm256_xor_ps(sign, v)))));
  }
  for (; i < n; ++i) out[i] = x[i] / (1.f + std::exp(-x[i]));
}

#pragma GCC pop_options

// softmax of one row of n (contiguous) into out, as torch's kernel of this CPU computes it.
inline void softmax_row(const float* x, float* out, int64_t n) {
  if (lanes() == 16) softmax_row16(x, out, n); else softmax_row8(x, out, n);
}

// silu along a row of n, as torch's kernel of this CPU computes it.
inline void silu_row(const float* x, float* out, int64_t n) {
  if (lanes() == 16) silu_row16(x, out, n); else silu_row8(x, out, n);
}

// topk(row of n, k, largest, sorted) as topk_impl_loop: values and indices.
inline void topk_row(const float* p, int64_t n, int64_t k, float* vals, int64_t* idx,
                     std::vector<std::pair<float, int64_t>>& q, bool sorted = true) {
  q.resize(n);
  for (int64_t j = 0; j < n; ++j) q[j] = {p[j], j};
  auto gt = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= n) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), gt);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), gt);
    if (sorted) std::sort(q.begin(), q.begin() + k - 1, gt);
  }
  for (int64_t j = 0; j < k; ++j) vals[j] = q[j].first, idx[j] = q[j].second;
}

// sigmoid_by_element's scalar path.
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// weights.sum(-1) of one row of k < 16 as torch sums it: its sum kernel is the AVX2 build
// (8 lanes) under the AVX-512 capability. Under 8: `row_sum`, four partial sums (element j
// into j % 4, the k % 4 tail into the first), then added in order. From 8: `vectorized_inner_sum`
// with one 8-lane vector (its lanes: elements 0-7) and a scalar sum of the rest from 0, then
// the lanes added to it in order.
inline float weight_sum(const float* w, int64_t k) {
  if (k < 8) {
    float p[4] = {0.f, 0.f, 0.f, 0.f};
    const int64_t body = k - k % 4;
    for (int64_t i = 0; i < body; ++i) p[i % 4] += w[i];
    for (int64_t i = body; i < k; ++i) p[0] += w[i];
    return ((p[0] + p[1]) + p[2]) + p[3];
  }
  float s = 0.f;
  for (int64_t i = 8; i < k; ++i) s += w[i];
  for (int64_t i = 0; i < 8; ++i) s += w[i];
  return s;
}

// Router of m rows of logits (row stride ld, e experts): weights [m, k] and experts [m, k] as
// softmax (float32) -> topk -> (norm) weights / weights.sum(-1, keepdim).
inline void route(const float* logits, int64_t ld, int64_t m, int64_t e, int64_t k, bool norm,
                  float* weights, int64_t* experts) {
  std::vector<float> probs(e);
  std::vector<std::pair<float, int64_t>> q;
  for (int64_t i = 0; i < m; ++i) {
    softmax_row(logits + i * ld, probs.data(), e);
    float* w = weights + i * k;
    topk_row(probs.data(), e, k, w, experts + i * k, q);
    if (!norm) continue;
    const float s = weight_sum(w, k);
    for (int64_t j = 0; j < k; ++j) w[j] = w[j] / s;
  }
}

// The sigmoid group router (`sigmoid_group_topk` with every group kept) of m rows of logits (row
// stride ld): scores = sigmoid (sigmoid_by_element's scalar path), experts = topk(scores +
// bias, k, sorted=False), weights = the chosen scores, (norm) / (sum + 1e-20), * scale (the
// scalars rounded to float32 first, as torch's ops on a float32 tensor take them).
inline void route_sigmoid(const float* logits, int64_t ld, int64_t m, int64_t e,
                          const float* bias, int64_t k, bool norm, float scale, float* weights,
                          int64_t* experts) {
  std::vector<float> scores(e), choice(e), vals(k);
  std::vector<std::pair<float, int64_t>> q;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < e; ++j) {
      scores[j] = sigmoid(logits[i * ld + j]);
      choice[j] = scores[j] + bias[j];
    }
    int64_t* ex = experts + i * k;
    float* w = weights + i * k;
    topk_row(choice.data(), e, k, vals.data(), ex, q, false);
    for (int64_t j = 0; j < k; ++j) w[j] = scores[ex[j]];
    if (norm) {
      const float s = weight_sum(w, k) + static_cast<float>(1e-20);
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / s;
    }
    for (int64_t j = 0; j < k; ++j) w[j] = w[j] * scale;
  }
}

// The span of elements each of torch's threads takes of an element-wise call over n elements
// (TensorIterator::for_each: one thread up to the grain, else at::parallel_for's chunks of
// divup(n, min(threads, divup(n, grain))) under OpenMP); n where the call is serial.
inline int64_t thread_span(int64_t n) {
  const int64_t threads = at::get_num_threads();
  if (n <= kGrain || threads == 1) return n;
  const int64_t parts = std::min(threads, (n + kGrain - 1) / kGrain);
  return (n + parts - 1) / parts;
}

// silu of one row of w elements that sit at `start` of a call whose threads take `span`
// elements each: torch's inner loop runs per row and per thread, so the row is cut where a
// thread's span ends and each piece has its own vector body and scalar tail.
inline void silu_row_at(const float* x, float* out, int64_t w, int64_t start, int64_t span) {
  for (int64_t j = 0; j < w;) {
    const int64_t pos = start + j, len = std::min(w - j, (pos / span + 1) * span - pos);
    silu_row(x + j, out + j, len);
    j += len;
  }
}

// silu(gu[:, :w]) * gu[:, w:] of rows r0..r0+m-1 (row stride ld) into out [m, w]
// (contiguous), as torch's silu and mul compute them at its thread count: `span` is
// thread_span of the whole call's elements (0: the call is these m rows).
inline void swiglu_rows(const float* gu, int64_t ld, int64_t m, int64_t w, float* out,
                        int64_t r0 = 0, int64_t span = 0) {
  if (span == 0) span = thread_span(m * w);
  for (int64_t i = 0; i < m; ++i) {
    const float *g = gu + i * ld, *u = g + w;
    float* o = out + i * w;
    silu_row_at(g, o, w, (r0 + i) * w, span);
    for (int64_t j = 0; j < w; ++j) o[j] = o[j] * u[j];
  }
}

}  // namespace baton_route
