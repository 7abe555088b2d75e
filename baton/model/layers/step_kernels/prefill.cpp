// Prefill kernels of the fast path (BATON_DECODE_PATH=fast): the elementwise work of a prompt's
// recurrent layers between their matmuls, one pass over the data each, for float32 on CPU.
//
// Why: in eager torch each of these is five to ten passes over a [T, channels] tensor (a 2,048
// token prompt's conv input is 16 MB), each pass memory bound; on the bench 100m models they
// were a fifth of a prefill, about as much as the layers' projections. Each row (token) is
// computed alone, in the reference's order of operations (no FMA: -ffp-contract=off), so a
// token's result does not depend on the prompt's chunking; only the exp differs from torch's:
// these keep std::exp's bits (common.h's exp_<false>, on AVX2 and AVX-512 builds alike), where
// torch's vectorised exp is Sleef's (~1 ulp).

#include "common.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <atomic>

#include <cstring>
#include <limits>

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
    std::vector<const float*> src(K);  // the window's rows: state first, then the tokens
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t i = row / T, t = row % T;
      float* o = op + row * C;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t s = t + k;
        src[k] = s < K - 1 ? st.data() + (i * (K - 1) + s) * C : xp + i * xs0 + (s - (K - 1)) * xs1;
      }
#if defined(__AVX2__) && defined(__FMA__)
      {  // one pass: each 8 channels' taps, bias and silu in registers
        int64_t c = 0;
        for (; c + 8 <= C; c += 8) {
          __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src[0] + c), _mm256_loadu_ps(wt.data() + c));
          for (int64_t k = 1; k < K; ++k)
            v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(src[k] + c),
                                               _mm256_loadu_ps(wt.data() + k * C + c)));
          if (bp) v = _mm256_add_ps(v, _mm256_loadu_ps(bp + c));
          _mm256_storeu_ps(o + c, glibc_expf::silu8(v));
        }
        for (; c < C; ++c) {
          float v = src[0][c] * wt[c];
          for (int64_t k = 1; k < K; ++k) v = v + src[k][c] * wt[k * C + c];
          if (bp) v = v + bp[c];
          o[c] = v / (1.f + std::exp(-v));
        }
        continue;
      }
#endif
      for (int64_t k = 0; k < K; ++k) {
        const float* wk = wt.data() + k * C;
        if (k == 0) {
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) o[c] = src[k][c] * wk[c];
        } else {
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) o[c] = o[c] + src[k][c] * wk[c];
        }
      }
      if (bp) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) o[c] = o[c] + bp[c];
      }
      silu_<false>(o, o, tmp.data(), C);
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
      silu_<false>(gr, sg.data(), tmp.data(), D);
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

namespace {

// The shapes ssd_decay reads, checked once: CB [b, G, c, l, l] float, cum [b, H, c, l]
// float64, C [b, G, c, l, N] or none.
struct Decay {
  int64_t b, H, nc, l, r, N, W;
  const float *cb, *cp_;
  const double* cp;
  Decay(const at::Tensor& CB, const at::Tensor& cum, int64_t r_, const c10::optional<at::Tensor>& C)
      : r(r_), N(0), cp_(nullptr) {
    check(CB, "CB");
    TORCH_CHECK(cum.scalar_type() == at::kDouble && cum.is_contiguous() && CB.is_contiguous() &&
                CB.dim() == 5 && cum.dim() == 4, "CB [b,G,c,l,l] float, cum [b,H,c,l] float64");
    b = cum.size(0), H = cum.size(1), nc = cum.size(2), l = cum.size(3);
    TORCH_CHECK(r > 0 && CB.size(1) * r == H && CB.size(2) == nc && CB.size(3) == l,
                "CB/cum shapes");
    if (C.has_value()) {
      check(*C, "C");
      TORCH_CHECK(C->is_contiguous() && C->dim() == 5 && C->size(3) == l, "C [b,G,c,l,N]");
      cp_ = C->data_ptr<float>();
      N = C->size(4);
    }
    W = l + N;
    cb = CB.data_ptr<float>();
    cp = cum.data_ptr<double>();
  }
  // block blk = (batch, head, chunk)'s [l, W] rows into ob
  void rows(int64_t blk, float* ob) const {
    const int64_t bi = blk / (H * nc), h = blk / nc % H, ci = blk % nc;
    const double* cr = cp + blk * l;
    const int64_t gblk = (bi * (H / r) + h / r) * nc + ci;
    const float* cbb = cb + gblk * l * l;
    for (int64_t i = 0; i < l; ++i) {
      float* o = ob + i * W;
      const double ci_ = cr[i];
      for (int64_t j = 0; j <= i; ++j) {
        const float d = (float)(ci_ - cr[j]);
        o[j] = d < -60.f ? -INFINITY : d;
      }
      exp_<false>(o, i + 1, 0.f);
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
};

}  // namespace

// The SSD scan's intra-chunk matrix: M[b, h, c, i, j] = CB[b, h / r, c, i, j] *
// exp(cum[b, h, c, i] - cum[b, h, c, j]) for j <= i, 0 above; CB [b, G, c, l, l] float, cum
// [b, H, c, l] float64 (the difference in float64, then rounded: no cancellation). With C
// [b, G, c, l, N] given, each row goes on with C[b, h / r, c, i, :] * exp(cum[i]) (what the
// state entering the chunk gives row i): rows of l + N, one matmul with [x dt ; S^T] then
// (`decay_matmul` does both).
// Decays below e^-60 are 0 (their products would be denormals: see ssd_fast.FLUSH).
at::Tensor ssd_decay(const at::Tensor& CB, const at::Tensor& cum, int64_t r,
                     const c10::optional<at::Tensor>& C) {
  const Decay d(CB, cum, r, C);
  auto out = at::empty({d.b, d.H, d.nc, d.l, d.W}, CB.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, d.b * d.H * d.nc, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t blk = lo; blk < hi; ++blk) d.rows(blk, op + blk * d.l * d.W);
  });
  return out;
}

// a * b + c as torch's CPU addcmul rounds it: its vectorised kernel's multiply and add, built
// with GCC's default contraction, are one fused multiply-add where the CPU has FMA.
static inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// The SSD scan's state carry, chunk after chunk: X [b, H, c, l + N, P]'s rows l.. (the state
// entering each chunk, transposed) get, in chunk 0, state0 [b, H, P, N] transposed (or zeros
// where none), in chunk i + 1 states[i] + entering[i] * decay[i]: states [b, G, c, N, r, P]
// (what each chunk adds by its end, head g * r + j), decay [b, H, c]. Returns the state after
// the last chunk, [b, H, P, N]. One pass in place of a torch.addcmul a chunk over strided
// views, with its rounding (`madd`).
at::Tensor ssd_carry(const at::Tensor& states, const at::Tensor& decay, at::Tensor X,
                     const c10::optional<at::Tensor>& state0, int64_t l) {
  check(states, "states"); check(decay, "decay"); check(X, "X");
  TORCH_CHECK(states.dim() == 6 && decay.dim() == 3 && X.dim() == 5 && states.is_contiguous() &&
              decay.is_contiguous() && X.is_contiguous(),
              "states [b, G, c, N, r, P], decay [b, H, c], X [b, H, c, l + N, P], contiguous");
  const int64_t b = states.size(0), G = states.size(1), c = states.size(2), N = states.size(3);
  const int64_t r = states.size(4), P = states.size(5), H = G * r;
  TORCH_CHECK(X.size(0) == b && X.size(1) == H && X.size(2) == c && X.size(3) == l + N &&
              X.size(4) == P && decay.size(0) == b && decay.size(1) == H && decay.size(2) == c,
              "states, decay and X shapes");
  const float* s0 = nullptr;
  at::Tensor s0c;
  if (state0.has_value()) {
    check(*state0, "state");
    s0c = state0->contiguous();
    TORCH_CHECK(s0c.dim() == 4 && s0c.size(0) == b && s0c.size(1) == H && s0c.size(2) == P &&
                s0c.size(3) == N, "state must be [b, H, P, N]");
    s0 = s0c.data_ptr<float>();
  }
  auto fin = at::empty({b, H, P, N}, X.options());
  const float *sp = states.data_ptr<float>(), *dp = decay.data_ptr<float>();
  float *xp = X.data_ptr<float>(), *fp = fin.data_ptr<float>();
  const int64_t W = l + N;
  at::parallel_for(0, b * H * N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t bi = u / (H * N), h = u / N % H, n = u % N, g = h / r, j = h % r;
      float* e = xp + ((bi * H + h) * c * W + l + n) * P;  // chunk 0's row n
      if (s0)
        for (int64_t p = 0; p < P; ++p) e[p] = s0[((bi * H + h) * P + p) * N + n];
      else
        std::fill(e, e + P, 0.f);
      for (int64_t i = 0; i < c; ++i) {
        const float* st = sp + ((((bi * G + g) * c + i) * N + n) * r + j) * P;
        const float d = dp[(bi * H + h) * c + i];
        if (i + 1 < c) {
          float* nx = e + W * P;
#pragma omp simd
          for (int64_t p = 0; p < P; ++p) nx[p] = madd(e[p], d, st[p]);
          e = nx;
        } else {
          float* f = fp + (bi * H + h) * P * N + n;
          for (int64_t p = 0; p < P; ++p) f[p * N] = madd(e[p], d, st[p]);
        }
      }
    }
  });
  return fin;
}

// The test's handle on the prefill kernels' exp (exp_<false>): exp of every element of x,
// vector true on that path (8 lanes at a time, then std::exp for the tail), false std::exp
// element by element.
at::Tensor prefill_exp_of(const at::Tensor& x, bool vector) {
  check(x, "x");
  at::Tensor out = x.contiguous().clone();
  float* p = out.data_ptr<float>();
  const int64_t n = out.numel();
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    if (vector) exp_<false>(p + lo, hi - lo, 0.f);
    else for (int64_t i = lo; i < hi; ++i) p[i] = std::exp(p[i]);
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

// A prefill MoE block's routed experts' matmuls, one expert at a time per thread: xs [R, K]
// holds each pair's row sorted by expert (counts [E] rows each, in order), w [E, N, K];
// returns ys [R, N] with ys[run e] = xs[run e] @ w[e]^T. Each expert's product is MKL's sgemm
// at one thread (inside torch's pool nested calls run single-threaded); the threads take the
// experts, most rows first, from one counter.
// Why: a torch.mm per expert at 2 threads splits each [256-512, 768] x [768, 512-1280]
// product over both, which costs rate at these sizes (the Zen 3 at 2 threads, GFLOP/s a core,
// loop -> one expert a thread: quiet, Qwen3.5-MoE's 8 experts of ~512 rows 72 -> 84 and
// NemotronH-MoE's 32 of ~256 81 -> 85; with a compile running beside it 52 -> 78 and 25 -> 59).
// The result is the loop's at one thread, whatever the thread count (MKL rounds runs of 5-11
// rows differently at 2 threads).
at::Tensor grouped_mm(const at::Tensor& xs, const at::Tensor& w, const at::Tensor& counts) {
  check(xs, "expert rows"); check(w, "expert weights");
  TORCH_CHECK(xs.dim() == 2 && xs.is_contiguous(), "expert rows must be [R, K], contiguous");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == xs.size(1),
              "expert weights must be [E, N, K] with K = the rows' width");
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong &&
              counts.dim() == 1 && counts.size(0) == w.size(0),
              "counts must be [E] int64 on the CPU");
  const int64_t E = w.size(0);
  auto c = counts.accessor<int64_t, 1>();
  std::vector<int64_t> start(E + 1, 0), order;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(c[e] >= 0, "counts must not be negative");
    start[e + 1] = start[e] + c[e];
    if (c[e]) order.push_back(e);
  }
  TORCH_CHECK(start[E] == xs.size(0), "counts sum to ", start[E], ", not the ", xs.size(0),
              " rows");
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return c[a] > c[b]; });
  auto ys = at::empty({xs.size(0), w.size(1)}, xs.options());
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const at::ThreadLocalState caller;  // grad and inference mode: the pool's threads take them
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      const int64_t e = order[i];
      auto out = ys.narrow(0, start[e], c[e]);
      at::mm_out(out, xs.narrow(0, start[e], c[e]), w.select(0, e).t());
    }
  });
  return ys;
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

namespace {

// 8 floats as one vector (ymm with AVX2, xmm pairs below it): element-wise ops only, so a
// lane's result is its own sequence of multiplies and adds.
typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) { v8 r; std::memcpy(&r, p, sizeof r); return r; }
inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }
inline float hsum8(v8 a) {  // a fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7))
  const float s04 = a[0] + a[4], s26 = a[2] + a[6], s15 = a[1] + a[5], s37 = a[3] + a[7];
  return (s04 + s26) + (s15 + s37);
}
// a * b + c, rounded once where the CPU has FMA (half the instructions of the inner loops)
inline v8 fma8(v8 a, float b, v8 c) {
#ifdef __FMA__
  return (v8)_mm256_fmadd_ps((__m256)a, _mm256_set1_ps(b), (__m256)c);
#else
  return a * b + c;
#endif
}
inline void exp8_(float* x, int64_t n) {  // n a multiple of 8; -inf -> 0
#ifdef __AVX2__
  for (int64_t i = 0; i < n; i += 8) {
    __m256 r = Sleef_expf8_u10(_mm256_loadu_ps(x + i));
    _mm256_storeu_ps(x + i, r);
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

// 6 rows: 12 accumulators, enough independent FMA chains to cover the FMA latency (4 rows, 8
// chains: 151 -> 122 ms at 2,048 tokens, 12 heads of 64, 1 thread, on the Zen 2)
constexpr int64_t AR = 6;   // query rows a register tile computes together
constexpr int64_t AT = 2;   // register tiles a task computes (over the same keys from L1)
constexpr int64_t MR = AR * AT;
constexpr int64_t AJ = 16;  // keys a score tile covers
constexpr int64_t VJ = 64;  // keys a pass of the output tiles covers

// One register tile of C = A B: R rows x 16 columns, acc += A(r, k) B(k, 0..16) for k over
// [0, ka) and then [kb, K), in that order (the rows' own sums, whatever the tile's height).
template <int R>
inline void bmm_tile(const float* a, int64_t am, int64_t ak, const float* b, int64_t bk,
                     float* c, int64_t cm, int64_t ka, int64_t kb, int64_t K) {
  v8 acc[R][2] = {};
  auto step = [&](int64_t k) {
    const v8 b0 = load8(b + k * bk), b1 = load8(b + k * bk + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float x = a[r * am + k * ak];
      acc[r][0] = fma8(b0, x, acc[r][0]);
      acc[r][1] = fma8(b1, x, acc[r][1]);
    }
  };
  for (int64_t k = 0; k < ka; ++k) step(k);
  for (int64_t k = kb; k < K; ++k) step(k);
  for (int r = 0; r < R; ++r) {
    store8(c + r * cm, acc[r][0]);
    store8(c + r * cm + 8, acc[r][1]);
  }
}

// C [M, Nc] (rows Nc apart) = A B of one batch element: A(m, k) = a[m * am + k * ak], B's row
// k at b + k * bk (contiguous), Nc a multiple of 16; the first `lower` columns of A lower
// triangular (0 for none). 16 columns at a time, 6 rows a register tile.
void bmm_one(const float* a, int64_t am, int64_t ak, const float* b, int64_t bk, float* c,
             int64_t M, int64_t K, int64_t Nc, int64_t lower) {
  for (int64_t j0 = 0; j0 < Nc; j0 += 16)
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const int64_t rows = std::min<int64_t>(6, M - m0);
      const int64_t ka = lower ? std::min(m0 + rows, lower) : 0;
      const float* at = a + m0 * am;
      float* ct = c + m0 * Nc + j0;
      switch (rows) {
        case 6: bmm_tile<6>(at, am, ak, b + j0, bk, ct, Nc, ka, lower, K); break;
        case 5: bmm_tile<5>(at, am, ak, b + j0, bk, ct, Nc, ka, lower, K); break;
        case 4: bmm_tile<4>(at, am, ak, b + j0, bk, ct, Nc, ka, lower, K); break;
        case 3: bmm_tile<3>(at, am, ak, b + j0, bk, ct, Nc, ka, lower, K); break;
        case 2: bmm_tile<2>(at, am, ak, b + j0, bk, ct, Nc, ka, lower, K); break;
        default: bmm_tile<1>(at, am, ak, b + j0, bk, ct, Nc, ka, lower, K);
      }
    }
}

}  // namespace

// ssd_decay(CB, cum, r, C) @ X without the decay matrix in memory: each block's [l, l + N]
// rows go to a buffer of the thread's (in cache) and straight into the matmul with X [b, H,
// c, l + N, P] (rows contiguous, P a multiple of 16), the triangle's zeros skipped ->
// [b, H, c, l, P]. Each output is its k's products summed in k's order (fused where the CPU
// has FMA): the same bits whatever the batch, the split of the blocks or the threads. What
// both prefill scans end with (SSD's outputs, DeltaNet's): the decay matrix was 25 MB a
// layer at 2,048 tokens, written and read back, and MKL's batched sgemm ran these 64 x 128
// by 128 x 64 products at 49-54 GFLOP/s on the Zen 2.
at::Tensor decay_matmul(const at::Tensor& CB, const at::Tensor& cum, int64_t r,
                        const c10::optional<at::Tensor>& C, const at::Tensor& X) {
  const Decay d(CB, cum, r, C);
  check(X, "X");
  const int64_t blocks = d.b * d.H * d.nc;
  TORCH_CHECK(X.dim() == 5 && X.size(0) == d.b && X.size(1) == d.H && X.size(2) == d.nc &&
              X.size(3) == d.W && X.stride(4) == 1 && X.size(4) % 16 == 0,
              "X must be [b, H, c, l + N, P], rows contiguous, P a multiple of 16");
  const int64_t P = X.size(4);
  const auto Xc = X.contiguous();
  auto out = at::empty({d.b, d.H, d.nc, d.l, P}, X.options());
  const float* xp = Xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows(d.l * d.W);
    for (int64_t blk = lo; blk < hi; ++blk) {
      d.rows(blk, rows.data());
      bmm_one(rows.data(), d.W, 1, xp + blk * d.W * P, P, op + blk * d.l * P, d.l, d.W, P, d.l);
    }
  });
  return out;
}

// Causal attention of a prompt's queries over their keys, every query row computed alone in a
// fixed order, so its result does not depend on the call's length, the prompt's chunking, the
// batch or the threads: SDPA's CPU kernel splits the keys into blocks whose size follows the
// key count and gives them to BLAS, whose split of a long sum follows the matrix sizes, so the
// same row came out ~1 ulp apart in a whole prompt and in a prompt cut in two (on an AVX2 AMD
// machine; not on the AVX-512 Xeon this was first measured on).
// q [n, T, H, D] (rows contiguous: a [n, T, H * D] projection viewed), k, v [n, Hk, S, D],
// pos long [n, T]: the position of each query, which reads keys 0..pos (and at most S);
// H a multiple of Hk (query head h reads key head h / (H / Hk)). Returns [n, T, H, D].
// A row's score j is sum_d q_d k_jd in d's order, its softmax exp(s_j * scale - max) over
// (sum of those in 8 lanes, then a fixed tree), its output sum_j p_j v_j in j's order times
// 1 / sum: the same operations whichever rows share its task. A task takes MR rows of one key
// head (its query heads' rows at consecutive positions), so the keys it streams serve all of
// them; its register tiles of AR rows each go over the same 16 keys (scores) or 64 keys x 16
// columns (outputs) while those are in L1.
namespace {
// The keys [n, Hk, S, D] in blocks of 16 keys, each [D, 16] (zeros past S): a score tile reads
// its 16 keys' d-th elements as one contiguous row, d after d; the values in blocks of 16
// columns, each [S, 16] (zeros past D): an output pass reads its 16 columns key after key.
// k, v: float32 [n, Hk, S, D] (fmt KV_F32), or stored rows, bytes [n, Hk, S, head bytes]
// (KV_BF16, KV_FP8), widened a row at a time as `paged.dequantize` widens them.
std::pair<at::Tensor, at::Tensor> key_tiles(const at::Tensor& k, const at::Tensor& v,
                                            int64_t fmt, int64_t D, const at::TensorOptions& f) {
  const int64_t n = k.size(0), Hk = k.size(1), S = k.size(2);
  const int64_t S16 = (S + AJ - 1) / AJ * AJ, D16 = (D + 15) / 16;
  const int64_t hb = kv_head_bytes(fmt, D);
  const auto kc = k.contiguous(), vc = v.contiguous();
  auto kt = at::zeros({n, Hk, S16 / AJ, D, AJ}, f);
  auto vt = at::zeros({n, Hk, D16, S, 16}, f);
  const auto *kp = (const uint8_t*)kc.data_ptr(), *vp = (const uint8_t*)vc.data_ptr();
  float *ktp = kt.data_ptr<float>(), *vtp = vt.data_ptr<float>();
  at::parallel_for(0, n * Hk, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kr(D), vr(D);
    for (int64_t b = lo; b < hi; ++b) {
      float *kd = ktp + b * S16 * D, *vd = vtp + b * D16 * S * 16;
      for (int64_t j = 0; j < S; ++j) {
        kv_widen(kp + (b * S + j) * hb, fmt, D, kr.data());
        kv_widen(vp + (b * S + j) * hb, fmt, D, vr.data());
        for (int64_t d = 0; d < D; ++d) {
          kd[(j / AJ * D + d) * AJ + j % AJ] = kr[d];
          vd[(d / 16 * S + j) * 16 + d % 16] = vr[d];
        }
      }
    }
  });
  return {kt, vt};
}

at::Tensor attend_tiles(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& vt,
                        const at::Tensor& pos, double scale, int64_t Hk, int64_t S);
}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& pos, double scale) {
  check(q, "q"); check(k, "k"); check(v, "v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "q [n, T, H, D], k and v [n, Hk, S, D]");
  const int64_t n = q.size(0), H = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == n && k.size(3) == D && Hk > 0 && H % Hk == 0 && S > 0,
              "k, v [n, Hk, S, D] with H a multiple of Hk");
  const auto tiles = key_tiles(k, v, KV_F32, D, k.options());
  return attend_tiles(q, tiles.first, tiles.second, pos, scale, Hk, S);
}

// prefill_attention over KV rows as a bfloat16 or fp8 pool stores them (`fmt` KV_BF16 /
// KV_FP8): k, v bytes [n, Hk, S, head bytes] (gathered from the pool as they are,
// `paged.gather_kv`), widened to float32 a row at a time as the kernel lays its key and value
// tiles out; the result is prefill_attention's over the widened values, bit for bit.
at::Tensor prefill_attention_q(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& pos, double scale, int64_t fmt) {
  check(q, "q");
  TORCH_CHECK(fmt == KV_BF16 || fmt == KV_FP8, "prefill_attention_q: fmt 1 (bf16) or 2 (fp8)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() &&
              k.scalar_type() == at::kByte && v.scalar_type() == at::kByte,
              "q [n, T, H, D], k and v bytes [n, Hk, S, head bytes]");
  const int64_t n = q.size(0), H = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == n && k.size(3) == kv_head_bytes(fmt, D) && Hk > 0 && H % Hk == 0
              && S > 0, "k, v [n, Hk, S, head bytes] with H a multiple of Hk");
  const auto tiles = key_tiles(k, v, fmt, D, q.options());
  return attend_tiles(q, tiles.first, tiles.second, pos, scale, Hk, S);
}

namespace {
at::Tensor attend_tiles(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& vt,
                        const at::Tensor& pos, double scale, int64_t Hk, int64_t S) {
  const int64_t n = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 2 && pos.size(0) == n &&
              pos.size(1) == T, "pos long [n, T]");
  const auto qc = q.contiguous();
  const auto pc = pos.contiguous();
  const int64_t rep = H / Hk, S16 = (S + AJ - 1) / AJ * AJ, D16 = (D + 15) / 16;
  const float* qp = qc.data_ptr<float>();
  const float *ktp = kt.data_ptr<float>(), *vtp = vt.data_ptr<float>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  auto out = at::empty({n, T, H, D}, q.options());
  float* op = out.data_ptr<float>();
  const int64_t U = T * rep, tasks = (U + MR - 1) / MR;  // row u: position u / rep, head u % rep
  const float sc = (float)scale, ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n * Hk * tasks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> sbuf(MR * S16), obuf(MR * 16);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t i = task / (Hk * tasks), g = task / tasks % Hk, u0 = task % tasks * MR;
      const int64_t rows = std::min(MR, U - u0);
      const float* qr[MR];
      float* orow[MR];
      int64_t L[MR], tmin[AT], tmax[AT];
      for (int64_t r = 0; r < MR; ++r) {  // a short task repeats its last row
        const int64_t u = u0 + std::min(r, rows - 1), t = u / rep, h = g * rep + u % rep;
        qr[r] = qp + ((i * T + t) * H + h) * D;
        orow[r] = op + ((i * T + t) * H + h) * D;
        L[r] = std::min(std::max(pp[i * T + t] + 1, (int64_t)1), S);
      }
      for (int64_t a = 0; a < AT; ++a) {
        tmin[a] = tmax[a] = L[a * AR];
        for (int64_t r = a * AR + 1; r < (a + 1) * AR; ++r)
          tmin[a] = std::min(tmin[a], L[r]), tmax[a] = std::max(tmax[a], L[r]);
      }
      const int64_t Lmax = *std::max_element(tmax, tmax + AT);
      const float* ktb = ktp + (i * Hk + g) * S16 * D;
      const float* vtb = vtp + (i * Hk + g) * D16 * S * 16;
      // scores: 16 keys x AR rows a register tile, d in order
      for (int64_t jb = 0; jb < Lmax; jb += AJ)
        for (int64_t a = 0; a < AT; ++a) {
          if (jb >= tmax[a]) continue;
          const float* const* qa = qr + a * AR;
          v8 acc[AR][2] = {};
          const float* kb = ktb + jb * D;  // block jb / AJ: [D, AJ]
          for (int64_t d = 0; d < D; ++d) {
            const v8 k0 = load8(kb + d * AJ), k1 = load8(kb + d * AJ + 8);
#pragma GCC unroll 8
            for (int64_t r = 0; r < AR; ++r) {
              const float qd = qa[r][d];
              acc[r][0] = fma8(k0, qd, acc[r][0]);
              acc[r][1] = fma8(k1, qd, acc[r][1]);
            }
          }
          for (int64_t r = 0; r < AR; ++r) {
            store8(sbuf.data() + (a * AR + r) * S16 + jb, acc[r][0]);
            store8(sbuf.data() + (a * AR + r) * S16 + jb + 8, acc[r][1]);
          }
        }
      // softmax numerators in place; 1 / their sum
      float inv[MR];
      for (int64_t r = 0; r < MR; ++r) {
        float* s = sbuf.data() + r * S16;
        const int64_t L8 = (L[r] + 7) / 8 * 8;
        float m = ninf;
        int64_t j0 = 0;
#ifdef __AVX2__
        __m256 mv = _mm256_set1_ps(ninf);  // the max is the same in any order (NaNs aside)
        const __m256 scv = _mm256_set1_ps(sc);
        for (; j0 + 8 <= L[r]; j0 += 8)
          mv = _mm256_max_ps(mv, _mm256_mul_ps(_mm256_loadu_ps(s + j0), scv));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mv);
        for (float x : lanes) m = std::max(m, x);
#endif
        for (int64_t j = j0; j < L[r]; ++j) m = std::max(m, s[j] * sc);
#pragma omp simd
        for (int64_t j = 0; j < L[r]; ++j) s[j] = s[j] * sc - m;
        for (int64_t j = L[r]; j < L8; ++j) s[j] = ninf;
        exp8_(s, L8);
        v8 acc = {};
        for (int64_t j = 0; j < L8; j += 8) acc = acc + load8(s + j);
        inv[r] = 1.f / hsum8(acc);
      }
      // outputs, 16 columns at a time: AR rows x 16 columns a register tile over 64 keys (kept
      // in obuf between passes), j in order; each tile's keys past its shortest row's last
      // go row by row at the end
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t cols = std::min((int64_t)16, D - d0);  // the last block's may be fewer
        const float* vb = vtb + d0 * S;  // [S, 16]
        std::fill(obuf.begin(), obuf.end(), 0.f);
        for (int64_t jb = 0; jb < Lmax; jb += VJ)
          for (int64_t a = 0; a < AT; ++a) {
            const int64_t je = std::min(jb + VJ, tmin[a]);
            if (jb >= je) continue;
            float* ob = obuf.data() + a * AR * 16;
            v8 o[AR][2];
            for (int64_t r = 0; r < AR; ++r) o[r][0] = load8(ob + r * 16), o[r][1] = load8(ob + r * 16 + 8);
            const float* sa = sbuf.data() + a * AR * S16;
            for (int64_t j = jb; j < je; ++j) {
              const float* vr = vb + j * 16;
              const v8 v0 = load8(vr), v1 = load8(vr + 8);
#pragma GCC unroll 8
              for (int64_t r = 0; r < AR; ++r) {
                const float p = sa[r * S16 + j];
                o[r][0] = fma8(v0, p, o[r][0]);
                o[r][1] = fma8(v1, p, o[r][1]);
              }
            }
            for (int64_t r = 0; r < AR; ++r) store8(ob + r * 16, o[r][0]), store8(ob + r * 16 + 8, o[r][1]);
          }
        for (int64_t r = 0; r < rows; ++r) {
          float* ob = obuf.data() + r * 16;
          v8 o0 = load8(ob), o1 = load8(ob + 8);
          for (int64_t j = tmin[r / AR]; j < L[r]; ++j) {
            const float* vr = vb + j * 16;
            const float p = sbuf[r * S16 + j];
            o0 = fma8(load8(vr), p, o0);
            o1 = fma8(load8(vr + 8), p, o1);
          }
          float res[16];
          store8(res, o0 * inv[r]);
          store8(res + 8, o1 * inv[r]);
          std::memcpy(orow[r] + d0, res, cols * sizeof(float));
        }
      }
    }
  });
  return out;
}
}  // namespace
