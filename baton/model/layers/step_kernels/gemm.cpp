// Prefill's float32 linear layers on the fast path (`linear._prefill_linear`): y = x w^T + b for
// x [M, K] (rows contiguous, any row stride), w [N, K] as nn.Linear stores it, on AVX2 + FMA
// machines without AVX-512 (elsewhere oneDNN stays: on the AVX-512 Zen 4 it ran 1.2-1.4x MKL).
//
// Why: on the Zen 3 EPYC (AVX2) oneDNN's matmul ran at 62-82 GFLOP/s a core on the bench
// models' prefill shapes (2,048 rows) where MKL's sgemm ran at 80-90; MKL's rounding depends
// on the row count (5-11 rows round differently at 1 and 2 threads), and a prompt's tokens
// must not depend on how it was chunked. This kernel runs at MKL's rate on those shapes
// (78-87 at one thread) and computes every output in one fixed order: for each block of 256
// k's, a chain of fma(x_k, w_k, acc) from 0, the blocks' sums added in order, then + bias (as
// MKL blocks K: one chain over all of K had 3x MKL's error at K = 768-1,280). A row's bits
// depend on nothing but the row and the weight (not the rows beside it, the row count, the
// chunking or the thread count).
//
// How (BLIS's loop order): w is packed per call into panels of 16 outputs ([panel][k][16], zero
// padded; 8 x 8 blocks transposed in registers, 1.5% of a 2,048-row product). Each thread takes
// one even run of rows, in blocks of at most 144; per block and K block the rows are packed
// [k][6] a tile (144 x 256 floats, in L2), then every panel's K block (16 KB, in L1) runs over
// them, each 6-row x 16-output tile keeping its 12 accumulators in registers. This gives the
// first version's bits (it left a row block's whole K unpacked, so 96 x 2,048 inputs spilled out
// of L2, and dealt row blocks to threads 8 against 7) in 0.984x its time at one thread and
// 1.004x at two, median of 12 interleaved passes over 14 prefill shapes; MKL's sgemm took
// 0.975x and 0.96x this kernel's time.

#include "common.h"

#include <cstring>

using namespace baton_step;

namespace {

constexpr int MR = 6, NR = 16;
constexpr int64_t KC = 256;  // K in blocks: each block's chain summed into y in order
constexpr int64_t MC = 144;  // rows a block (its packed K block, 144 KB, in L2)

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kBuilt = true;

// An 8 x 8 block of floats transposed in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]),
               t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]),
               t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]),
               t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// w [N, K] into panels of 16 outputs, [panel][k][16], zero padded (8 x 8 blocks transposed in
// registers where a panel is whole; the ragged last panel and K's tail one by one).
void pack_panels(const float* w, int64_t N, int64_t K, float* wp) {
  const int64_t panels = (N + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = wp + p * K * NR;
      const int64_t n0 = p * NR, nn = std::min<int64_t>(NR, N - n0);
      int64_t k0 = 0;
      if (nn == NR) {
        for (; k0 + 8 <= K; k0 += 8)
          for (int h = 0; h < 2; ++h) {
            __m256 r[8];
            for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(w + (n0 + h * 8 + j) * K + k0);
            transpose8(r);
            for (int k = 0; k < 8; ++k) _mm256_store_ps(dst + (k0 + k) * NR + h * 8, r[k]);
          }
      }
      for (; k0 < K; ++k0)
        for (int64_t j = 0; j < NR; ++j) dst[k0 * NR + j] = j < nn ? w[(n0 + j) * K + k0] : 0.f;
    }
  });
}

// A K block of up to 6 rows, packed [k][6] (rows past the block's end are zeros), so a tile
// reads its inputs as one stream.
void pack_rows(const float* x, int64_t ldx, int64_t mr, int64_t k0, int64_t k1, float* ap) {
  for (int64_t k = k0; k < k1; ++k, ap += MR)
    for (int64_t i = 0; i < MR; ++i) ap[i] = i < mr ? x[i * ldx + k] : 0.f;
}

// One tile: 6 packed rows of one K block times one panel's block, the first mr rows and nn <= 16
// outputs stored. Twelve named accumulators (an array of them was kept on the stack by GCC: 34
// against 80 GFLOP/s).
#define BATON_ROW(i)                                        \
  {                                                         \
    const __m256 av = _mm256_broadcast_ss(a + i);           \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);             \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);             \
  }
void tile(const float* a, const float* b, int64_t kc, float* y, int64_t ldy, int mr, int64_t nn,
          bool first, const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k, a += MR, b += NR) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    BATON_ROW(0) BATON_ROW(1) BATON_ROW(2) BATON_ROW(3) BATON_ROW(4) BATON_ROW(5)
  }
  const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                             {c30, c31}, {c40, c41}, {c50, c51}};
  alignas(32) float tmp[NR];
  for (int i = 0; i < mr; ++i) {
    __m256 v0 = acc[i][0], v1 = acc[i][1];
    if (!first) {  // the earlier K blocks' sum, then this block's
      if (nn == NR) {
        v0 = _mm256_add_ps(_mm256_loadu_ps(y + i * ldy), v0);
        v1 = _mm256_add_ps(_mm256_loadu_ps(y + i * ldy + 8), v1);
      } else {
        std::memcpy(tmp, y + i * ldy, nn * sizeof(float));
        v0 = _mm256_add_ps(_mm256_load_ps(tmp), v0);
        v1 = _mm256_add_ps(_mm256_load_ps(tmp + 8), v1);
      }
    }
    if (bias) {
      v0 = _mm256_add_ps(v0, _mm256_load_ps(bias));
      v1 = _mm256_add_ps(v1, _mm256_load_ps(bias + 8));
    }
    if (nn == NR) {
      _mm256_storeu_ps(y + i * ldy, v0);
      _mm256_storeu_ps(y + i * ldy + 8, v1);
    } else {
      _mm256_store_ps(tmp, v0);
      _mm256_store_ps(tmp + 8, v1);
      std::memcpy(y + i * ldy, tmp, nn * sizeof(float));
    }
  }
}
#undef BATON_ROW
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

bool prefill_gemm_built() { return kBuilt; }

at::Tensor prefill_gemm(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias) {
  check(x, "x"); check(w, "weight");
  TORCH_CHECK(kBuilt, "prefill_gemm needs AVX2 + FMA without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K], rows contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "weight must be [N, K], contiguous, with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(bias->expand({M, N})) : y.zero_();
  const int64_t panels = (N + NR - 1) / NR;
  auto buf = at::empty({panels * NR * (K + 1) + 8}, w.options());  // panels, then the bias
  float* wp = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buf.data_ptr<float>()) + 31) & ~uintptr_t(31));
  pack_panels(w.data_ptr<float>(), N, K, wp);
  float* bp = nullptr;
  if (bias.has_value()) {
    check(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N,
                "bias must be [N], contiguous");
    bp = wp + panels * NR * K;
    std::memcpy(bp, bias->data_ptr<float>(), N * sizeof(float));
    std::fill(bp + N, bp + panels * NR, 0.f);
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Each thread one run of rows (a multiple of 6; the last the rest), in blocks of at most
  // MC: even shares, however M divides.
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (M + MR - 1) / MR));
  const int64_t share = ((M + threads - 1) / threads + MR - 1) / MR * MR;
  // each thread's packed rows: one row block's K block (at most MC x 256 floats, in L2),
  // allocated here, by the calling thread (a buffer allocated on a pool thread gets that
  // thread a glibc arena of its own)
  auto abuf = at::empty({threads * (MC * KC + 8)}, w.options());
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t th = t0; th < t1; ++th) {
      float* ap = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(abuf.data_ptr<float>() + th * (MC * KC + 8)) + 31) &
          ~uintptr_t(31));
      const int64_t r0 = std::min(M, th * share), r1 = std::min(M, r0 + share);
      if (r0 >= r1) continue;
      const int64_t blocks = (r1 - r0 + MC - 1) / MC;
      const int64_t mc = ((r1 - r0 + blocks - 1) / blocks + MR - 1) / MR * MR;
      for (int64_t m0 = r0; m0 < r1; m0 += mc) {
        const int64_t m1 = std::min(r1, m0 + mc), tiles = (m1 - m0 + MR - 1) / MR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t k1 = std::min(K, k0 + KC), kc = k1 - k0;
          for (int64_t t = 0; t < tiles; ++t)
            pack_rows(xp + (m0 + t * MR) * ldx, ldx, std::min<int64_t>(MR, m1 - m0 - t * MR),
                      k0, k1, ap + t * kc * MR);
          for (int64_t p = 0; p < panels; ++p) {
            const int64_t nn = std::min<int64_t>(NR, N - p * NR);
            const float* bpanel = wp + p * K * NR + k0 * NR;
            for (int64_t t = 0; t < tiles; ++t) {
              const int64_t i = m0 + t * MR;
              tile(ap + t * kc * MR, bpanel, kc, yp + i * N + p * NR, N,
                   static_cast<int>(std::min<int64_t>(MR, m1 - i)), nn, k0 == 0,
                   bp && k1 == K ? bp + p * NR : nullptr);
            }
          }
        }
      }
    }
  });
#endif
  return y;
}
