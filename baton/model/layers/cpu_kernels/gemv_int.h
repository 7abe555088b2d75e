// The opt-in integer path of packed int8 / int4 weights (`model.quantize_activations: int8`,
// a weight marked by packed.mark_int_path: the first byte of each row's prefix is 1):
// each row of x quantized to int8 per group of 32 columns (llama.cpp's Q8_0 blocks), the
// weights dotted in integers (AVX-512 VNNI vpdpbusd; AVX2 vpmaddubsw + vpmaddwd; plain C++),
// then one fixed float order. Included by gemv_kernels.h after Args and the float kernels.
//
// Contract (every instruction set, batch size, row block and thread count gives these bits):
// (int4 and kI8G weights, the int8 per 32 columns, take the same lanes)
//   Activations, per row and group g of 32 columns (the last group padded with zeros):
//     amax = max |x|, d_g = amax / 127, q = nearbyint(x * (d_g ? 1 / d_g : 0)) in [-127, 127].
//   16 float lanes acc[L], from +0; integer lane sums p (exact; int4 weights as q - 8):
//     int8 weights, chunks of 64 columns c: lane L = 8 (g % 2) + j sums columns
//       32 g + 4 j .. + 3 of group g (g = c / 32 + L / 8); c_g = d_g;
//     int4 and kI8G weights, chunks of 128 columns c: lane L sums columns c + 8 L .. c + 8 L + 7
//       (group g = c / 32 + L / 4); c_g = d_g * s_g (the group's float16 scale; one rounding);
//       kI8G weights are read as stored (q + 128, in the lane order), the activations' lane
//       sums times 128 taken off;
//   acc[L] = fma(float(p), c_g, acc[L]) over the chunks in order, K rounded up to whole
//   chunks (a group past K has p = 0, c = 0);
//   y = tree16(acc) (gemv.cpp's tree), times the row scale for per-row int8 weights, + bias.
#pragma once


namespace baton_gemv {

constexpr int64_t kQGroup = 32, kQChunk = 64, kQChunk4 = 128;

// Whether a packed int8 / int4 weight row is marked for the integer path (packed.py's
// `mark_int_path`: the first byte of the row's prefix; int8 rows have 16, int4 rows their
// scales rounded up past one more byte to 16).
inline bool int_marked(const char* row, int wt, int64_t k) {
  if (wt == kI8) return row[-16] != 0;
  if (wt == kI8G) return row[-((4 + 2 * ((k + kI8Group - 1) / kI8Group) + 1 + 15) / 16 * 16)] != 0;
  if (wt == kI4) return row[-((2 * (k / kI4Group) + 1 + 15) / 16 * 16)] != 0;
  return false;
}

// Rows of x quantized as the contract says: kp = K rounded up to 128 (the buffers' stride).
struct QRows {
  int64_t m = 0, k = 0, kp = 0;
  std::vector<int8_t> qa;    // [m, kp]
  std::vector<uint8_t> ua;   // [m, kp]: qa + 128 (VNNI's unsigned operand for int8 weights)
  std::vector<float> dx;     // [m, kp / 32]: d_g
  std::vector<float> dxv;    // [m, kp / 64, 16]: int8 lanes: d_g for lanes 0-7, d_{g+1} 8-15
  std::vector<int8_t> qa4;   // [m, kp]: each 128 columns as its 64 even, then 64 odd ones
  std::vector<int32_t> nca4; // [m, kp / 8]: -8 times each int4 lane's sum (weights q + 8)
  std::vector<float> dxv4;   // [m, kp / 8]: int4 / kI8G lanes: d of the lane's group
  std::vector<int8_t> qa8;   // [m, kp]: each 128 columns in kI8G's lane order (i8g_at)
  std::vector<int32_t> nca8; // [m, kp / 8]: -128 times each kI8G lane's sum (weights q + 128)
};

// Which weight types' layouts of the rows a call needs (`int_need`): bit 1 << wt.
inline int int_need_bit(int wt) { return wt == kI8 || wt == kI4 || wt == kI8G ? 1 << wt : 0; }

// One row of x quantized as the contract says (plain C++), into qa / dx and the layouts in
// `need` (bits of int_need_bit; the same values whichever are made).
inline void quantize_row(const float* xr, int64_t i, QRows& q, int need) {
  const int64_t k = q.k, kp = q.kp, groups = kp / kQGroup;
  const bool i8 = need & (1 << kI8), i4 = need & (1 << kI4), i8g = need & (1 << kI8G);
  int8_t* qr = q.qa.data() + i * kp;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * kQGroup, c1 = std::min(k, c0 + kQGroup);
    float amax = 0.f;
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(xr[c]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int64_t c = c0; c < c1; ++c) {
      // round half to even as nearbyint (|x * id| <= 127 + ulps: exact by the 2^23 + 2^22
      // shift in the default rounding mode; inline, where nearbyint was a call a value)
      constexpr float shift = 12582912.f;
      const float v = (xr[c] * id + shift) - shift;
      qr[c] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
    }
    for (int64_t c = std::max(c0, c1); c < c0 + kQGroup; ++c) qr[c] = 0;
    q.dx[i * groups + g] = d;
    if (i8)
      for (int l = 0; l < 8; ++l) q.dxv[i * kp / 4 + (g / 2) * 16 + (g % 2) * 8 + l] = d;
    if (i4 || i8g)
      for (int l = 0; l < 4; ++l) q.dxv4[i * kp / 8 + (g / 4) * 16 + (g % 4) * 4 + l] = d;
  }
  if (i8)
    for (int64_t c = 0; c < kp; ++c) q.ua[i * kp + c] = static_cast<uint8_t>(qr[c] + 128);
  if (i4) {
    int8_t* q4 = q.qa4.data() + i * kp;
    for (int64_t c = 0; c < kp; c += kQChunk4)
      for (int64_t j = 0; j < kQChunk4 / 2; ++j)
        q4[c + j] = qr[c + 2 * j], q4[c + kQChunk4 / 2 + j] = qr[c + 2 * j + 1];
  }
  if (i4 || i8g)
    for (int64_t l = 0; l < kp / 8; ++l) {
      int32_t sum = 0;
      for (int t = 0; t < 8; ++t) sum += qr[8 * l + t];
      if (i4) q.nca4[i * kp / 8 + l] = -8 * sum;
      if (i8g) q.nca8[i * kp / 8 + l] = -128 * sum;
    }
  if (i8g) {  // each 128 columns: the lanes' first 4 columns, then their last 4
    int8_t* q8 = q.qa8.data() + i * kp;
    for (int64_t c = 0; c < kp; c += kQChunk4)
      for (int64_t l = 0; l < 16; ++l) {
        std::memcpy(q8 + c + 4 * l, qr + c + 8 * l, 4);
        std::memcpy(q8 + c + 64 + 4 * l, qr + c + 8 * l + 4, 4);
      }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

// quantize_row in AVX-512, the same bits: max of |x| (a NaN skipped, as std::max skips it),
// d and 1 / d as scalars, x * (1 / d) rounded to nearest even, clamped (a NaN to 127).
inline void quantize_row512(const float* xr, int64_t i, QRows& q, int need) {
  const int64_t k = q.k, kp = q.kp, groups = kp / kQGroup;
  const bool i8 = need & (1 << kI8), i4 = need & (1 << kI4), i8g = need & (1 << kI8G);
  int8_t* qr = q.qa.data() + i * kp;
  const __m512 zero = _mm512_setzero_ps(), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  const __m512i sign = _mm512_set1_epi32(0x7fffffff);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * kQGroup, n = std::max<int64_t>(0, std::min<int64_t>(kQGroup, k - c0));
    const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, xr + c0), v1 = _mm512_maskz_loadu_ps(m1, xr + c0 + 16);
    const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), sign));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), sign));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a1, _mm512_max_ps(a0, zero)));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q0 = _mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(r0, hi), lo));
    const __m512i q1 = _mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(r1, hi), lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + c0), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + c0 + 16), _mm512_cvtepi32_epi8(q1));
    q.dx[i * groups + g] = d;
    if (i8) _mm256_storeu_ps(q.dxv.data() + i * kp / 4 + (g / 2) * 16 + (g % 2) * 8, _mm256_set1_ps(d));
    if (i4 || i8g)
      _mm_storeu_ps(q.dxv4.data() + i * kp / 8 + (g / 4) * 16 + (g % 4) * 4, _mm_set1_ps(d));
  }
  if (!(i8 || i4 || i8g)) return;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), bias = _mm512_set1_epi64(1024);
  const __m512i low = _mm512_set1_epi16(0xFF);
  for (int64_t c = 0; c < kp; c += 64) {
    const __m512i v = _mm512_loadu_si512(qr + c);
    const __m512i u = _mm512_xor_si512(v, flip);  // q + 128
    if (i8) _mm512_storeu_si512(q.ua.data() + i * kp + c, u);
    const int64_t base = c / kQChunk4 * kQChunk4, half = (c % kQChunk4) / 2;
    if (i4 || i8g) {
      // each 8 columns' sum: |u - 0| summed a u64 lane is the sum of q + 1024
      const __m512i sums = _mm512_sub_epi64(_mm512_sad_epu8(u, _mm512_setzero_si512()), bias);
      if (i4)  // -8 x the sum
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.nca4.data() + i * kp / 8 + c / 8),
                            _mm512_cvtepi64_epi32(_mm512_sub_epi64(_mm512_setzero_si512(),
                                                                  _mm512_slli_epi64(sums, 3))));
      if (i8g)  // -128 x the sum
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.nca8.data() + i * kp / 8 + c / 8),
                            _mm512_cvtepi64_epi32(_mm512_sub_epi64(_mm512_setzero_si512(),
                                                                  _mm512_slli_epi64(sums, 7))));
    }
    if (i4) {  // even / odd columns of 64: the low / high byte of each 16-bit pair
      int8_t* q4 = q.qa4.data() + i * kp + base;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q4 + half),
                          _mm512_cvtepi16_epi8(_mm512_and_si512(v, low)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q4 + kQChunk4 / 2 + half),
                          _mm512_cvtepi16_epi8(_mm512_srli_epi16(v, 8)));
    }
    if (i8g) {  // kI8G's lanes (8 columns each): their first 4 columns, then their last 4
      int8_t* q8 = q.qa8.data() + i * kp + base;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8 + half), _mm512_cvtepi64_epi32(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8 + kQChunk4 / 2 + half),
                          _mm512_cvtepi64_epi32(_mm512_srli_epi64(v, 32)));
    }
  }
}

#pragma GCC pop_options

// Rows of x quantized (row i from x + i * ldx; zeros past K) into qa / dx and the layouts in
// `need`: each row on its own, so the rows split over the threads (a prefill's) without
// changing a bit.
inline void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, QRows& q, int need,
                          int isa = kScalar) {
  q.m = m, q.k = k, q.kp = (k + kQChunk4 - 1) / kQChunk4 * kQChunk4;
  const int64_t kp = q.kp, groups = kp / kQGroup;
  const bool i8 = need & (1 << kI8), i4 = need & (1 << kI4), i8g = need & (1 << kI8G);
  q.qa.resize(m * kp), q.dx.resize(m * groups);
  if (i8) q.ua.resize(m * kp), q.dxv.resize(m * kp / 4);
  if (i4) q.qa4.resize(m * kp), q.nca4.resize(m * kp / 8);
  if (i4 || i8g) q.dxv4.resize(m * kp / 8);
  if (i8g) q.qa8.resize(m * kp), q.nca8.resize(m * kp / 8);
  const auto rows = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (isa == kAvx512) quantize_row512(x + i * ldx, i, q, need);
      else quantize_row(x + i * ldx, i, q, need);
    }
  };
  // ~32 K columns a task (tens of microseconds): a decode's few rows stay on this thread
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(kp, 1));
  if (m > grain && !at::in_parallel_region()) at::parallel_for(0, m, grain, rows);
  else rows(0, m);
}

// c_g of a weight row (int4: times its group scale; a group past K: 0).
template <int WT>
inline float int_scale(const char* wr, int64_t k, int64_t g, float d) {
  if (g * kQGroup >= k) return 0.f;
  if constexpr (WT == kI4) return d * half_float(i4_scale_bits(wr, g * kQGroup));
  if constexpr (WT == kI8G) return d * half_float(i8g_scale_bits(wr, g * kQGroup));
  return d;
}

template <int WT>
inline int int_weight(const char* wr, int64_t c) {
  if constexpr (WT == kI8) return reinterpret_cast<const int8_t*>(wr)[c];
  if constexpr (WT == kI8G) return static_cast<int>(reinterpret_cast<const uint8_t*>(wr)[i8g_at(c)]) - 128;
  const uint8_t b = reinterpret_cast<const uint8_t*>(wr)[c / 2];
  return (c & 1 ? b >> 4 : b & 0xF) - 8;
}

template <int WT>
inline float int_finish(const char* wr, float s, const float* bias, int64_t n) {
  if constexpr (WT == kI8) s = s * i8_scale(wr);
  if (bias) s = s + bias[n];
  return s;
}

template <int WT>
void int_scalar(const Args& a, const QRows& q, int64_t q0, int64_t n0, int64_t n1) {
  const int64_t kp = q.kp, groups = kp / kQGroup;
  const int64_t chunk = WT == kI8 ? kQChunk : kQChunk4, kc = (a.k + chunk - 1) / chunk * chunk;
  const int cols = WT == kI8 ? 4 : 8;
  for (int64_t n = n0; n < n1; ++n) {
    const char* wr = wbase(a, WT, n);
    for (int64_t i = 0; i < a.m; ++i) {
      const int8_t* qr = q.qa.data() + (q0 + i) * kp;
      float acc[kLanes] = {0.f};
      for (int64_t c = 0; c < kc; c += chunk)
        for (int l = 0; l < kLanes; ++l) {
          const int64_t g = WT == kI8 ? c / kQGroup + l / 8 : c / kQGroup + l / 4;
          const int64_t col0 = WT == kI8 ? g * kQGroup + 4 * (l % 8) : c + 8 * l;
          int32_t p = 0;
          for (int t = 0; t < cols; ++t)
            if (col0 + t < a.k) p += qr[col0 + t] * int_weight<WT>(wr, col0 + t);
          const float cg = int_scale<WT>(wr, a.k, g, q.dx[(q0 + i) * groups + g]);
          acc[l] = std::fma(static_cast<float>(p), cg, acc[l]);
        }
      a.y[i * a.n + n] = int_finish<WT>(wr, tree16(acc), a.bias, n);
    }
  }
}

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

// 64 int8 weights of a row from column c, as stored; zeros past K.
inline __m512i iw512(const char* wr, int64_t c, int64_t k) {
  if (c + kQChunk <= k) return _mm512_loadu_si512(wr + c);
  return _mm512_maskz_loadu_epi8((~0ull) >> (kQChunk - (k - c)), wr + c);
}

// The 64 bytes of int4 columns c .. c + 127 (zeros past K; K % 32 == 0).
inline __m512i iw4_512(const char* wr, int64_t c, int64_t k) {
  if (c + kQChunk4 <= k) return _mm512_loadu_si512(wr + c / 2);
  return _mm512_maskz_loadu_epi8((~0ull) >> (64 - (k - c) / 2), wr + c / 2);
}

// [c x 4] per group of an int4 chunk: lane L takes group c / 32 + L / 4's float16 scale (0
// past K).
// (kI8G: OFF = 4, its scales 4 bytes further before the row.)
template <int OFF = 0>
inline __m512 iscale4_512(const char* wr, int64_t c, int64_t k) {
  const int64_t g = c / kQGroup;
  uint64_t four = 0;  // [s_{g+3}, s_{g+2}, s_{g+1}, s_g] as stored (group g's 2 (g + 1) before)
  if (c + kQChunk4 <= k) {
    std::memcpy(&four, wr - OFF - 2 * (g + 4), 8);
  } else {
    for (int64_t t = 0; t < 4 && (g + t) * kQGroup < k; ++t) {
      uint16_t h;
      std::memcpy(&h, wr - OFF - 2 * (g + t + 1), 2);
      four |= static_cast<uint64_t>(h) << (16 * (3 - t));
    }
  }
  const __m512 v = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(four))));
  const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(idx, v);
}

// One chunk of 64 int8 columns from c for MR rows x NR outputs (FULL: every column < K, no
// masks). The weights' own lane sums (-128 w) are taken once a chunk, shared by the rows.
template <int MR, int NR, bool FULL>
inline void ichunk512_i8(const Args& a, const QRows& q, int64_t row0, const char* const* wr,
                         int64_t c, __m512 (*acc)[NR]) {
  const int64_t kp = q.kp;
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(-128)), zero = _mm512_setzero_si512();
  __m512i wv[NR], wc[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(wr[j] + kPrefetch + c, BATON_PF_HINT);
    wv[j] = FULL ? _mm512_loadu_si512(wr[j] + c) : iw512(wr[j], c, a.k);
    wc[j] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv[j]));
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const int64_t row = row0 + r;
    const __m512 dv = _mm512_loadu_ps(q.dxv.data() + row * kp / 4 + c / 4);
    const __m512i ua = _mm512_loadu_si512(q.ua.data() + row * kp + c);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m512i p = _mm512_dpbusd_epi32(wc[j], ua, wv[j]);
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dv, acc[r][j]);
    }
  }
}

// [c x 4] of a whole int4 chunk (c + 128 <= K): iscale4_512 with no checks.
inline __m512 iscale4_full512(const char* wr, int64_t c) {
  const __m128i four = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr - 2 * (c / kQGroup + 4)));
  const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(four)));
}

// int4: one chunk of 128 columns from c for MR rows x NR outputs, its 64 bytes as stored, low
// nibbles (even columns) and high nibbles (odd columns) against the row's even / odd
// activations (`qa4`): no unpacking into column order. FULL: every column < K (no masks).
template <int MR, int NR, bool FULL>
inline void ichunk512_i4(const Args& a, const QRows& q, int64_t row0, const char* const* wr,
                         int64_t c, __m512 (*acc)[NR]) {
  const int64_t kp = q.kp;
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(wr[j] + kPrefetch + c / 2, BATON_PF_HINT);
    const __m512i b = FULL ? _mm512_loadu_si512(wr[j] + c / 2) : iw4_512(wr[j], c, a.k);
    const __m512i lo = _mm512_and_si512(b, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    const __m512 sv = FULL ? iscale4_full512(wr[j], c) : iscale4_512(wr[j], c, a.k);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int64_t row = row0 + r;
      const __m512 dv = _mm512_loadu_ps(q.dxv4.data() + row * kp / 8 + c / 8);
      const __m512i na = _mm512_loadu_si512(q.nca4.data() + row * kp / 8 + c / 8);
      const __m512i qe = _mm512_loadu_si512(q.qa4.data() + row * kp + c);
      const __m512i qo = _mm512_loadu_si512(q.qa4.data() + row * kp + c + kQChunk4 / 2);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(na, lo, qe), hi, qo);
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, sv), acc[r][j]);
    }
  }
}

// kI8 / kI4: MR rows x NR outputs over whole chunks (ichunk512_i8 / _i4 with no masks), then
// the partial last chunk once.
template <int WT, int MR, int NR>
inline void iblock512(const Args& a, const QRows& q, int64_t q0, int64_t i0, int64_t n0) {
  constexpr int64_t chunk = WT == kI8 ? kQChunk : kQChunk4;
  __m512 acc[MR][NR];
  const char* wr[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, WT, n0 + j);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k = a.k, kf = k / chunk * chunk, row0 = q0 + i0;
  const auto run = [&](int64_t c, auto full) {
    if constexpr (WT == kI8) ichunk512_i8<MR, NR, decltype(full)::value>(a, q, row0, wr, c, acc);
    else ichunk512_i4<MR, NR, decltype(full)::value>(a, q, row0, wr, c, acc);
  };
  for (int64_t c = 0; c < kf; c += chunk) run(c, std::true_type{});
  if (kf < k) run(kf, std::false_type{});
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
      a.y[(i0 + r) * a.n + n0 + j] = int_finish<WT>(wr[j], tree512(acc[r][j]), a.bias, n0 + j);
}

// kI8G: 128 columns a chunk as stored (two 64-byte halves in the lane order), unsigned
// against the activations in the same order (`qa8`); `sc`: the NR rows' scale vectors made
// once for every block of rows of x (`iscales512`), or null (made here).
template <int MR, int NR>
inline void iblock512_i8g(const Args& a, const QRows& q, int64_t q0, int64_t i0, int64_t n0,
                          const float* sc) {
  __m512 acc[MR][NR];
  const char* wr[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, kI8G, n0 + j);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t kp = q.kp, kc = (a.k + kQChunk4 - 1) / kQChunk4 * kQChunk4;
  if constexpr (MR == 1) {  // one row of x: each weight row's chunk used as it is read
    const int64_t row = q0 + i0;
    for (int64_t c = 0; c < kc; c += kQChunk4) {
      const __m512 dv = _mm512_loadu_ps(q.dxv4.data() + row * kp / 8 + c / 8);
      const __m512i na = _mm512_loadu_si512(q.nca8.data() + row * kp / 8 + c / 8);
      const __m512i qe = _mm512_loadu_si512(q.qa8.data() + row * kp + c);
      const __m512i qo = _mm512_loadu_si512(q.qa8.data() + row * kp + c + 64);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        _mm_prefetch(wr[j] + kPrefetch + c, BATON_PF_HINT);
        _mm_prefetch(wr[j] + kPrefetch + c + 64, BATON_PF_HINT);
        const __m512i p = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(na, _mm512_loadu_si512(wr[j] + c), qe),
            _mm512_loadu_si512(wr[j] + c + 64), qo);
        const __m512 sv = sc ? _mm512_loadu_ps(sc + ((c / kQChunk4) * NR + j) * 16)
                             : iscale4_512<4>(wr[j], c, a.k);
        acc[0][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, sv), acc[0][j]);
      }
    }
  } else {
  for (int64_t c = 0; c < kc; c += kQChunk4) {
    __m512i lo[NR], hi[NR];
    __m512 sv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(wr[j] + kPrefetch + c, BATON_PF_HINT);
      _mm_prefetch(wr[j] + kPrefetch + c + 64, BATON_PF_HINT);
      lo[j] = _mm512_loadu_si512(wr[j] + c);
      hi[j] = _mm512_loadu_si512(wr[j] + c + 64);
      sv[j] = sc ? _mm512_loadu_ps(sc + ((c / kQChunk4) * NR + j) * 16)
                 : iscale4_512<4>(wr[j], c, a.k);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int64_t row = q0 + i0 + r;
      const __m512 dv = _mm512_loadu_ps(q.dxv4.data() + row * kp / 8 + c / 8);
      const __m512i na = _mm512_loadu_si512(q.nca8.data() + row * kp / 8 + c / 8);
      const __m512i qe = _mm512_loadu_si512(q.qa8.data() + row * kp + c);
      const __m512i qo = _mm512_loadu_si512(q.qa8.data() + row * kp + c + 64);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(na, lo[j], qe), hi[j], qo);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, sv[j]), acc[r][j]);
      }
    }
  }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
      a.y[(i0 + r) * a.n + n0 + j] = int_finish<kI8G>(wr[j], tree512(acc[r][j]), a.bias, n0 + j);
}

// kI8G: the scale vectors of weight rows n0 .. n0 + NR, chunk after chunk, made once for the
// `blocks` blocks of rows of x that read them (null for one block: made in the block).
template <int WT, int NR>
inline const float* iscales512(const Args& a, int64_t n0, int64_t blocks) {
  if constexpr (WT != kI8G) {
    return nullptr;
  } else {
    if (blocks < 2) return nullptr;
    static thread_local std::vector<float> buf;
    const int64_t chunks = (a.k + kQChunk4 - 1) / kQChunk4;
    if (static_cast<int64_t>(buf.size()) < chunks * NR * 16) buf.resize(chunks * NR * 16);
    for (int64_t ch = 0; ch < chunks; ++ch)
      for (int j = 0; j < NR; ++j)
        _mm512_storeu_ps(buf.data() + (ch * NR + j) * 16,
                         iscale4_512<4>(wbase(a, WT, n0 + j), ch * kQChunk4, a.k));
    return buf.data();
  }
}

template <int WT, int NR, int MAXMR>
inline void irows512(const Args& a, const QRows& q, int64_t q0, int64_t i, int64_t n0, int64_t mr,
                     const float* sc) {
  if constexpr (MAXMR > 1) {
    if (mr < MAXMR) return irows512<WT, NR, MAXMR - 1>(a, q, q0, i, n0, mr, sc);
  }
  if constexpr (WT == kI8G) iblock512_i8g<MAXMR, NR>(a, q, q0, i, n0, sc);
  else iblock512<WT, MAXMR, NR>(a, q, q0, i, n0);
}

template <int WT, int NR, int MAXMR>
inline void iouts512(const Args& a, const QRows& q, int64_t q0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  const int64_t blocks = (a.m + MAXMR - 1) / MAXMR;
  for (; n + NR <= n1; n += NR) {
    const float* sc = iscales512<WT, NR>(a, n, blocks);
    for (int64_t i = 0; i < a.m; i += MAXMR)
      irows512<WT, NR, MAXMR>(a, q, q0, i, n, std::min<int64_t>(MAXMR, a.m - i), sc);
  }
  if constexpr (NR > 8) {  // a thread's range ends on a block of 8 (its scales made for 8)
    for (; n + 8 <= n1; n += 8) {
      const float* sc = iscales512<WT, 8>(a, n, blocks);
      for (int64_t i = 0; i < a.m; i += MAXMR)
        irows512<WT, 8, MAXMR>(a, q, q0, i, n, std::min<int64_t>(MAXMR, a.m - i), sc);
    }
  }
  for (; n < n1; ++n) {
    const float* sc = iscales512<WT, 1>(a, n, blocks);
    for (int64_t i = 0; i < a.m; i += MAXMR)
      irows512<WT, 1, MAXMR>(a, q, q0, i, n, std::min<int64_t>(MAXMR, a.m - i), sc);
  }
}

template <int WT>
void int_range512(const Args& a, const QRows& q, int64_t q0, int64_t n0, int64_t n1) {
  // One row: int4 16 outputs a block (its 16 accumulators; 8 read the stream ~15% slower on
  // the Zen 4), int8 8 (16 measured the same).
  if (a.m == 1 && WT == kI4) iouts512<WT, 16, 1>(a, q, q0, n0, n1);
  else if (a.m == 1) iouts512<WT, 8, 1>(a, q, q0, n0, n1);
  else iouts512<WT, 4, 4>(a, q, q0, n0, n1);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// `n` bytes of a row from byte `at` (32 at most; zeros after).
inline __m256i ibytes256(const char* p, int64_t n) {
  if (n >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) int8_t buf[32] = {0};
  if (n > 0) std::memcpy(buf, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}

// int8: a group (32 columns) at a time, lanes 0-7 / 8-15 in acc[.][.][g % 2].
template <int MR, int NR>
inline void iblock256_i8(const Args& a, const QRows& q, int64_t q0, int64_t i0, int64_t n0) {
  __m256 acc[MR][NR][2];
  const char* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, kI8, n0 + j);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const int64_t kp = q.kp, groups = kp / kQGroup;
  const int64_t kg = (a.k + kQChunk - 1) / kQChunk * kQChunk / kQGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < kg; ++g) {
    const int64_t c = g * kQGroup;
    __m256i wv[NR], wa[NR];
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(wr[j] + kPrefetch + c, BATON_PF_HINT);
      wv[j] = ibytes256(wr[j] + c, a.k - c);
      wa[j] = _mm256_abs_epi8(wv[j]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = q0 + i0 + r;
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.qa.data() + row * kp + c));
      const __m256 d = _mm256_set1_ps(q.dx[row * groups + g]);
      for (int j = 0; j < NR; ++j) {
        const __m256i p =
            _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(qa, wv[j])), ones);
        __m256& l = acc[r][j][g % 2];
        l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, l);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j)
      a.y[(i0 + r) * a.n + n0 + j] =
          int_finish<kI8>(wr[j], tree256(V16{acc[r][j][0], acc[r][j][1]}), a.bias, n0 + j);
}

// int4: 64 columns (32 bytes) at a time, half h of a 128-column chunk: lanes 8 h .. 8 h + 7.
template <int MR, int NR>
inline void iblock256_i4(const Args& a, const QRows& q, int64_t q0, int64_t i0, int64_t n0) {
  __m256 acc[MR][NR][2];
  const char* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, kI4, n0 + j);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const int64_t kp = q.kp, groups = kp / kQGroup;
  const int64_t kc = (a.k + kQChunk4 - 1) / kQChunk4 * kQChunk4;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < kc; c += kQChunk4)
    for (int h = 0; h < 2; ++h) {
      const int64_t at = c + 64 * h, g = at / kQGroup;
      __m256i lo[NR], hi[NR];
      float s0[NR], s1[NR];
      for (int j = 0; j < NR; ++j) {
        _mm_prefetch(wr[j] + kPrefetch + at / 2, BATON_PF_HINT);
        const __m256i b = ibytes256(wr[j] + at / 2, (a.k - at) / 2);
        lo[j] = _mm256_and_si256(b, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        s0[j] = int_scale<kI4>(wr[j], a.k, g, 1.f);
        s1[j] = int_scale<kI4>(wr[j], a.k, g + 1, 1.f);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t row = q0 + i0 + r;
        const int8_t* q4 = q.qa4.data() + row * kp + c + 32 * h;
        const __m256i qe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4));
        const __m256i qo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4 + kQChunk4 / 2));
        const __m256i na = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(q.nca4.data() + row * kp / 8 + at / 8));
        const float d0 = q.dx[row * groups + g], d1 = q.dx[row * groups + g + 1];
        for (int j = 0; j < NR; ++j) {
          const __m256i p = _mm256_add_epi32(
              _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], qe), ones),
                               _mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], qo), ones)), na);
          const __m256 cv = _mm256_set_m128(_mm_set1_ps(d1 * s1[j]), _mm_set1_ps(d0 * s0[j]));
          __m256& l = acc[r][j][h];
          l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), cv, l);
        }
      }
    }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j)
      a.y[(i0 + r) * a.n + n0 + j] =
          int_finish<kI4>(wr[j], tree256(V16{acc[r][j][0], acc[r][j][1]}), a.bias, n0 + j);
}

// kI8G: 64 columns (half h of a 128-column chunk: lanes 8 h .. 8 h + 7) at a time, the 32
// bytes of each of the chunk's two stored halves, back to signed (q) for llama.cpp's sign
// trick; the lane's two 4-column sums added.
template <int MR, int NR>
inline void iblock256_i8g(const Args& a, const QRows& q, int64_t q0, int64_t i0, int64_t n0) {
  __m256 acc[MR][NR][2];
  const char* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = wbase(a, kI8G, n0 + j);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const int64_t kp = q.kp, groups = kp / kQGroup;
  const int64_t kc = (a.k + kQChunk4 - 1) / kQChunk4 * kQChunk4;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < kc; c += kQChunk4)
    for (int h = 0; h < 2; ++h) {
      const int64_t g = (c + 64 * h) / kQGroup;
      __m256i w0[NR], w1[NR], a0[NR], a1[NR];
      float s0[NR], s1[NR];
      for (int j = 0; j < NR; ++j) {
        _mm_prefetch(wr[j] + kPrefetch + c, BATON_PF_HINT);
        w0[j] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + c + 32 * h)), flip);
        w1[j] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + c + 64 + 32 * h)), flip);
        a0[j] = _mm256_abs_epi8(w0[j]), a1[j] = _mm256_abs_epi8(w1[j]);
        s0[j] = int_scale<kI8G>(wr[j], a.k, g, 1.f);
        s1[j] = int_scale<kI8G>(wr[j], a.k, g + 1, 1.f);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t row = q0 + i0 + r;
        const int8_t* q8 = q.qa8.data() + row * kp + c + 32 * h;
        const __m256i qe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8));
        const __m256i qo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64));
        const float d0 = q.dx[row * groups + g], d1 = q.dx[row * groups + g + 1];
        for (int j = 0; j < NR; ++j) {
          const __m256i p = _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(a0[j], _mm256_sign_epi8(qe, w0[j])), ones),
              _mm256_madd_epi16(_mm256_maddubs_epi16(a1[j], _mm256_sign_epi8(qo, w1[j])), ones));
          const __m256 cv = _mm256_set_m128(_mm_set1_ps(d1 * s1[j]), _mm_set1_ps(d0 * s0[j]));
          __m256& l = acc[r][j][h];
          l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), cv, l);
        }
      }
    }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j)
      a.y[(i0 + r) * a.n + n0 + j] =
          int_finish<kI8G>(wr[j], tree256(V16{acc[r][j][0], acc[r][j][1]}), a.bias, n0 + j);
}

template <int WT, int MR, int NR>
inline void iblock256(const Args& a, const QRows& q, int64_t q0, int64_t i0, int64_t n0) {
  if constexpr (WT == kI8) iblock256_i8<MR, NR>(a, q, q0, i0, n0);
  else if constexpr (WT == kI8G) iblock256_i8g<MR, NR>(a, q, q0, i0, n0);
  else iblock256_i4<MR, NR>(a, q, q0, i0, n0);
}

template <int WT>
void int_range256(const Args& a, const QRows& q, int64_t q0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    int64_t i = 0;
    for (; i + 2 <= a.m; i += 2) iblock256<WT, 2, 2>(a, q, q0, i, n);
    for (; i < a.m; ++i) iblock256<WT, 1, 2>(a, q, q0, i, n);
  }
  for (; n < n1; ++n)
    for (int64_t i = 0; i < a.m; ++i) iblock256<WT, 1, 1>(a, q, q0, i, n);
}

#pragma GCC pop_options

inline bool has_vnni() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return yes;
}

// The integer path over outputs [n0, n1): `a.q` rows [a.q0, a.q0 + m) of the caller's
// quantized x, or x quantized here (a caller that did not prepare it: the same values).
template <int WT>
void int_range(const Args& a, int isa, int64_t n0, int64_t n1) {
  const QRows* q = a.q;
  int64_t q0 = a.q0;
  static thread_local QRows local;
  if (q == nullptr) {
    quantize_rows(a.x, a.ldx, a.m, a.k, local, int_need_bit(WT), isa);
    q = &local, q0 = 0;
  }
  if (isa == kAvx512 && has_vnni()) int_range512<WT>(a, *q, q0, n0, n1);
  else if (isa >= kAvx2) int_range256<WT>(a, *q, q0, n0, n1);
  else int_scalar<WT>(a, *q, q0, n0, n1);
}

// x's rows quantized once for a call whose weights take the integer path (in the calling
// thread's buffer, read by the others during the call), else null.
inline const QRows* prepare_int(const float* x, int64_t ldx, int64_t m, int64_t k, int need,
                                int isa) {
  if (!need || m == 0) return nullptr;
  static thread_local QRows rows;
  quantize_rows(x, ldx, m, k, rows, need, isa);
  return &rows;
}

}  // namespace baton_gemv
