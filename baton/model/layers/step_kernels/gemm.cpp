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
// How: w is packed per call into panels of 16 outputs ([panel][k][16], zero padded), ~1% of a
// 2,048-row product; each 6-row x 16-output tile keeps its 12 accumulators in registers over
// a K block (a row block's 96 x K inputs stay in L2, the panel's block in L1); the row blocks
// are split over torch's threads.

#include "common.h"

#include <cstring>

using namespace baton_step;

namespace {

constexpr int MR = 6, NR = 16;
constexpr int64_t KC = 256;  // K in blocks: each block's chain summed into y in order

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kBuilt = true;

void pack_panels(const float* w, int64_t N, int64_t K, float* wp) {
  const int64_t panels = (N + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = wp + p * K * NR;
      const int64_t n0 = p * NR, nn = std::min<int64_t>(NR, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += 8) {
        const int64_t kk = std::min<int64_t>(8, K - k0);
        for (int64_t j = 0; j < NR; ++j) {
          const float* src = w + (n0 + j) * K + k0;
          for (int64_t k = 0; k < kk; ++k) dst[(k0 + k) * NR + j] = j < nn ? src[k] : 0.f;
        }
      }
    }
  });
}

// One tile: rows [mr <= 6] of x times one panel, nn <= 16 outputs stored. Twelve named
// accumulators (an array of them was kept on the stack by GCC: 34 against 80 GFLOP/s).
#define BATON_ROW(i)                                         \
  if (mr > i) {                                              \
    const __m256 av = _mm256_broadcast_ss(x + i * ldx + k);  \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);              \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);              \
  }
template <int mr>
void tile(const float* x, int64_t ldx, const float* b, int64_t k0, int64_t k1, float* y,
          int64_t ldy, int64_t nn, bool first, const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_load_ps(b + k * NR), b1 = _mm256_load_ps(b + k * NR + 8);
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

using Tile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                      int64_t, bool, const float*);
constexpr Tile kTiles[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
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
  // Row blocks of up to 96 (96 x K inputs in L2), at least one per thread.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t mc = std::clamp<int64_t>((M + threads - 1) / threads, MR, 96) / MR * MR;
  at::parallel_for(0, (M + mc - 1) / mc, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t m0 = blk * mc, m1 = std::min(M, m0 + mc);
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t nn = std::min<int64_t>(NR, N - p * NR);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t k1 = std::min(K, k0 + KC);
          for (int64_t i = m0; i < m1; i += MR) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, m1 - i));
            kTiles[mr](xp + i * ldx, ldx, wp + p * K * NR, k0, k1, yp + i * N + p * NR, N, nn,
                       k0 == 0, bp && k1 == K ? bp + p * NR : nullptr);
          }
        }
      }
    }
  });
#endif
  return y;
}
