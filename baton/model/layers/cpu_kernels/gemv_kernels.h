// The kernels of gemv.cpp without torch: y[M,N] = x[M,K] @ W[N,K]^T (+ bias) for a range of
// outputs, one function per instruction set, chosen at run time (see gemv.cpp for the contract).
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace baton_gemv {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
enum Wt : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3, kI4 = 4, kF8 = 5, kE2M1 = 6, kI8G = 7 };
constexpr int64_t kLanes = 16;
// Quantized weights (baton/model/quant/packed.py lays them out), read as stored and each
// weight dequantized in registers exactly as the loader's float32 reference rounds it
// (w = float(q) * scale, one rounding), so every output is the float kernel's on the
// dequantized weights, bit for bit:
//   kI8  int8 [N, K], one float32 scale a row in the 4 bytes before the row's first weight;
//   kI8G int8 [N, K] stored as bytes q + 128 (q ^ 0x80: the integer path's unsigned operand),
//        each 128 columns in its lane order (`i8g_at`: byte 4 L + b column 8 L + b, byte
//        64 + 4 L + b column 8 L + 4 + b; rows padded with q = 0 to whole 128s), one float16
//        scale per 32 columns (llama.cpp's Q8_0 blocks; the last partial where
//        K % 32), group g's at 4 + 2 (g + 1) bytes before the row, the 4 bytes before the row
//        0xFF (the tag `weight_type` reads: an int8 row's float32 scale never has that top
//        byte);
//   kI4  two int4 a byte (column 2j in the low nibble, 2j + 1 in the high; stored + 8), one
//        float16 scale per 32 columns, group g's at 2 (g + 1) bytes before the row (K % 32 == 0);
//   kF8  float8 e4m3 [N, K], one float32 scale per 128 columns, group g's at 4 (g + 1) bytes
//        before the row (Qwen's 128 x 128 tiles, or a per-channel / per-tensor scale repeated);
//        fp32(q) is exact (in registers through a half, `e4m3_512_lo`; the plain path through
//        a table; 0x7F / 0xFF, e4m3's NaN, read as 480: no checkpoint stores it).
//   kE2M1 NVFP4: two e2m1 codes a byte (column 2j low nibble), an e4m3 scale per 16 columns
//        (group g's byte 4 + g + 1 bytes before the row) and the tensor's float32 scale in the 4
//        bytes before the row; w = (e2m1 * e4m3) * s2, the first product exact (K % 16 == 0).
constexpr int64_t kI4Group = 32;
constexpr int64_t kI8Group = 32;
constexpr int64_t kF8Group = 128;
constexpr int64_t kE2M1Group = 16;
constexpr float kE2M1Values[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                   -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
// Bytes of a weight element in a row's address arithmetic (kI4: the view's unit, 1 byte;
// its K values take K / 2).
inline constexpr int64_t wsize(int wt) { return wt == kF32 ? 4 : wt <= kBF16 ? 2 : 1; }
// Bytes from a row's start to its column k.
template <int WT>
inline constexpr int64_t kbytes(int64_t k) {
  return WT == kI4 || WT == kE2M1 ? k / 2 : k * wsize(WT);
}
inline float i8_scale(const char* row) {
  float s;
  std::memcpy(&s, row - 4, 4);
  return s;
}
inline float f8_scale(const char* row, int64_t k) {
  float s;
  std::memcpy(&s, row - 4 * (k / kF8Group + 1), 4);
  return s;
}
// e4m3 -> float, exact (see kF8 above), through a table made once.
inline float e4m3_exact(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                         : std::ldexp(static_cast<float>(8 + m), e - 10);
  return b & 0x80 ? -v : v;
}
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) v[b] = e4m3_exact(static_cast<uint8_t>(b));
  }
};
inline float e4m3_float(uint8_t b) {
  static const E4m3Table table;
  return table.v[b];
}
// NVFP4 group scale (e4m3, exact) and tensor scale of a row.
inline float e2m1_group_scale(const char* row, int64_t k) {
  return e4m3_float(static_cast<uint8_t>(row[-4 - (k / kE2M1Group + 1)]));
}
inline uint16_t i8g_scale_bits(const char* row, int64_t k) {
  uint16_t h;
  std::memcpy(&h, row - 4 - 2 * (k / kI8Group + 1), 2);
  return h;
}
// Byte of column k of a kI8G row.
inline int64_t i8g_at(int64_t k) {
  return (k & ~int64_t{127}) + 64 * ((k >> 2) & 1) + 4 * ((k >> 3) & 15) + (k & 3);
}
// Whether a packed int8 weight's rows are in the kI8G layout (the tag before the first row).
inline bool i8_grouped(const char* row) { return static_cast<uint8_t>(row[-1]) == 0xFF; }
inline uint16_t i4_scale_bits(const char* row, int64_t k) {
  uint16_t h;
  std::memcpy(&h, row - 2 * (k / kI4Group + 1), 2);
  return h;
}
// Weights are prefetched this many bytes ahead of their use into L2 (_MM_HINT_T1): without it
// the few-row blocks stalled on memory (8 rows: 50 -> 26 ms for the bench NemotronH's linears,
// one row 20 -> 16 ms); 16-96 KiB measured the same, L1 prefetch was slower.
constexpr int64_t kPrefetch = 32 << 10;
// The AVX2 one-row blocks (8 weight rows at once) prefetch further: on the Zen 2 EPYC, one-row
// linears over 450 MB of Qwen3.5-MoE-shaped weights at 1 thread read 15.8 GB/s at 32 KiB and
// 16.3 at 128 or 256 KiB (25 alternating passes; 512 KiB 14.4, 8 KiB 13.4); at 2 threads and
// at 8 rows the same, at 32 rows 1% slower (so only there).
constexpr int64_t kPrefetchOneRow = 128 << 10;
#define BATON_PF_HINT _MM_HINT_T1

struct QRows;  // gemv_int.h

struct Args {
  const float* x;     // [M, >= K rounded up to 16] with row stride ldx, zeros past K
  int64_t ldx;
  const void* w;      // [N, K] with row stride ldw (elements)
  int64_t ldw;
  int64_t k;
  float* y;           // [M, N], row stride n
  int64_t n;
  int64_t m;
  const float* bias;  // [N] or null
  const QRows* q = nullptr;  // x's rows quantized (gemv_int.h), rows [q0, q0 + m); or null
  int64_t q0 = 0;
};

inline const char* wbase(const Args& a, int wt, int64_t row) {
  return static_cast<const char*>(a.w) + row * a.ldw * wsize(wt);
}

// ---------------------------------------------------------------------------------------------
// Plain C++ (any x86-64): the reference order, std::fma one element at a time.
inline uint32_t half_bits(uint16_t h) {  // IEEE half -> float bits, exact
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return sign | 0x7f800000 | (man << 13);
  if (exp == 0) {
    if (man == 0) return sign;
    exp = 127 - 15 + 1;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    return sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  return sign | ((exp + 127 - 15) << 23) | (man << 13);
}

inline float half_float(uint16_t h) {
  const uint32_t u = half_bits(h);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float upcast(const char* p, int wt, int64_t k) {
  if (wt == kF32) return reinterpret_cast<const float*>(p)[k];
  if (wt == kI8) return static_cast<float>(reinterpret_cast<const int8_t*>(p)[k]) * i8_scale(p);
  if (wt == kI8G)
    return static_cast<float>(static_cast<int>(reinterpret_cast<const uint8_t*>(p)[i8g_at(k)]) - 128) *
           half_float(i8g_scale_bits(p, k));
  if (wt == kF8) return e4m3_float(reinterpret_cast<const uint8_t*>(p)[k]) * f8_scale(p, k);
  if (wt == kE2M1) {
    const uint8_t b = reinterpret_cast<const uint8_t*>(p)[k / 2];
    return kE2M1Values[k & 1 ? b >> 4 : b & 0xF] * e2m1_group_scale(p, k) * i8_scale(p);
  }
  if (wt == kI4) {
    const uint8_t b = reinterpret_cast<const uint8_t*>(p)[k / 2];
    const int q = (k & 1 ? b >> 4 : b & 0xF) - 8;
    return static_cast<float>(q) * half_float(i4_scale_bits(p, k));
  }
  uint16_t h = reinterpret_cast<const uint16_t*>(p)[k];
  uint32_t u = wt == kF16 ? half_bits(h) : static_cast<uint32_t>(h) << 16;
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
      const float* xr = a.x + i * a.ldx;
      float acc[kLanes] = {0.f};
      for (int64_t k0 = 0; k0 < a.k; k0 += kLanes)
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

// The 16 int4 of a row from column k (a multiple of 16) as 16 bytes q + 8, in column order:
// the 8 packed bytes' nibbles, low then high of each.
inline __m128i i4_bytes(const char* p, int64_t k) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + k / 2));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
}

// The 16 int8 of a kI8G row from column k (a multiple of 16) in column order: two 8-byte
// halves of its 128-column block interleaved by 4 (the row is padded to whole blocks).
inline __m128i i8g_bytes(const char* p, int64_t k) {
  const char* b = p + (k & ~int64_t{127}) + ((k & 127) >> 1);
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 64));
  return _mm_xor_si128(_mm_unpacklo_epi32(lo, hi), _mm_set1_epi8(static_cast<char>(0x80)));
}

// 16 e4m3 bytes -> their values times 2^-8, exact: each byte's magnitude shifted into a
// half's exponent and mantissa (e4m3's bias 7 read as the half's 15), the half converted in
// hardware (its subnormals exactly); the caller multiplies by scale * 2^8 (exact), so the
// product rounds as fp32(q) * scale does.
inline __m512 e4m3_512_lo(__m128i b) {
  const __m256i h = _mm256_cvtepu8_epi16(b);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
  return _mm512_cvtph_ps(_mm256_or_si256(mag, sign));
}

template <int WT>
inline __m512 w512(const char* p, int64_t k) {
  if constexpr (WT == kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + k);
  } else if constexpr (WT == kI8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(i8_scale(p)));
  } else if constexpr (WT == kI8G) {  // 16 columns within one group of 32
    const __m128i b = i8g_bytes(p, k);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)),
                         _mm512_set1_ps(_cvtsh_ss(i8g_scale_bits(p, k))));
  } else if constexpr (WT == kF8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k));
    return _mm512_mul_ps(e4m3_512_lo(b), _mm512_set1_ps(f8_scale(p, k) * 256.f));
  } else if constexpr (WT == kE2M1) {
    const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(i4_bytes(p, k)),
                                           _mm512_loadu_ps(kE2M1Values));
    return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(e2m1_group_scale(p, k))),
                         _mm512_set1_ps(i8_scale(p)));
  } else if constexpr (WT == kI4) {
    const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(i4_bytes(p, k)), _mm512_set1_epi32(8));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q),
                         _mm512_set1_ps(_cvtsh_ss(i4_scale_bits(p, k))));
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
  } else if constexpr (WT == kI8) {
    const __m128i b = _mm_maskz_loadu_epi8(mask, p + k);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(i8_scale(p)));
  } else if constexpr (WT == kI8G) {  // zeros past K (the row's padding is q = 0 too)
    const __m128i b = _mm_maskz_mov_epi8(mask, i8g_bytes(p, k));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)),
                         _mm512_set1_ps(_cvtsh_ss(i8g_scale_bits(p, k))));
  } else if constexpr (WT == kF8) {
    const __m128i b = _mm_maskz_loadu_epi8(mask, p + k);
    return _mm512_mul_ps(e4m3_512_lo(b), _mm512_set1_ps(f8_scale(p, k) * 256.f));
  } else if constexpr (WT == kI4 || WT == kE2M1) {
    return w512<WT>(p, k);  // K % 32 (16) == 0: never a partial chunk
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
  const float* xr = a.x + i0 * a.ldx;
  const int64_t kf = a.k & ~(kLanes - 1);
  for (int64_t k = 0; k < kf; k += kLanes) {
    __m512 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(wr[j] + kPrefetch + kbytes<WT>(k), BATON_PF_HINT);
      wv[j] = w512<WT>(wr[j], k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m512 xv = _mm512_loadu_ps(xr + r * a.ldx + k);
      asm("" : "+v"(xv));  // one load of x a row, kept in a register (not refolded per FMA)
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
      __m512 xv = _mm512_loadu_ps(xr + r * a.ldx + kf);
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

// Rows i..i+mr (mr <= MAXMR) for outputs n0..n0+NR.
template <int WT, int NR, int MAXMR>
inline void rows512(const Args& a, int64_t i, int64_t n0, int64_t mr) {
  if constexpr (MAXMR > 1) {
    if (mr < MAXMR) return rows512<WT, NR, MAXMR - 1>(a, i, n0, mr);
  }
  block512<WT, MAXMR, NR>(a, i, n0);
}

// Outputs n0..n1, NR at a time (MR * NR <= 16 accumulators), each block of NR weight rows
// for all rows of x before the next: the weights stream from memory once, x is re-read from
// cache. Rows go in near-equal blocks of at most 8.
template <int WT, int NR, int MAXMR>
inline void outs512(const Args& a, int64_t n0, int64_t n1, int64_t rb) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    for (int64_t i = 0; i < a.m; i += rb) rows512<WT, NR, MAXMR>(a, i, n, std::min(rb, a.m - i));
  for (; n < n1; ++n)
    for (int64_t i = 0; i < a.m; i += rb) rows512<WT, 1, MAXMR>(a, i, n, std::min(rb, a.m - i));
}

// One row of x, half weights, one output at a time: the weights read as one stream in address
// order, two 16-lane steps (one 64-byte line of halves) an iteration, each line prefetched
// into L1 1 KiB ahead (gemv_avx2.h's stream256 in 16 lanes). On a Zen 4 EPYC (AVX-512), the
// bench NemotronH's 57 linears in f16 at one row, 25 passes alternating, median of the pair
// ratios to the 8-output blocks: 0.86-0.91 at 1 thread (7.6 against 8.9 ms), 0.90-0.92 at 2
// (stream256 on the same CPU: 0.94-0.98); bf16 alike. float32 weights keep the blocks (one
// stream read them at 1.03x the blocks' time), and two outputs a stream at once (two FMA
// chains) took 1.4-1.8x.
template <int WT>
inline void stream512(const Args& a, int64_t n) {
  static_assert(WT != kF32, "float32 weights take the 8-output blocks");
  constexpr int64_t kAhead = 1024;
  const char* wr = wbase(a, WT, n);
  __m512 acc = _mm512_setzero_ps();
  const int64_t k2 = a.k & ~(2 * kLanes - 1), kf = a.k & ~(kLanes - 1);
  int64_t k = 0;
  for (; k < k2; k += 2 * kLanes) {
    _mm_prefetch(wr + kAhead + kbytes<WT>(k), _MM_HINT_T0);
    const __m512 w = w512<WT>(wr, k), v = w512<WT>(wr, k + kLanes);
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + k), w, acc);
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + k + kLanes), v, acc);
  }
  for (; k < kf; k += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + k), w512<WT>(wr, k), acc);
  if (kf < a.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (a.k - kf)) - 1);
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + kf), w512_tail<WT>(wr, kf, mask), acc);
  }
  float s = tree512(acc);
  if (a.bias) s = s + a.bias[n];
  a.y[n] = s;
}

// Rows in near-equal blocks of at most 6 (4 outputs a block: 24 accumulators, 4 weight and one
// x register; 8 x 2 blocks were 20-30% slower at 8-32 rows, x re-read for every 2 outputs).
template <int WT>
void range512(const Args& a, int64_t n0, int64_t n1) {
  if constexpr (WT != kF32) {
    if (a.m == 1) {
      for (int64_t n = n0; n < n1; ++n) stream512<WT>(a, n);
      return;
    }
  }
  const int64_t blocks = (a.m + 5) / 6, rb = (a.m + blocks - 1) / blocks;
  if (rb <= 2) outs512<WT, 8, 2>(a, n0, n1, rb);
  else if (rb <= 6) outs512<WT, 4, 6>(a, n0, n1, rb);
  else outs512<WT, 2, 8>(a, n0, n1, rb);
}

// Quantized rows n..n+nt decoded into float32 rows of `out` (row stride ldb >= K rounded up to
// 16, zeros past K): the values the loads above give, for `tiled` (many rows of x).
template <int WT>
void dequant512(const Args& a, int64_t n, int64_t nt, float* out, int64_t ldb) {
  const int64_t kf = a.k & ~(kLanes - 1);
  for (int64_t r = 0; r < nt; ++r) {
    const char* wr = wbase(a, WT, n + r);
    float* o = out + r * ldb;
    for (int64_t k = 0; k < kf; k += kLanes) _mm512_storeu_ps(o + k, w512<WT>(wr, k));
    if (kf < a.k)
      _mm512_storeu_ps(o + kf, w512_tail<WT>(wr, kf, static_cast<__mmask16>((1u << (a.k - kf)) - 1)));
  }
}

#pragma GCC pop_options

}  // namespace baton_gemv

#include "gemv_avx2.h"
#include "gemv_int.h"

namespace baton_gemv {

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

// Quantized weights times many rows of x (kTiledFrom and up): each block of kTileRows outputs
// decoded once into a float32 tile in cache, then the float kernel over it for every row, so
// the decoding is paid once per weight, not once per block of rows (at 32 rows fp8 weights
// ran at 0.5x float32's speed decoded in the blocks' loads). The decoded values are the
// loads' own, so every output keeps its bits.
constexpr int64_t kTileRows = 16, kTiledFrom = 4;

template <int WT>
void dequant_rows(const Args& a, int isa, int64_t n, int64_t nt, float* out, int64_t ldb) {
  if (isa == kAvx512) return dequant512<WT>(a, n, nt, out, ldb);
  if (isa == kAvx2) return dequant256<WT>(a, n, nt, out, ldb);
  for (int64_t r = 0; r < nt; ++r) {
    const char* wr = wbase(a, WT, n + r);
    for (int64_t k = 0; k < ldb; ++k) out[r * ldb + k] = k < a.k ? upcast(wr, WT, k) : 0.f;
  }
}

template <int WT>
void tiled(const Args& a, int isa, int64_t n0, int64_t n1) {
  const int64_t ldb = (a.k + kLanes - 1) / kLanes * kLanes;
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < kTileRows * ldb) buf.resize(kTileRows * ldb);
  for (int64_t n = n0; n < n1; n += kTileRows) {
    const int64_t nt = std::min(kTileRows, n1 - n);
    dequant_rows<WT>(a, isa, n, nt, buf.data(), ldb);
    Args b = a;
    b.w = buf.data(), b.ldw = ldb, b.y = a.y + n, b.bias = a.bias ? a.bias + n : nullptr;
    if (isa == kAvx512) range512<kF32>(b, 0, nt);
    else if (isa == kAvx2) range256<kF32>(b, 0, nt);
    else scalar_range(b, kF32, 0, nt);
  }
}

void run_range(const Args& a, int isa, int wt, int64_t n0, int64_t n1) {
  if ((wt == kI8 || wt == kI8G || wt == kI4) && n0 < n1 &&
      int_marked(wbase(a, wt, n0), wt, a.k)) {
    if (wt == kI8) int_range<kI8>(a, isa, n0, n1);
    else if (wt == kI8G) int_range<kI8G>(a, isa, n0, n1);
    else int_range<kI4>(a, isa, n0, n1);
    return;
  }
  if (wt >= kI8 && a.m >= kTiledFrom) {
    if (wt == kI8) tiled<kI8>(a, isa, n0, n1);
    else if (wt == kI8G) tiled<kI8G>(a, isa, n0, n1);
    else if (wt == kF8) tiled<kF8>(a, isa, n0, n1);
    else if (wt == kE2M1) tiled<kE2M1>(a, isa, n0, n1);
    else tiled<kI4>(a, isa, n0, n1);
    return;
  }
  if (isa == kAvx512) {
    if (wt == kF32) range512<kF32>(a, n0, n1);
    else if (wt == kF16) range512<kF16>(a, n0, n1);
    else if (wt == kBF16) range512<kBF16>(a, n0, n1);
    else if (wt == kI8) range512<kI8>(a, n0, n1);
    else if (wt == kI8G) range512<kI8G>(a, n0, n1);
    else if (wt == kF8) range512<kF8>(a, n0, n1);
    else if (wt == kE2M1) range512<kE2M1>(a, n0, n1);
    else range512<kI4>(a, n0, n1);
  } else if (isa == kAvx2) {
    if (wt == kF32) range256<kF32>(a, n0, n1);
    else if (wt == kF16) range256<kF16>(a, n0, n1);
    else if (wt == kBF16) range256<kBF16>(a, n0, n1);
    else if (wt == kI8) range256<kI8>(a, n0, n1);
    else if (wt == kI8G) range256<kI8G>(a, n0, n1);
    else if (wt == kF8) range256<kF8>(a, n0, n1);
    else if (wt == kE2M1) range256<kE2M1>(a, n0, n1);
    else range256<kI4>(a, n0, n1);
  } else {
    scalar_range(a, wt, n0, n1);
  }
}

}  // namespace baton_gemv
