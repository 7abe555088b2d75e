// Element-wise glue of a decode layer between its kernel calls (bound in attention.cpp), each
// rounding every element as the torch ops it replaces round it, so the fast path's bits do
// not change: one call instead of several ops and their Python.

#include "common.h"
#include "kernels.h"

using namespace baton_step;


// silu(x) as torch's CPU kernel computes it along a contiguous run of n elements: whole
// chunks of two vectors on its vectorised path (x / (1 + exp(-x)), Sleef's exp; 32 elements
// with AVX-512, 16 with AVX2, the build's -march=native matching torch's CPU capability), the
// tail on its scalar one (std::exp); with neither, every element takes the scalar path.
static void torch_silu(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (const int64_t vec_end = n - n % 32; i < vec_end; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(sign, v));
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (const int64_t vec_end = n - n % 16; i < vec_end; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(sign, v));
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) out[i] = x[i] / (1.f + std::exp(-x[i]));
}

// gu [M, 2W] rows of [gate | up] (SwiGLU's two projections side by side, one kernel call) ->
// [M, W] silu(gate) * up: F.silu(gate) * up on the column views, row by row.
at::Tensor swiglu(const at::Tensor& gu) {
  check(gu, "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "gate_up must be [M, 2W] with contiguous rows, got ", gu.sizes());
  const int64_t m = gu.size(0), w = gu.size(1) / 2, gs = gu.stride(0);
  auto out = at::empty({m, w}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // rows over threads from ~8K elements a share (a batch-32 step's 32 x 1,280: ~40 us of
  // exps the second thread used to wait out); each row's bits do not depend on the split
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / std::max<int64_t>(w, 1)),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float *gr = g + i * gs, *ur = gr + w;
      float* orow = o + i * w;
      torch_silu(gr, orow, w);
      for (int64_t j = 0; j < w; ++j) orow[j] = orow[j] * ur[j];
    }
  });
  return out;
}

// torch.sigmoid along a contiguous run of n elements: whole chunks of two vectors on its
// vectorised path (1 / (1 + exp(0 - x)), Sleef's exp; as torch_silu), the tail on its scalar
// one.
static void torch_sigmoid(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (const int64_t vec_end = n - n % 32; i < vec_end; i += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(zero, _mm512_loadu_ps(x + i)));
    _mm512_storeu_ps(out + i, _mm512_div_ps(one, _mm512_add_ps(e, one)));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (const int64_t vec_end = n - n % 16; i < vec_end; i += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(zero, _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(out + i, _mm256_div_ps(one, _mm256_add_ps(e, one)));
  }
#endif
  for (; i < n; ++i) out[i] = 1.f / (1.f + std::exp(-x[i]));
}

at::Tensor torch_sigmoid_of(const at::Tensor& x) {  // the test's handle on torch_sigmoid
  check(x, "x");
  const at::Tensor xc = x.contiguous();
  auto out = at::empty(xc.sizes(), xc.options());
  torch_sigmoid(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel());
  return out;
}

// rotate-half rotary on the first rot channels of each row of x [b, heads, hd] in place, at
// cos / sin [b, rot]: as `gated_attention.apply_rotary` (each product rounded, then the sum).
static void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t b = x.size(0), heads = x.size(1), hd = x.size(2), rot = cos.size(1);
  const int64_t half = rot / 2;
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  std::vector<float> r(rot);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      float* row = xp + (i * heads + h) * hd;
      const float *c = cp + i * cos.stride(0), *s = sp + i * sin.stride(0);
      for (int64_t j = 0; j < rot; ++j) {
        const float turned = j < half ? -row[j + half] : row[j - half];
        const float a = row[j] * c[j], t = turned * s[j];
        r[j] = a + t;
      }
      std::copy(r.begin(), r.end(), row);
    }
}

// Qwen3.5's gated attention between its projections (`GatedAttention.decode`'s fast branch):
// qg [b, heads * 2hd] (per head [q | gate]), k, v [b, kv_heads * hd] raw projections; q and k
// through their zero-centred RMSNorms (qw, kw: 1 + w) and the rotary at cos / sin [b, rot],
// paged attention (attention.cpp), then times sigmoid(gate): [b, heads * hd].
at::Tensor gated_attention(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& qw, const at::Tensor& kw, double eps,
                           const at::Tensor& cos, const at::Tensor& sin, at::Tensor pool,
                           const at::Tensor& tables, const at::Tensor& lens, double scale,
                           const c10::optional<at::Tensor>& keys) {
  check(qg, "qg"); check(k, "k"); check(v, "v"); check(cos, "cos"); check(sin, "sin");
  const int64_t b = qg.size(0), hd = qw.numel(), heads = qg.size(1) / (2 * hd);
  const int64_t kvh = k.size(1) / hd;
  TORCH_CHECK(qg.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
              cos.stride(1) == 1 && sin.stride(1) == 1 && cos.size(1) <= hd,
              "gated_attention: contiguous projections and rotary tables wanted");
  const at::Tensor q3 = qg.view({b, heads, 2 * hd});
  at::Tensor q = *rms_norm(q3.narrow(2, 0, hd), qw, eps);
  at::Tensor kn = *rms_norm(k.view({b, kvh, hd}), kw, eps);
  rope_(q, cos, sin);
  rope_(kn, cos, sin);
  at::Tensor out = paged_attention(q, kn, v, pool, tables, lens, scale, keys);
  const int64_t n = b * heads * hd;
  std::vector<float> gate(n);  // gate.reshape(b, -1): the contiguous copy torch.sigmoid reads
  const float* g = qg.data_ptr<float>();
  for (int64_t r = 0; r < b * heads; ++r) std::copy_n(g + r * 2 * hd + hd, hd, &gate[r * hd]);
  torch_sigmoid(gate.data(), gate.data(), n);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) o[i] = o[i] * gate[i];
  return out;
}

// Each row's argmax as torch's max(dim=-1).indices gives it on CPU: the first index of the
// row's largest value, or of its first NaN where it has one (-0.0 and 0.0 tie). x [B, V] with
// contiguous rows -> [B] int64. Two passes a row, 8 lanes at a time with AVX2: the largest
// value (NaN lanes left out, and noted), then the first index holding it (or a NaN). Greedy
// sampling's argmax over a batch-32 step's 32 x 16,384 logits: 480 us in max(dim) at one
// thread, 52 here.
at::Tensor argmax_rows(const at::Tensor& x) {
  check(x, "logits");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows: logits must be [B, V > 0] with contiguous rows, got ", x.sizes());
  const int64_t b = x.size(0), n = x.size(1), xs = x.stride(0);
  auto out = at::empty({b}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, b, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = xp + r * xs;
      float m = -INFINITY;
      bool nan = false;
      int64_t i = 0;
#ifdef __AVX2__
      __m256 vm = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
      for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(v, vm);  // a NaN v gives vm back
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vm);
      for (float l : lanes) m = l > m ? l : m;
      nan = _mm256_movemask_ps(vnan) != 0;
#endif
      for (; i < n; ++i) {
        nan = nan || std::isnan(p[i]);
        m = p[i] > m ? p[i] : m;
      }
      i = 0;  // then the first index holding it: the vector loop stops at its block
#ifdef __AVX2__
      const __m256 want = _mm256_set1_ps(m);
      for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                               : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
        if (hit) break;
      }
#endif
      for (; i < n; ++i)
        if (nan ? std::isnan(p[i]) : p[i] == m) break;
      op[r] = i;
    }
  });
  return out;
}
