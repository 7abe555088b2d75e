// Prefill kernels of the fast path (BATON_DECODE_PATH=fast): the elementwise work of a prompt's
// recurrent layers between their matmuls, one pass over the data each, for float32 on CPU.
//
// Why: in eager torch each of these is five to ten passes over a [T, channels] tensor (a 2,048
// token prompt's conv input is 16 MB), each pass memory bound; on the bench 100m models they
// were a fifth of a prefill, about as much as the layers' projections. Each row (token) is
// computed alone, in the reference's order of operations (no FMA: -ffp-contract=off), so a
// token's result does not depend on the prompt's chunking; only the exp differs (Sleef's, the
// one torch's vectorised exp uses too, ~1 ulp).

#include "common.h"

using namespace baton_step;

// Depthwise causal conv + silu of T tokens of n sequences, token-major: x [n, T, C] (rows
// contiguous, any row stride: a column slice of in_proj's output), the K-1 conv inputs before
// each sequence state [n, C, K-1], w [C, K], bias [C] or None -> [n, T, C]. Each output is
// ((w0 x0 + w1 x1) + ...) + bias, then silu: the reference's (`Mamba2Mixer._conv`) order.
at::Tensor conv_silu(const at::Tensor& x, const at::Tensor& state, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias) {
  check(x, "conv input"); check(state, "conv state"); check(w, "conv weight");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "conv input must be [n, T, C], rows contiguous");
  const int64_t n = x.size(0), T = x.size(1), C = x.size(2), K = w.size(1);
  TORCH_CHECK(state.is_contiguous() && w.is_contiguous() && state.size(0) == n &&
              state.size(1) == C && state.size(2) == K - 1 && w.size(0) == C,
              "conv state must be [n, C, K-1] and weight [C, K], contiguous");
  const float* bp = nullptr;
  if (bias.has_value()) { check(*bias, "conv bias"); bp = bias->data_ptr<float>(); }
  const float *xp = x.data_ptr<float>(), *sp = state.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  std::vector<float> st(n * (K - 1) * C), wt(K * C);  // state as rows [n, K-1, C]; w as [K, C]
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t k = 0; k < K - 1; ++k)
        st[(i * (K - 1) + k) * C + c] = sp[(i * C + c) * (K - 1) + k];
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < K; ++k) wt[k * C + c] = wp[c * K + k];
  auto out = at::empty({n, T, C}, x.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * T, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> tmp(C);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t i = row / T, t = row % T;
      float* o = op + row * C;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t s = t + k;  // the window column: state first, then the tokens
        const float* src = s < K - 1 ? st.data() + (i * (K - 1) + s) * C
                                     : xp + i * xs0 + (s - (K - 1)) * xs1;
        const float* wk = wt.data() + k * C;
        if (k == 0) {
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) o[c] = src[c] * wk[c];
        } else {
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) o[c] = o[c] + src[c] * wk[c];
        }
      }
      if (bp) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) o[c] = o[c] + bp[c];
      }
      silu_(o, o, tmp.data(), C);
    }
  });
  return out;
}

// Gated RMSNorm of rows, statistics per group of `group` channels: y, gate [rows, D] (rows
// contiguous, any row stride), w [D] or [group] (repeated per group). norm_first false
// (NemotronH's): w * norm(y * silu(gate)); true (Qwen3.5's DeltaNet): (w * norm(y)) * silu(gate).
at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& gate, const at::Tensor& w,
                          int64_t group, double eps, bool norm_first) {
  check(y, "y"); check(gate, "gate"); check(w, "norm weight");
  TORCH_CHECK(y.dim() == 2 && gate.dim() == 2 && y.stride(1) == 1 && gate.stride(1) == 1 &&
              y.sizes() == gate.sizes(), "y and gate must be [rows, D], rows contiguous");
  const int64_t rows = y.size(0), D = y.size(1), wl = w.numel();
  TORCH_CHECK(w.is_contiguous() && D % group == 0 && (wl == D || wl == group),
              "norm weight must have D or group entries");
  const float *yp = y.data_ptr<float>(), *gp = gate.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t ys = y.stride(0), gs = gate.stride(0);
  auto out = at::empty({rows, D}, y.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> sg(D), tmp(D);
    for (int64_t i = lo; i < hi; ++i) {
      const float *yr = yp + i * ys, *gr = gp + i * gs;
      float* o = op + i * D;
      silu_(gr, sg.data(), tmp.data(), D);
      const float* src = yr;
      if (!norm_first) {
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) o[c] = yr[c] * sg[c];
        src = o;
      }
      for (int64_t g0 = 0; g0 < D; g0 += group) {
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = g0; c < g0 + group; ++c) ss += src[c] * src[c];
        const float inv = 1.f / std::sqrt(ss / group + (float)eps);
        const float* wg = wl == D ? wp + g0 : wp;
        if (norm_first) {
#pragma omp simd
          for (int64_t c = 0; c < group; ++c)
            o[g0 + c] = (wg[c] * (src[g0 + c] * inv)) * sg[g0 + c];
        } else {
#pragma omp simd
          for (int64_t c = 0; c < group; ++c) o[g0 + c] = wg[c] * (src[g0 + c] * inv);
        }
      }
    }
  });
  return out;
}

// The SSD scan's intra-chunk matrix: M[b, h, c, i, j] = CB[b, h / r, c, i, j] *
// exp(cum[b, h, c, i] - cum[b, h, c, j]) for j <= i, 0 above; CB [b, G, c, l, l] float, cum
// [b, H, c, l] float64 (the difference in float64, then rounded: no cancellation). With C
// [b, G, c, l, N] given, each row goes on with C[b, h / r, c, i, :] * exp(cum[i]) (what the
// state entering the chunk gives row i): rows of l + N, one matmul with [x dt ; S^T] then.
// Decays below e^-60 are 0 (their products would be denormals: see ssd_fast.FLUSH).
at::Tensor ssd_decay(const at::Tensor& CB, const at::Tensor& cum, int64_t r,
                     const c10::optional<at::Tensor>& C) {
  check(CB, "CB");
  TORCH_CHECK(cum.scalar_type() == at::kDouble && cum.is_contiguous() && CB.is_contiguous() &&
              CB.dim() == 5 && cum.dim() == 4, "CB [b,G,c,l,l] float, cum [b,H,c,l] float64");
  const int64_t b = cum.size(0), H = cum.size(1), nc = cum.size(2), l = cum.size(3);
  TORCH_CHECK(CB.size(1) * r == H && CB.size(2) == nc && CB.size(3) == l, "CB/cum shapes");
  const float* cp_ = nullptr;
  int64_t N = 0;
  if (C.has_value()) {
    check(*C, "C");
    TORCH_CHECK(C->is_contiguous() && C->dim() == 5 && C->size(3) == l, "C [b,G,c,l,N]");
    cp_ = C->data_ptr<float>();
    N = C->size(4);
  }
  const int64_t W = l + N;
  auto out = at::empty({b, H, nc, l, W}, CB.options());
  const float* cb = CB.data_ptr<float>();
  const double* cp = cum.data_ptr<double>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * H * nc, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t bi = blk / (H * nc), h = blk / nc % H, ci = blk % nc;
      const double* cr = cp + blk * l;
      const int64_t gblk = (bi * (H / r) + h / r) * nc + ci;
      const float* cbb = cb + gblk * l * l;
      float* ob = op + blk * l * W;
      for (int64_t i = 0; i < l; ++i) {
        float* o = ob + i * W;
        const double ci_ = cr[i];
        for (int64_t j = 0; j <= i; ++j) {
          const float d = (float)(ci_ - cr[j]);
          o[j] = d < -60.f ? -INFINITY : d;
        }
        exp_(o, i + 1, 0.f);
        const float* cbr = cbb + i * l;
#pragma omp simd
        for (int64_t j = 0; j <= i; ++j) o[j] = o[j] * cbr[j];
        for (int64_t j = i + 1; j < l; ++j) o[j] = 0.f;
        if (N) {
          const float e = (float)ci_ < -60.f ? 0.f : std::exp((float)ci_);
          const float* crow = cp_ + (gblk * l + i) * N;
#pragma omp simd
          for (int64_t n = 0; n < N; ++n) o[l + n] = crow[n] * e;
        }
      }
    }
  });
  return out;
}

// x = (1 + strictly_lower(A))^-1 rhs by forward substitution, the DeltaNet UT transform's
// solve (`torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)`; LAPACK's
// batched trsm ran at a fifth of the machine's matmul rate on these 64 x 64 systems): A
// [B, l, l], rhs [B, l, m], both contiguous; returns x [B, l, m].
at::Tensor unit_lower_solve(const at::Tensor& A, const at::Tensor& rhs) {
  check(A, "A"); check(rhs, "rhs");
  TORCH_CHECK(A.is_contiguous() && rhs.is_contiguous() && A.dim() == 3 && rhs.dim() == 3 &&
              A.size(0) == rhs.size(0) && A.size(1) == A.size(2) && A.size(1) == rhs.size(1),
              "A [B, l, l] and rhs [B, l, m] must be contiguous");
  const int64_t B = A.size(0), l = A.size(1), m = rhs.size(2);
  auto out = rhs.clone();
  const float* ap = A.data_ptr<float>();
  float* xp = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bi = lo; bi < hi; ++bi) {
      const float* a = ap + bi * l * l;
      float* x = xp + bi * l * m;
      for (int64_t i = 1; i < l; ++i) {
        float* xi = x + i * m;
        for (int64_t j = 0; j < i; ++j) {
          const float aij = a[i * l + j];
          const float* xj = x + j * m;
#pragma omp simd
          for (int64_t c = 0; c < m; ++c) xi[c] = xi[c] - aij * xj[c];
        }
      }
    }
  });
  return out;
}

// Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) on, or off, on this thread and
// every thread of ATen's pool (MXCSR is per thread: torch.set_flush_denormal sets only the
// calling one, while the scans' matmuls run on the pool's). Returns whether they were on
// here before. The prefill scans turn them on around themselves (ssd_fast.denormals_flushed).
bool flush_denormals(bool on) {
  constexpr unsigned bits = 0x8040;
  const bool was = (_mm_getcsr() & bits) == bits;
  auto set = [&] {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | bits) : (csr & ~bits));
  };
  const int64_t n = at::get_num_threads();
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { set(); });  // one chunk a thread
  set();  // this thread, also where the pool ran the chunks inline
  return was;
}
