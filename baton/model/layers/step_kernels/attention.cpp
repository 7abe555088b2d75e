// Paged attention and RMSNorm of the fast decode path (see recurrent.cpp for why these
// kernels exist), and the module's bindings.

#include "common.h"
#include "kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

using namespace baton_step;

namespace {

// sum_d a[d] * b[d] and o[d] += a * x[d] over a head's hd floats: with AVX-512 16 lanes at a
// time in registers when hd is a multiple of 16 (every published head size), else the
// compiler's `omp simd` loop (its generic loop for a run-time hd: the kernel at batch 32, 152
// keys, hd 64, was 3.85 -> 3.45 ms over 4 layers with this). Prefetching key rows ahead was
// measured too and changed nothing, warm or cold: the loop is not waiting on memory.
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t d = 16; d < n; d += 16)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d)));
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}
inline void axpy(float* o, float a, const float* x, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    const __m512 av = _mm512_set1_ps(a);
    for (int64_t d = 0; d < n; d += 16)
      _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_loadu_ps(o + d),
                                            _mm512_mul_ps(av, _mm512_loadu_ps(x + d))));
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) o[d] += a * x[d];
}

using ScoresFn = void (*)(const float*, const float* const*, const float* const*, int64_t,
                          int64_t, int64_t, int64_t, float, float*);
using ValuesFn = void (*)(const float*, const float* const*, int64_t, int64_t, int64_t, float*,
                          bool);

// One register of floats: AVX-512's 16 lanes, or AVX2's 8 (with FMA).
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int N = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using V = __m256;
  static constexpr int N = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// o[r * hd + d] = sum_t sc[r * S + t] * v_t[d] for the group's R heads: C vector columns of
// all R heads in registers at a time (R * C accumulators), one pass over the values per C
// columns (the rows stay in L2 between passes); hd a multiple of Lanes::N * C. Each lane is
// one FMA chain over the keys in order, so the lane width and blocking change no bit.
// `more`: go on from the sums in o (a tile of keys after the previous ones: the same chains).
template <int R, int C>
void group_values(const float* sc, const float* const* vrows, int64_t off, int64_t S, int64_t hd,
                  float* o, bool more) {
  using L = Lanes;
  for (int64_t d0 = 0; d0 < hd; d0 += L::N * C) {
    typename L::V acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = more ? L::load(o + r * hd + d0 + L::N * c) : L::zero();
    for (int64_t t = 0; t < S; ++t) {
      const float* val = vrows[t] + off + d0;
      typename L::V vv[C];
      for (int c = 0; c < C; ++c) vv[c] = L::load(val + L::N * c);
      for (int r = 0; r < R; ++r) {
        const typename L::V p = L::set1(sc[r * S + t]);
        for (int c = 0; c < C; ++c) acc[r][c] = L::fma(p, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) L::store(o + r * hd + d0 + L::N * c, acc[r][c]);
  }
}
#endif

#ifdef __AVX512F__
// Kv heads g0..g1-1, each with its group of R query heads (q: the sequence's heads, R rows of
// hd floats per group, hd a multiple of 16), against key rows krows[0..S):
// sc[h * S + t] = scale * q_h . k_t. A key row is read once, front to back, for every group;
// the R heads of a group share each key load and run R independent FMA chains (a dot at a
// time was a serial chain of adds and a horizontal sum per head and key: latency-bound at ~7
// GB/s of KV). The value row of each key is prefetched to L2 meanwhile, for group_values.
template <int R>
void group_scores(const float* q, const float* const* krows, const float* const* vrows,
                  int64_t g0, int64_t g1, int64_t S, int64_t hd, float scale, float* sc) {
  for (int64_t t = 0; t < S; ++t) {
    // the value row of this key, on its way to L2 for group_values while the scores compute
    for (int64_t l = g0 * hd; l < g1 * hd; l += 16)
      _mm_prefetch((const char*)(vrows[t] + l), _MM_HINT_T1);
    for (int64_t g = g0; g < g1; ++g) {
      const float* key = krows[t] + g * hd;
      const float* qg = q + g * R * hd;
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 16) {
        const __m512 kv = _mm512_loadu_ps(key + d);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + r * hd + d), kv, acc[r]);
      }
      for (int r = 0; r < R; ++r) sc[(g * R + r) * S + t] = _mm512_reduce_add_ps(acc[r]) * scale;
    }
  }
}

template <int R>
void group_values_for(const float* sc, const float* const* vrows, int64_t off, int64_t S,
                      int64_t hd, float* o, bool more) {
  constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // R * C <= 8 accumulators (of 32 zmm)
  if ((hd / 16) % C == 0) group_values<R, C>(sc, vrows, off, S, hd, o, more);
  else group_values<R, 1>(sc, vrows, off, S, hd, o, more);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The score kernel with 8-lane registers and the AVX-512 kernel's order: a score's 16
// lanes are two 8-lane FMA chains (lanes 0-7 and 8-15, k in order), folded as GCC's
// _mm512_reduce_add_ps folds (the halves, the 128-bit halves, {2,3,0,1}, the last two), so
// the scores are the AVX-512 kernel's bits; a value column is an FMA chain per lane over the
// keys in order, so its blocking changes nothing. (The softmax's exp is 8 lanes wide here, so
// a row's tail may round apart from an AVX-512 machine's.) Before them the Zen 2 ran the
// dot-and-axpy loop: batch 32 x ~150 keys, 4 layers of 12 heads on 4 of 64, 6.0 -> 4.5 ms a
// step; batch 1 x 600 keys, 8 heads on 2 of 128, 0.23 -> 0.19 ms a layer.
inline float reduce16(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// N heads of a group against one key row: 2N accumulators (N <= 4: 8 of 16 ymm)
template <int N>
inline void heads_scores(const float* qg, const float* key, int64_t hd, float scale, float* out,
                         int64_t S) {
  __m256 lo[N], hi[N];
  for (int r = 0; r < N; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 16) {
    const __m256 k0 = _mm256_loadu_ps(key + d), k1 = _mm256_loadu_ps(key + d + 8);
    for (int r = 0; r < N; ++r) {
      lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + r * hd + d), k0, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + r * hd + d + 8), k1, hi[r]);
    }
  }
  for (int r = 0; r < N; ++r) out[r * S] = reduce16(lo[r], hi[r]) * scale;
}

template <int R>
void group_scores(const float* q, const float* const* krows, const float* const* vrows,
                  int64_t g0, int64_t g1, int64_t S, int64_t hd, float scale, float* sc) {
  constexpr int A = R < 4 ? R : 4, B = R - A < 4 ? R - A : 4;  // R <= 8: two blocks of heads
  for (int64_t t = 0; t < S; ++t) {
    for (int64_t l = g0 * hd; l < g1 * hd; l += 16)
      _mm_prefetch((const char*)(vrows[t] + l), _MM_HINT_T1);
    for (int64_t g = g0; g < g1; ++g) {
      const float* key = krows[t] + g * hd;
      const float* qg = q + g * R * hd;
      float* out = sc + g * R * S + t;
      heads_scores<A>(qg, key, hd, scale, out, S);
      if constexpr (B > 0) heads_scores<B>(qg + A * hd, key, hd, scale, out + A * S, S);
    }
  }
}

template <int R>
void group_values_for(const float* sc, const float* const* vrows, int64_t off, int64_t S,
                      int64_t hd, float* o, bool more) {
  // R * C <= 8 accumulators (of 16 ymm); past 4 heads, blocks of 4 (a lane's chain is the
  // same in any blocking)
  constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  if constexpr (R > 4) {
    group_values_for<4>(sc, vrows, off, S, hd, o, more);
    group_values_for<R - 4>(sc + 4 * S, vrows, off, S, hd, o + 4 * hd, more);
  } else if ((hd / 8) % C == 0) {
    group_values<R, C>(sc, vrows, off, S, hd, o, more);
  } else {
    group_values<R, 1>(sc, vrows, off, S, hd, o, more);
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

template <int R>
constexpr std::pair<ScoresFn, ValuesFn> group_fns() {
  return {&group_scores<R>, &group_values_for<R>};
}
// R = 1..8 query heads per kv head (every published GQA ratio up to 8); else the loop below
std::pair<ScoresFn, ValuesFn> group_kernels(int64_t rep, int64_t hd) {
  if (hd % 16 != 0) return {nullptr, nullptr};
  switch (rep) {
    case 1: return group_fns<1>();
    case 2: return group_fns<2>();
    case 3: return group_fns<3>();
    case 4: return group_fns<4>();
    case 5: return group_fns<5>();
    case 6: return group_fns<6>();
    case 7: return group_fns<7>();
    case 8: return group_fns<8>();
    default: return {nullptr, nullptr};
  }
}
#else
std::pair<ScoresFn, ValuesFn> group_kernels(int64_t, int64_t) { return {nullptr, nullptr}; }
#endif
}  // namespace

// One query per sequence over paged KV, read through the block tables, after writing the new
// token's k, v [b, kvh, hd] there: q [b, heads, hd]; pool [blocks, 2, tpb, kvh, hd];
// tables [b, >= ceil(len/tpb)]; lens [b] keys per sequence. Without `keys` sequence i reads
// positions 0..lens[i]-1 and writes its token at lens[i]-1; with keys [b, >= lens] (a tree
// verify pass: its prompt, then the storage positions of its path) it reads positions
// keys[i, 0..lens[i]-1] in that order and writes its token at keys[i, lens[i]-1].
// With AVX-512 (or AVX2 + FMA) and hd a multiple of 16, per (sequence, kv head): its R query
// heads' scores against each key row at once, then their outputs R x C vector columns at a
// time in registers (group_scores / group_values). Measured at 1 thread, 4 layers with cold KV
// (8 heads on 2 kv heads of 128; 12 on 4 of 64): batch 32 x 180 keys 6.7 -> 3.2 ms, batch 1
// x 600 keys 0.46 -> 0.30 ms, i.e. from ~7 GB/s of KV to this core's read speed (15-16). The
// fallback (neither, hd not a multiple of 16, more than 8 heads per kv head): per sequence
// every head at once, a dot and an axpy per head and key, each block's keys (then values)
// read front to back, once.
// A bfloat16 or float8_e4m3fn pool (`cache.kv_dtype`): k and v stored as `kv_rows` gives them,
// then paged_attention_q; so the one-call decode layers (layers.cpp, glue.cpp) take any pool.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor pool, const at::Tensor& tables, const at::Tensor& lens,
                           double scale, const c10::optional<at::Tensor>& keys) {
  if (pool.scalar_type() == at::kBFloat16 || pool.scalar_type() == at::kFloat8_e4m3fn) {
    const int64_t fmt = pool.scalar_type() == at::kBFloat16 ? KV_BF16 : KV_FP8;
    const int64_t kvh = pool.size(3), b = q.size(0);
    return paged_attention_q(q, kv_rows(k.reshape({b, kvh, -1}), fmt),
                             kv_rows(v.reshape({b, kvh, -1}), fmt),
                             pool.view(at::kByte), tables, lens, scale, keys, fmt);
  }
  check(q, "q"); check(k, "k"); check(v, "v"); check(pool, "kv pool");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous()
              && pool.is_contiguous(), "q, k, v and the kv pool must be contiguous");
  const int64_t b = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t tpb = pool.size(2), kvh = pool.size(3), rep = heads / kvh;
  const int64_t ts = tables.stride(0), row = kvh * hd;
  TORCH_CHECK(k.numel() == b * row && v.numel() == b * row, "k and v must be [b, kv_heads, hd]");
  const int64_t* kp = keys.has_value() ? keys->data_ptr<int64_t>() : nullptr;
  const int64_t ks = keys.has_value() ? keys->stride(0) : 0;
  TORCH_CHECK(!keys.has_value() || (keys->dim() == 2 && keys->stride(1) == 1
              && keys->size(0) == b), "keys must be [b, S] with contiguous rows");
  // position of key t of sequence i
  auto at_pos = [&](int64_t i, int64_t t) { return kp ? kp[i * ks + t] : t; };
  auto out = at::empty({b, heads * hd}, q.options());
  const float *qp = q.data_ptr<float>();
  float* pp = pool.data_ptr<float>();
  const int64_t *tp = tables.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  // The new token's K and V first (at position len - 1), so every read below sees them.
  for (int64_t i = 0; i < b; ++i) {
    const int64_t p = at_pos(i, lp[i] - 1), blk = tp[i * ts + p / tpb];
    std::copy_n(k.data_ptr<float>() + i * row, row, pp + (blk * 2 * tpb + p % tpb) * row);
    std::copy_n(v.data_ptr<float>() + i * row, row, pp + ((blk * 2 + 1) * tpb + p % tpb) * row);
  }
  const auto fns = group_kernels(rep, hd);
  // Fewer sequences than threads (batch 1 at 2 threads): one task per (sequence, kv head),
  // each reading its heads' part of every row, so the second thread has work too.
  const int64_t parts = b >= at::get_num_threads() ? 1 : kvh, hpp = heads / parts;
  at::parallel_for(0, b * parts, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> sc;
    std::vector<const float*> krows, vrows;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / parts, h0 = (j % parts) * hpp, h1 = h0 + hpp, S = lp[i];
      const float* qi = qp + i * heads * hd;
      float* oi = o + i * heads * hd;
      sc.resize(heads * S);
      if (fns.first != nullptr) {
        krows.resize(S);
        vrows.resize(S);
        for (int64_t t = 0; t < S; ++t) {
          const int64_t pos = at_pos(i, t), blk = tp[i * ts + pos / tpb];
          krows[t] = pp + (blk * 2 * tpb + pos % tpb) * row;
          vrows[t] = pp + ((blk * 2 + 1) * tpb + pos % tpb) * row;
        }
        fns.first(qi, krows.data(), vrows.data(), h0 / rep, h1 / rep, S, hd, (float)scale,
                  sc.data());
      } else {
        for (int64_t t = 0; t < S; ++t) {
          const int64_t pos = at_pos(i, t);
          const float* krow = pp + (tp[i * ts + pos / tpb] * 2 * tpb + pos % tpb) * row;
          for (int64_t h = h0; h < h1; ++h) {
            const float *qh = qi + h * hd, *key = krow + (h / rep) * hd;
            sc[h * S + t] = dot(qh, key, hd) * (float)scale;
          }
        }
      }
      for (int64_t h = h0; h < h1; ++h) {
        float* sr = sc.data() + h * S;
        float mx = -INFINITY, sum = 0.f;
        // the largest score (a vector max: libm's fmaxf was a call a key, 0.3% of a NemotronH
        // batch-32 step); NaN scores make every probability NaN whichever max they give
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < S; ++t) mx = sr[t] > mx ? sr[t] : mx;
        exp_(sr, S, -mx);
        for (int64_t t = 0; t < S; ++t) sum += sr[t];
        for (int64_t t = 0; t < S; ++t) sr[t] = sr[t] / sum;
      }
      if (fns.second != nullptr) {
        for (int64_t g = h0 / rep; g < h1 / rep; ++g)
          fns.second(sc.data() + g * rep * S, vrows.data(), g * hd, S, hd, oi + g * rep * hd,
                     false);
        continue;
      }
      for (int64_t d = h0 * hd; d < h1 * hd; ++d) oi[d] = 0.f;
      for (int64_t t = 0; t < S; ++t) {
        const int64_t pos = at_pos(i, t);
        const float* vals = pp + ((tp[i * ts + pos / tpb] * 2 + 1) * tpb + pos % tpb) * row;
        for (int64_t h = h0; h < h1; ++h) {
          const float pr = sc[h * S + t];
          const float* val = vals + (h / rep) * hd;
          axpy(oi + h * hd, pr, val, hd);
        }
      }
    }
  });
  return out;
}

// Rows x [n, kvh, hd] (float32) as a bfloat16 / fp8 pool stores them, bytes [n, kvh * head
// bytes]: bf16 rounded to nearest even; fp8 [hd values | float32 scale] with scale = max|x| /
// 448 (1 for a zero row) and value = x / scale, clamped to +-448, rounded to nearest even by
// c10's conversion: torch's own `.to(float8_e4m3fn)`, so these are `paged.stored_rows`' bytes
// (tests/unit/model/layers/test_kv_formats.py compares them).
at::Tensor kv_rows(const at::Tensor& x, int64_t fmt) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 3 && (fmt == KV_BF16 || fmt == KV_FP8), "kv_rows: x [n, kvh, hd], fmt 1 or 2");
  const auto xc = x.contiguous();
  const int64_t n = x.size(0), kvh = x.size(1), hd = x.size(2), hb = kv_head_bytes(fmt, hd);
  auto out = at::empty({n, kvh * hb}, x.options().dtype(at::kByte));
  const float* xp = xc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < n * kvh; ++r) {
    const float* xr = xp + r * hd;
    uint8_t* o = op + r * hb;
    if (fmt == KV_BF16) {
      for (int64_t d = 0; d < hd; ++d) {
        const c10::BFloat16 h(xr[d]);
        std::memcpy(o + 2 * d, &h.x, 2);
      }
      continue;
    }
    float amax = 0.f;
    for (int64_t d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(xr[d]));
    const float sc = amax > 0.f ? amax / 448.f : 1.f;
    for (int64_t d = 0; d < hd; ++d) {
      const float y = std::min(std::max(xr[d] / sc, -448.f), 448.f);
      o[d] = c10::Float8_e4m3fn(y).x;
    }
    std::memcpy(o + hd, &sc, 4);
  }
  return out;
}

// paged_attention over a bfloat16 or fp8 KV pool (`fmt` KV_BF16 / KV_FP8, common.h): pool is
// its bytes [blocks, 2, tpb, kvh, head bytes]; k, v the new tokens' rows as stored (bytes
// [b, kvh * head bytes], quantized by the caller: `baton.model.paged.stored_rows`), written
// first as paged_attention writes. Keys and values are widened to float32 KT keys at a time
// inside the loop (value * scale), so no float32 copy of the history is made. A tile's scores
// are the float32 kernel's, and its value sums go on from the previous tile's (group_values
// `more`: the same FMA chains), so the result is paged_attention's over a float32 pool holding
// the widened values, bit for bit, whatever the batch, the threads or the tile.
at::Tensor paged_attention_q(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             at::Tensor pool, const at::Tensor& tables, const at::Tensor& lens,
                             double scale, const c10::optional<at::Tensor>& keys, int64_t fmt) {
  check(q, "q");
  TORCH_CHECK(fmt == KV_BF16 || fmt == KV_FP8, "paged_attention_q: fmt 1 (bf16) or 2 (fp8)");
  TORCH_CHECK(pool.scalar_type() == at::kByte && k.scalar_type() == at::kByte
              && v.scalar_type() == at::kByte, "the kv pool, k and v must be bytes (uint8)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous()
              && pool.is_contiguous() && pool.dim() == 5, "contiguous q, k, v, pool");
  const int64_t b = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t tpb = pool.size(2), kvh = pool.size(3), hb = pool.size(4), rep = heads / kvh;
  TORCH_CHECK(hb == kv_head_bytes(fmt, hd), "pool rows must be ", kv_head_bytes(fmt, hd),
              " bytes");
  const int64_t ts = tables.stride(0), rowb = kvh * hb, row = kvh * hd;
  TORCH_CHECK(k.numel() == b * rowb && v.numel() == b * rowb, "k and v: [b, kv_heads * row]");
  const int64_t* kp = keys.has_value() ? keys->data_ptr<int64_t>() : nullptr;
  const int64_t ks = keys.has_value() ? keys->stride(0) : 0;
  TORCH_CHECK(!keys.has_value() || (keys->dim() == 2 && keys->stride(1) == 1
              && keys->size(0) == b), "keys must be [b, S] with contiguous rows");
  auto at_pos = [&](int64_t i, int64_t t) { return kp ? kp[i * ks + t] : t; };
  auto out = at::empty({b, heads * hd}, q.options());
  const float* qp = q.data_ptr<float>();
  uint8_t* pp = pool.data_ptr<uint8_t>();
  const int64_t *tp = tables.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t p = at_pos(i, lp[i] - 1), blk = tp[i * ts + p / tpb];
    std::copy_n(k.data_ptr<uint8_t>() + i * rowb, rowb, pp + (blk * 2 * tpb + p % tpb) * rowb);
    std::copy_n(v.data_ptr<uint8_t>() + i * rowb, rowb,
                pp + ((blk * 2 + 1) * tpb + p % tpb) * rowb);
  }
  const auto fns = group_kernels(rep, hd);
  constexpr int64_t KT = 64;  // keys widened at a time
  const int64_t parts = b >= at::get_num_threads() ? 1 : kvh, hpp = heads / parts;
  at::parallel_for(0, b * parts, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> sc, tsc(heads * KT), buf(KT * row), tpr(rep * KT);
    std::vector<const float*> rows(KT);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / parts, h0 = (j % parts) * hpp, h1 = h0 + hpp, S = lp[i];
      const int64_t g0 = h0 / rep, g1 = h1 / rep;
      const float* qi = qp + i * heads * hd;
      float* oi = o + i * heads * hd;
      sc.resize(heads * S);
      // widen the tile's rows (kv = 0: keys, 1: values) of this task's kv heads into buf
      auto widen = [&](int64_t t0, int64_t n, int64_t kv) {
        for (int64_t tt = 0; tt < n; ++tt) {
          const int64_t pos = at_pos(i, t0 + tt), blk = tp[i * ts + pos / tpb];
          const uint8_t* src = pp + ((blk * 2 + kv) * tpb + pos % tpb) * rowb;
          for (int64_t g = g0; g < g1; ++g)
            kv_widen(src + g * hb, fmt, hd, buf.data() + tt * row + g * hd);
          rows[tt] = buf.data() + tt * row;
        }
      };
      for (int64_t t0 = 0; t0 < S; t0 += KT) {
        const int64_t n = std::min(KT, S - t0);
        widen(t0, n, 0);
        if (fns.first != nullptr) {
          fns.first(qi, rows.data(), rows.data(), g0, g1, n, hd, (float)scale, tsc.data());
          for (int64_t h = h0; h < h1; ++h)
            std::copy_n(tsc.data() + h * n, n, sc.data() + h * S + t0);
        } else {
          for (int64_t tt = 0; tt < n; ++tt)
            for (int64_t h = h0; h < h1; ++h)
              sc[h * S + t0 + tt] = dot(qi + h * hd, rows[tt] + (h / rep) * hd, hd) * (float)scale;
        }
      }
      for (int64_t h = h0; h < h1; ++h) {  // as paged_attention's softmax
        float* sr = sc.data() + h * S;
        float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < S; ++t) mx = sr[t] > mx ? sr[t] : mx;
        exp_(sr, S, -mx);
        for (int64_t t = 0; t < S; ++t) sum += sr[t];
        for (int64_t t = 0; t < S; ++t) sr[t] = sr[t] / sum;
      }
      for (int64_t d = h0 * hd; d < h1 * hd; ++d) oi[d] = 0.f;
      for (int64_t t0 = 0; t0 < S; t0 += KT) {
        const int64_t n = std::min(KT, S - t0);
        widen(t0, n, 1);
        if (fns.second != nullptr) {
          for (int64_t g = g0; g < g1; ++g) {
            for (int64_t r = 0; r < rep; ++r)
              std::copy_n(sc.data() + (g * rep + r) * S + t0, n, tpr.data() + r * n);
            fns.second(tpr.data(), rows.data(), g * hd, n, hd, oi + g * rep * hd, true);
          }
          continue;
        }
        for (int64_t tt = 0; tt < n; ++tt)
          for (int64_t h = h0; h < h1; ++h)
            axpy(oi + h * hd, sc[h * S + t0 + tt], rows[tt] + (h / rep) * hd, hd);
      }
    }
  });
  return out;
}

// RMSNorm of rows x [..., d]: w * (x * rsqrt(mean(x^2) + eps)) (w already 1 + w for Qwen's),
// into a new contiguous tensor. The rows may be strided, in order (each leading dim's stride
// at least the span of those inside it: q of Qwen's attention is every other hd-run of its
// projection, whose rows are a wider projection's at batch > 1), so a row is normed the same
// way in any batch; None if the channels are not contiguous or the rows out of order.
c10::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, "x");
  TORCH_CHECK(w.is_contiguous(), "rms_norm weight must be contiguous");
  const int64_t d = x.size(-1), n = x.numel() / d, lead = x.dim() - 1;
  if (x.stride(-1) != 1) return c10::nullopt;
  int64_t span = d;  // elements the dims inside the current one cover
  for (int64_t i = lead - 1; i >= 0; --i) {
    if (x.size(i) == 1) continue;
    if (x.stride(i) < span) return c10::nullopt;
    span = x.stride(i) * x.size(i);
  }
  auto out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // rows split over threads from ~16K elements a share (a batch-32 decode step's 32 x 768
  // splits in two: serial, the second thread waited it out 24-32 times a step): a row's sum
  // is the same either way
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
                   [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      int64_t off = 0;  // row i's offset: its index over the leading dims, innermost fastest
      for (int64_t j = lead - 1, r = i; j >= 0; --j) {
        off += (r % x.size(j)) * x.stride(j);
        r /= x.size(j);
      }
      const float* xr = xp + off;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < d; ++c) ss += xr[c] * xr[c];
      const float inv = 1.f / std::sqrt(ss / d + (float)eps);
      float* orow = op + i * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) orow[c] = wp[c] * (xr[c] * inv);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_layers(m);
  m.def("mamba2_step", &mamba2_step);
  m.def("deltanet_step", &deltanet_step);
  m.def("paged_attention", &paged_attention);
  m.def("paged_attention_q", &paged_attention_q);
  m.def("kv_rows", &kv_rows);
  m.def("rms_norm", &rms_norm);
  m.def("swiglu", &swiglu);
  m.def("argmax_rows", &argmax_rows);
  m.def("gated_attention", &gated_attention);
  m.def("sigmoid", &torch_sigmoid_of);
  m.def("conv_silu", &conv_silu);
  m.def("gated_rms_norm", &gated_rms_norm);
  m.def("ssd_decay", &ssd_decay);
  m.def("decay_matmul", &decay_matmul);
  m.def("ssd_carry", &ssd_carry);
  m.def("prefill_exp", &prefill_exp_of);
  m.def("unit_lower_solve", &unit_lower_solve);
  m.def("grouped_mm", &grouped_mm);
  m.def("prefill_gemm_built", &prefill_gemm_built);
  m.def("prefill_gemm", &prefill_gemm);
  m.def("flush_denormals", &flush_denormals);
  m.def("prefill_attention", &prefill_attention);
  m.def("prefill_attention_q", &prefill_attention_q);
}
