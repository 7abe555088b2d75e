// Decode-sized linears on CPU: y[M,N] = x[M,K] @ W[N,K]^T (+ bias), W in float32, float16 or
// bfloat16 (upcast exactly), arithmetic in float32. Built by `baton.model.layers.cpu_kernels`.
//
// Exactness contract: output (i, n) is computed the same way whatever M, the row's place in
// the batch, the thread count or the instruction set:
//   16 lanes; lane l accumulates x[i,k] * W[n,k] for k = l, l+16, l+32, ... in that order, one
//   fused multiply-add each, starting from +0 (a K tail is read as zeros in the lanes past K);
//   then s8[l] = a[l] + a[l+8], s4[l] = s8[l] + s8[l+4], s2[l] = s4[l] + s4[l+2],
//   sum = s2[0] + s2[1]; then y = sum + bias[n] (when there is a bias).
// Blocks of rows and outputs only decide which accumulators live in registers together; the
// AVX-512 (one zmm a lane set), AVX2 (two ymm) and plain (std::fma) paths all follow it, so a
// row alone equals the same row inside any batch, bit for bit.
//
// Layout: W is read in place, row-major [N, K] (no repacked copy): each output's K weights are
// contiguous. Threads split the outputs N into contiguous ranges (at::parallel_for, torch's
// OpenMP pool); a thread streams its own rows of W once, all M rows of x reusing each block
// of W from cache.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cpuid.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum Wt : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
constexpr int64_t kLanes = 16;

struct Args {
  const float* x;     // [M, kp], rows padded with zeros to kp = K rounded up to 16
  int64_t kp;
  const void* w;      // [N, K] with row stride ldw (elements)
  int64_t ldw;
  int64_t k;
  float* y;           // [M, N], row stride n
  int64_t n;
  int64_t m;
  const float* bias;  // [N] or null
};

inline const char* wbase(const Args& a, int wt, int64_t row) {
  const int64_t es = wt == kF32 ? 4 : 2;
  return static_cast<const char*>(a.w) + row * a.ldw * es;
}

// ---------------------------------------------------------------------------------------------
// Plain C++ (any x86-64): the reference order, std::fma one element at a time.
inline float upcast(const char* p, int wt, int64_t k) {
  if (wt == kF32) return reinterpret_cast<const float*>(p)[k];
  uint16_t h = reinterpret_cast<const uint16_t*>(p)[k];
  if (wt == kF16) return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float tree16(const float* a) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

void scalar_range(const Args& a, int wt, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const char* wr = wbase(a, wt, n);
    for (int64_t i = 0; i < a.m; ++i) {
      const float* xr = a.x + i * a.kp;
      float acc[kLanes] = {0.f};
      for (int64_t k0 = 0; k0 < a.kp; k0 += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const int64_t k = k0 + l;
          const float wv = k < a.k ? upcast(wr, wt, k) : 0.f;
          acc[l] = std::fma(xr[k], wv, acc[l]);
        }
      float s = tree16(acc);
      if (a.bias) s = s + a.bias[n];
      a.y[i * a.n + n] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

template <int WT>
inline __m512 w512(const char* p, int64_t k) {
  if constexpr (WT == kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + k);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        reinterpret_cast<const uint16_t*>(p) + k));
    if constexpr (WT == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <int WT>
inline __m512 w512_tail(const char* p, int64_t k, __mmask16 mask) {
  if constexpr (WT == kF32) {
    return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(p) + k);
  } else {
    __m256i h = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(p) + k);
    if constexpr (WT == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

inline float tree512(__m512 v) {
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// MR rows of x times NR outputs, all of K.
template <int WT, int MR, int NR>
inline void block512(const Args& a, int64_t i0, int64_t n0) {
  __m512 acc[MR][NR];
  const char* wr[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, WT, n0 + j);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* xr = a.x + i0 * a.kp;
  const int64_t kf = a.k & ~(kLanes - 1);
  for (int64_t k = 0; k < kf; k += kLanes) {
    __m512 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = w512<WT>(wr[j], k);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m512 xv = _mm512_loadu_ps(xr + r * a.kp + k);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (kf < a.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (a.k - kf)) - 1);
    __m512 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = w512_tail<WT>(wr[j], kf, mask);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m512 xv = _mm512_loadu_ps(xr + r * a.kp + kf);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      float s = tree512(acc[r][j]);
      if (a.bias) s = s + a.bias[n0 + j];
      a.y[(i0 + r) * a.n + n0 + j] = s;
    }
}

// All rows for outputs n0..n0+NR: rows four at a time, then the 1-3 left.
template <int WT, int NR>
inline void rows512(const Args& a, int64_t n0) {
  int64_t i = 0;
  for (; i + 4 <= a.m; i += 4) block512<WT, 4, NR>(a, i, n0);
  switch (a.m - i) {
    case 3: block512<WT, 3, NR>(a, i, n0); break;
    case 2: block512<WT, 2, NR>(a, i, n0); break;
    case 1: block512<WT, 1, NR>(a, i, n0); break;
    default: break;
  }
}

template <int WT>
void range512(const Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (a.m <= 2) {
    for (; n + 8 <= n1; n += 8) rows512<WT, 8>(a, n);
  }
  for (; n + 4 <= n1; n += 4) rows512<WT, 4>(a, n);
  for (; n < n1; ++n) rows512<WT, 1>(a, n);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline __m256 bf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int WT>
inline V16 w256(const char* p, int64_t k) {
  if constexpr (WT == kF32) {
    const float* f = reinterpret_cast<const float*>(p) + k;
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + k);
    __m128i h0 = _mm_loadu_si128(q), h1 = _mm_loadu_si128(q + 1);
    if constexpr (WT == kF16) return {_mm256_cvtph_ps(h0), _mm256_cvtph_ps(h1)};
    return {bf16x8(h0), bf16x8(h1)};
  }
}

template <int WT>
inline V16 w256_tail(const char* p, int64_t k, int64_t left) {
  alignas(32) uint32_t buf[kLanes] = {0};  // big enough for 16 floats or 16 halves
  std::memcpy(buf, p + k * (WT == kF32 ? 4 : 2), left * (WT == kF32 ? 4 : 2));
  return w256<WT>(reinterpret_cast<const char*>(buf), 0);
}

inline float tree256(V16 v) {
  __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <int WT, int MR, int NR>
inline void block256(const Args& a, int64_t i0, int64_t n0) {
  V16 acc[MR][NR];
  const char* wr[NR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, WT, n0 + j);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[r][j] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const float* xr = a.x + i0 * a.kp;
  const int64_t kf = a.k & ~(kLanes - 1);
  for (int64_t k = 0; k < a.kp; k += kLanes) {
    V16 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wv[j] = k < kf ? w256<WT>(wr[j], k) : w256_tail<WT>(wr[j], k, a.k - k);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256 x0 = _mm256_loadu_ps(xr + r * a.kp + k), x1 = _mm256_loadu_ps(xr + r * a.kp + k + 8);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        acc[r][j].lo = _mm256_fmadd_ps(x0, wv[j].lo, acc[r][j].lo);
        acc[r][j].hi = _mm256_fmadd_ps(x1, wv[j].hi, acc[r][j].hi);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float s = tree256(acc[r][j]);
      if (a.bias) s = s + a.bias[n0 + j];
      a.y[(i0 + r) * a.n + n0 + j] = s;
    }
}

template <int WT>
void range256(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const bool two = n + 2 <= n1;
    int64_t i = 0;
    for (; i + 2 <= a.m; i += 2) {
      if (two) block256<WT, 2, 2>(a, i, n); else block256<WT, 2, 1>(a, i, n);
    }
    if (i < a.m) {
      if (two) block256<WT, 1, 2>(a, i, n); else block256<WT, 1, 1>(a, i, n);
    }
    n += two ? 1 : 0;
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
int detect_isa() {
  unsigned eax, ebx, ecx, edx;
  bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  __builtin_cpu_init();
  if (f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return kAvx512;
  if (f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kScalar;
}

int best_isa() {
  static const int isa = detect_isa();
  return isa;
}

void run_range(const Args& a, int isa, int wt, int64_t n0, int64_t n1) {
  if (isa == kAvx512) {
    if (wt == kF32) range512<kF32>(a, n0, n1);
    else if (wt == kF16) range512<kF16>(a, n0, n1);
    else range512<kBF16>(a, n0, n1);
  } else if (isa == kAvx2) {
    if (wt == kF32) range256<kF32>(a, n0, n1);
    else if (wt == kF16) range256<kF16>(a, n0, n1);
    else range256<kBF16>(a, n0, n1);
  } else {
    scalar_range(a, wt, n0, n1);
  }
}

// Outputs a thread takes at a time: blocks of 8 (whole register blocks, so a thread's range
// never splits one) holding at least ~32 KiB of weights, so tiny layers stay on one thread.
int64_t grain_blocks(int64_t k, int64_t es) {
  const int64_t block_bytes = 8 * k * es;
  return std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(block_bytes, 1));
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                     int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cpu kernel: tensors must be on CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32,
              "cpu kernel: x must be 2-d float32, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.stride(1) == 1,
              "cpu kernel: weight must be [N, K] with K=", x.size(1), " contiguous in K, got ",
              w.sizes(), " strides ", w.strides());
  int wt;
  switch (w.scalar_type()) {
    case torch::kFloat32: wt = kF32; break;
    case torch::kFloat16: wt = kF16; break;
    case torch::kBFloat16: wt = kBF16; break;
    default: TORCH_CHECK(false, "cpu kernel: weight dtype ", w.scalar_type(), " not supported");
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == n, "cpu kernel: bias has ", b.numel(), " elements, want ", n);
  }
  const int64_t kp = (k + kLanes - 1) / kLanes * kLanes;
  torch::Tensor xp = torch::zeros({m, kp}, x.options());
  xp.narrow(1, 0, k).copy_(x);
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  Args a{xp.data_ptr<float>(), kp, w.data_ptr(), w.stride(0), k, y.data_ptr<float>(), n, m,
         b.defined() ? b.data_ptr<float>() : nullptr};
  const int64_t blocks = (n + 7) / 8;
  at::parallel_for(0, blocks, grain_blocks(k, wt == kF32 ? 4 : 2), [&](int64_t b0, int64_t b1) {
    run_range(a, static_cast<int>(isa), wt, b0 * 8, std::min(b1 * 8, n));
  });
  return y;
}

std::string isa_name() {
  const int isa = best_isa();
  return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T (+ bias), fixed accumulation order (see gemv.cpp)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("isa") = -1);
  m.def("isa", &isa_name, "the instruction set `linear` uses on this CPU");
}
