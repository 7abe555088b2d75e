// The AVX2 + FMA kernels of gemv_kernels.h (CPUs without AVX-512): each 16-lane accumulator
// is two ymm registers (lanes 0-7, 8-15), so the sums are those of the AVX-512 and plain paths.
// Included by gemv_kernels.h after its common part (Args, loads, prefetch distance).
#pragma once

namespace baton_gemv {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// gemv_kernels.h's i8g_bytes.
inline __m128i i8g_bytes256(const char* p, int64_t k) {
  const char* b = p + (k & ~int64_t{127}) + ((k & 127) >> 1);
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 64));
  return _mm_xor_si128(_mm_unpacklo_epi32(lo, hi), _mm_set1_epi8(static_cast<char>(0x80)));
}

struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline __m256 bf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline V16 scaled8(__m256i lo, __m256i hi, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  return {_mm256_mul_ps(_mm256_cvtepi32_ps(lo), sv), _mm256_mul_ps(_mm256_cvtepi32_ps(hi), sv)};
}

template <int WT>
inline V16 w256(const char* p, int64_t k) {
  if constexpr (WT == kF32) {
    const float* f = reinterpret_cast<const float*>(p) + k;
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  } else if constexpr (WT == kI8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k));
    return scaled8(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)),
                   i8_scale(p));
  } else if constexpr (WT == kI8G) {  // 16 columns within one group of 32
    const __m128i b = i8g_bytes256(p, k);
    return scaled8(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)),
                   _cvtsh_ss(i8g_scale_bits(p, k)));
  } else if constexpr (WT == kF8) {  // gemv_kernels.h's e4m3_512_lo, 8 lanes at a time
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k));
    const __m256 s = _mm256_set1_ps(f8_scale(p, k) * 256.f);
    const auto half = [](__m128i bytes) {
      const __m128i h = _mm_cvtepu8_epi16(bytes);
      const __m128i mag = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7);
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
      return _mm256_cvtph_ps(_mm_or_si128(mag, sign));
    };
    return {_mm256_mul_ps(half(b), s), _mm256_mul_ps(half(_mm_srli_si128(b, 8)), s)};
  } else if constexpr (WT == kE2M1) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + k / 2));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i u = _mm_unpacklo_epi8(_mm_and_si128(b, m),
                                        _mm_and_si128(_mm_srli_epi16(b, 4), m));
    const __m256 mags = _mm256_loadu_ps(kE2M1Values);  // codes 0-7; bit 3 the sign
    const float s = e2m1_group_scale(p, k), t = i8_scale(p);
    const auto lanes = [&](__m128i c) {
      const __m256i idx = _mm256_cvtepu8_epi32(c);
      const __m256 v = _mm256_permutevar8x32_ps(mags, idx);  // uses idx & 7
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
      const __m256 sv = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), sign));
      return _mm256_mul_ps(_mm256_mul_ps(sv, _mm256_set1_ps(s)), _mm256_set1_ps(t));
    };
    return {lanes(u), lanes(_mm_srli_si128(u, 8))};
  } else if constexpr (WT == kI4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + k / 2));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i u = _mm_unpacklo_epi8(_mm_and_si128(b, m),
                                        _mm_and_si128(_mm_srli_epi16(b, 4), m));
    const __m256i eight = _mm256_set1_epi32(8);
    return scaled8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(u), eight),
                   _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8)), eight),
                   _cvtsh_ss(i4_scale_bits(p, k)));
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + k);
    __m128i h0 = _mm_loadu_si128(q), h1 = _mm_loadu_si128(q + 1);
    if constexpr (WT == kF16) return {_mm256_cvtph_ps(h0), _mm256_cvtph_ps(h1)};
    return {bf16x8(h0), bf16x8(h1)};
  }
}

template <int WT>
inline V16 w256_tail(const char* p, int64_t k, int64_t left) {
  if constexpr (WT == kI4 || WT == kE2M1) {
    return w256<WT>(p, k);  // K % 32 (16) == 0: never a partial chunk
  } else if constexpr (WT == kI8) {
    alignas(32) int8_t buf[4 + kLanes] = {0};  // the row's scale, then its last weights
    std::memcpy(buf, p - 4, 4);
    std::memcpy(buf + 4, p + k, left);
    return w256<WT>(reinterpret_cast<const char*>(buf) + 4, 0);
  } else if constexpr (WT == kI8G) {
    alignas(16) int8_t buf[kLanes] = {0};  // the last weights; the group's scale read here
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), i8g_bytes256(p, k));
    std::memset(buf + left, 0, kLanes - left);
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    return scaled8(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)),
                   _cvtsh_ss(i8g_scale_bits(p, k)));
  } else if constexpr (WT == kF8) {
    alignas(32) uint8_t buf[4 + kLanes] = {0};  // the chunk's group scale, then its weights
    const float s = f8_scale(p, k);
    std::memcpy(buf, &s, 4);
    std::memcpy(buf + 4, p + k, left);
    return w256<WT>(reinterpret_cast<const char*>(buf) + 4, 0);
  } else {
    alignas(32) uint32_t buf[kLanes] = {0};  // big enough for 16 floats or 16 halves
    std::memcpy(buf, p + k * wsize(WT), left * wsize(WT));
    return w256<WT>(reinterpret_cast<const char*>(buf), 0);
  }
}

inline float tree256(V16 v) {
  __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Outputs n0 + j * rs, j < NR (rs = 1: NR consecutive outputs), for rows i0.. of x; weights
// prefetched `ahead` bytes past each row's read (none where PF is false).
template <int WT, int MR, int NR, bool PF = true>
inline void block256(const Args& a, int64_t i0, int64_t n0, int64_t rs = 1,
                     int64_t ahead = MR == 1 && NR == 8 ? kPrefetchOneRow : kPrefetch) {
  V16 acc[MR][NR];
  const char* wr[NR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, WT, n0 + j * rs);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[r][j] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const float* xr = a.x + i0 * a.ldx;
  const int64_t kf = a.k & ~(kLanes - 1);
  for (int64_t k = 0; k < a.k; k += kLanes) {
    V16 wv[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if constexpr (PF) _mm_prefetch(wr[j] + ahead + kbytes<WT>(k), BATON_PF_HINT);
      wv[j] = k < kf ? w256<WT>(wr[j], k) : w256_tail<WT>(wr[j], k, a.k - k);
      asm("" : "+x"(wv[j].lo), "+x"(wv[j].hi));  // loaded once, not refolded for every row
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256 x0 = _mm256_loadu_ps(xr + r * a.ldx + k), x1 = _mm256_loadu_ps(xr + r * a.ldx + k + 8);
      asm("" : "+x"(x0), "+x"(x1));
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
      if (a.bias) s = s + a.bias[n0 + j * rs];
      a.y[(i0 + r) * a.n + n0 + j * rs] = s;
    }
}

// One row of x, half weights, one output at a time: the weights are read as one stream in
// address order, two 16-lane steps (one 64-byte line of halves) an iteration, each line
// prefetched into L1 1 KiB ahead. On the Zen 2 EPYC (AVX2) the 8-output blocks read half
// weights of short rows at 10 GB/s (K = 640, 768: eight streams 1.5 KiB apart) and of 4 KiB
// rows at 12, where this reads 14 at every K (a plain read, 14-15); at 1,280-1,536 the blocks
// read 15-17 (`one_stream` picks).
template <int WT>
inline void stream256(const Args& a, int64_t n) {
  static_assert(WT != kF32, "float32 weights take the 8-output blocks (15 GB/s at every K)");
  constexpr int64_t kAhead = 1024;
  const char* wr = wbase(a, WT, n);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const int64_t k2 = a.k & ~(2 * kLanes - 1);
  int64_t k = 0;
  for (; k < k2; k += 2 * kLanes) {
    _mm_prefetch(wr + kAhead + kbytes<WT>(k), _MM_HINT_T0);
    const V16 w = w256<WT>(wr, k), v = w256<WT>(wr, k + kLanes);
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + k), w.lo, lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + k + 8), w.hi, hi);
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + k + kLanes), v.lo, lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + k + kLanes + 8), v.hi, hi);
  }
  for (; k < a.k; k += kLanes) {
    const V16 w = k + kLanes <= a.k ? w256<WT>(wr, k) : w256_tail<WT>(wr, k, a.k - k);
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + k), w.lo, lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + k + 8), w.hi, hi);
  }
  float s = tree256({lo, hi});
  if (a.bias) s = s + a.bias[n];
  a.y[n] = s;
}

// Whether one row of half weights with K columns takes `stream256`: rows of up to 1,024
// halves, and rows a multiple of 4 KiB long (the blocks' eight streams then share L1 sets).
inline bool one_stream(int64_t k) { return k <= 1024 || (k * 2) % 4096 == 0; }

// One row: 8 outputs a block (16 accumulators; the compiler keeps some in L1): 8 weight rows
// stream at once, which is what a one-row linear needs to reach the memory's bandwidth (the
// bench NemotronH's linears, f32 at 1 thread: 27.1 ms with 2 outputs a block, 23.3 with 4,
// 21.1 with 8; f16: 15.9, 14.4, 13.9). Two rows: 4 outputs a block (15.6 -> 14.1 ms f16).
// More rows: 2 x 2 blocks (2 x 4 was 15-40% slower at 4-8 rows: x and weights spilled).
// One row of float32 weights over outputs [n0, n1): eight streams, stream j through the range's
// j-th eighth (block b: outputs n0 + b + j * S), each weight row prefetched kStreamAhead bytes
// on in its own stream (the eight together as far ahead as kPrefetchOneRow), the last blocks
// prefetching nothing (past their stream is the next stream's start, read long ago). The
// blocks of 8 consecutive rows walk eight streams one row (K floats) long each before they
// jump: on the Zen 2 EPYC one-row f32 linears read at 1 thread 13.6 GB/s at K = 512, 15.6 at
// 640, 16.9 at 768, 20 at 2,048; this way 18.5, 18.3-19.3, 19.4-20.3, 20-20.7 (2 threads,
// K = 512 / 768: 19.6-20 -> 28-29, 24-30 -> 30-31 GB/s). Half weights keep `stream256` (faster
// for them: 15-18 GB/s, 14-16 this way). Returns the first output it did not compute.
constexpr int64_t kStreamAhead = 16 << 10;

template <int WT>
int64_t strided256(const Args& a, int64_t n0, int64_t n1) {
  const int64_t S = (n1 - n0) / 8, row_bytes = a.ldw * wsize(WT);
  const int64_t stop = S - (kStreamAhead + row_bytes - 1) / row_bytes;
  int64_t b = 0;
  for (; b < stop; ++b) block256<WT, 1, 8>(a, 0, n0 + b, S, kStreamAhead);
  for (; b < S; ++b) block256<WT, 1, 8, false>(a, 0, n0 + b, S, kStreamAhead);
  return n0 + 8 * S;
}

template <int WT>
void range256(const Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (a.m <= 2) {
    if constexpr (WT != kF32) {
      if (a.m == 1 && one_stream(a.k)) {
        for (; n < n1; ++n) stream256<WT>(a, n);
        return;
      }
    }
    if (WT == kF32 && a.m == 1 && n1 - n0 >= 16) n = strided256<WT>(a, n0, n1);
    if (a.m == 1) {
      for (; n + 8 <= n1; n += 8) block256<WT, 1, 8>(a, 0, n);
    } else {
      for (; n + 4 <= n1; n += 4) block256<WT, 2, 4>(a, 0, n);
    }
    for (; n < n1; ++n) {
      if (a.m == 2) block256<WT, 2, 1>(a, 0, n); else block256<WT, 1, 1>(a, 0, n);
    }
    return;
  }
  for (; n < n1; ++n) {
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

// gemv_kernels.h's dequant512 on AVX2.
template <int WT>
void dequant256(const Args& a, int64_t n, int64_t nt, float* out, int64_t ldb) {
  for (int64_t r = 0; r < nt; ++r) {
    const char* wr = wbase(a, WT, n + r);
    float* o = out + r * ldb;
    for (int64_t k = 0; k < a.k; k += kLanes) {
      const V16 v = k + kLanes <= a.k ? w256<WT>(wr, k) : w256_tail<WT>(wr, k, a.k - k);
      _mm256_storeu_ps(o + k, v.lo);
      _mm256_storeu_ps(o + k + 8, v.hi);
    }
  }
}

#pragma GCC pop_options

}  // namespace baton_gemv
