// Decode-step kernels of the fast path (BATON_DECODE_PATH=fast): everything a decode step does
// between its linear layers, one call each, for float32 on CPU.
//
// Why C++ and not inductor: a decode step streams ~400 MB of weights through the caches, so
// every call between two linears starts cold; a torch.compile'd call then costs ~200 us of
// cache misses in dynamo's guard and wrapper code alone (60 us hot), and an eager RMSNorm's
// seven ops ~60 us. One pybind call here costs ~10-15 us cold.
//
// The recurrent states are read and written in place in their pool rows through the batch's
// slot ids (no gather / scatter copies), and attention reads keys and values straight from the
// paged pool through the block tables (no index rows, no mask). Each kernel computes each row
// of the batch alone, in a fixed order: a sequence's result does not depend on its batch.
// Rounding differs from the eager reference only in the order of sums (~1e-6 relative), as the
// compiled steps did; tests/unit/engine/test_decode_fast_path.py compares the two paths.

#include "common.h"

using namespace baton_step;

namespace {

// Prefetch the n floats STATE_AHEAD floats (4 KB) past p into L2: a decode step streams every
// live recurrent state once, and ahead of the hardware prefetcher (which stops at each 4 KB
// page) the rows arrive at the memory's streaming speed. Into L2, not L1: an L1 prefetch
// waits for a free fill buffer, and the loop stalled on it (4-5% slower at batch 32).
constexpr int64_t STATE_AHEAD = 1024;
inline void prefetch_ahead(const float* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p + STATE_AHEAD);
  for (int64_t off = 0; off < n * 4; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// Depthwise causal conv of one token over the window [state | x] + silu, then the state
// shifts by one: the window's state is read from src [C, K-1] and the shifted one written to
// dst (the same rows, in place, in plain decode; a verify pass's next position slot else),
// x [C], w [C, K], bias [C] or null -> out [C]; tmp: C floats of scratch.
// With AVX-512 and K == 4 (every published checkpoint) 16 channels at a time: their 16 x 3
// state floats are de-interleaved with permutes, summed in the scalar loop's order (the same
// bits) and interleaved back.
void conv_step(const float* src, float* dst, const float* x, const float* w, const float* bias,
               float* out, float* tmp, int64_t C, int64_t K) {
  int64_t c0 = 0;
#ifdef __AVX512F__
  if (K == 4) {
    // lane j of tap k: element 3j+k of the 48 state floats (k < 3), 4j+k of the 64 weights
    alignas(64) int32_t lo[3][16], hi[3][16], wl[4][16], st[3][16], sh[3][16];
    for (int k = 0; k < 3; ++k)
      for (int j = 0; j < 16; ++j) {
        const int e = 3 * j + k;  // from (a0, a1) when < 32, else a2
        lo[k][j] = e < 32 ? e : 0;
        hi[k][j] = e < 32 ? j : 16 + (e - 32);
      }
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 16; ++j) wl[k][j] = (4 * (j % 8) + k) % 32;  // lanes 0-7 used
    // the shifted state [s1, s2, x] back to 3 interleaved vectors: out element e = 3j+k
    // takes tap k+1 of channel j (x for k == 2)
    for (int v = 0; v < 3; ++v)
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * v + l, j = e / 3, k = e % 3;  // (tap vector k, lane j)
        st[v][l] = k == 0 ? j : 16 + j;                   // pass 1: from (s1, s2)
        sh[v][l] = k == 2 ? 16 + j : l;                   // pass 2: x, else pass 1's lane
      }
    __m512i vlo[3], vhi[3], vwl[4], vst[3], vsh[3];
    for (int k = 0; k < 3; ++k) {
      vlo[k] = _mm512_load_si512(lo[k]); vhi[k] = _mm512_load_si512(hi[k]);
      vst[k] = _mm512_load_si512(st[k]); vsh[k] = _mm512_load_si512(sh[k]);
    }
    for (int k = 0; k < 4; ++k) vwl[k] = _mm512_load_si512(wl[k]);
    for (; c0 + 16 <= C; c0 += 16) {
      const float* s = src + c0 * 3;
      prefetch_ahead(s, 48);
      const __m512 a0 = _mm512_loadu_ps(s), a1 = _mm512_loadu_ps(s + 16),
                   a2 = _mm512_loadu_ps(s + 32);
      const float* wc = w + c0 * 4;
      const __m512 b0 = _mm512_loadu_ps(wc), b1 = _mm512_loadu_ps(wc + 16),
                   b2 = _mm512_loadu_ps(wc + 32), b3 = _mm512_loadu_ps(wc + 48);
      __m512 tap[3], wk[4];
      for (int k = 0; k < 3; ++k)
        tap[k] = _mm512_permutex2var_ps(_mm512_permutex2var_ps(a0, vlo[k], a1), vhi[k], a2);
      for (int k = 0; k < 4; ++k) {
        const __m512 l8 = _mm512_permutex2var_ps(b0, vwl[k], b1),
                     h8 = _mm512_permutex2var_ps(b2, vwl[k], b3);
        wk[k] = _mm512_shuffle_f32x4(l8, h8, 0x44);  // lanes 0-7 of each
      }
      const __m512 xv = _mm512_loadu_ps(x + c0);
      __m512 acc = _mm512_mul_ps(tap[0], wk[0]);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(tap[1], wk[1]));
      acc = _mm512_add_ps(acc, _mm512_mul_ps(tap[2], wk[2]));
      acc = _mm512_add_ps(acc, _mm512_mul_ps(xv, wk[3]));
      if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + c0));
      float* d = dst + c0 * 3;
      for (int v = 0; v < 3; ++v)  // every state float is loaded above before any is stored
        _mm512_storeu_ps(d + 16 * v, _mm512_permutex2var_ps(
            _mm512_permutex2var_ps(tap[1], vst[v], tap[2]), vsh[v], xv));
      _mm512_storeu_ps(out + c0, acc);
    }
  }
#elif defined(__AVX2__)
  if (K == 4) {
    // 8 channels at a time, in lane order ch = (0, 2, 4, 6, 1, 3, 5, 7): the order an 8 x 4
    // transpose by unpacks leaves the weights in. The 8 floats of tap k (3 ch + k of the 24
    // state floats) sit at distinct lanes of the three state vectors (float e at lane e % 8),
    // so two immediate blends gather them into one vector and one permute puts them in lane
    // order. The shifted state is the 24 floats moved down by one (unaligned loads) with x at
    // every third: a permute of x and a blend a vector. 8 permutes for 8 channels, not 20 (on
    // the Zen 2, batch 32, one thread: conv + dt 210 -> 170 us a layer with SiLU's one pass;
    // the rest is the state's and the exps' time).
    static const int ch[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    alignas(32) int32_t ti[3][8];
    for (int k = 0; k < 3; ++k)
      for (int l = 0; l < 8; ++l) ti[k][l] = (3 * ch[l] + k) % 8;
    __m256i vti[3];
    for (int k = 0; k < 3; ++k) vti[k] = _mm256_load_si256((const __m256i*)ti[k]);
    const __m256i to_lanes = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i to_natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    // out vector v, lane l (float 8v + l): x[(8v + l) / 3] where (8v + l) % 3 == 2
    const __m256i xi0 = _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 0, 0),
                  xi1 = _mm256_setr_epi32(2, 0, 0, 3, 0, 0, 4, 0),
                  xi2 = _mm256_setr_epi32(0, 5, 0, 0, 6, 0, 0, 7);
    const __m256i last7 = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, -1, 0);
    for (; c0 + 8 <= C; c0 += 8) {
      const float* s = src + c0 * 3;
      prefetch_ahead(s, 24);
      const __m256 a0 = _mm256_loadu_ps(s), a1 = _mm256_loadu_ps(s + 8),
                   a2 = _mm256_loadu_ps(s + 16);
      // floats 1-8, 9-16, 17-23 (float 24 is the next group's, and x takes its lane)
      const __m256 u0 = _mm256_loadu_ps(s + 1), u1 = _mm256_loadu_ps(s + 9),
                   u2 = _mm256_maskload_ps(s + 17, last7);
      const float* wc = w + c0 * 4;  // [8 channels][4 taps]
      const __m256 b0 = _mm256_loadu_ps(wc), b1 = _mm256_loadu_ps(wc + 8),
                   b2 = _mm256_loadu_ps(wc + 16), b3 = _mm256_loadu_ps(wc + 24);
      const __m256 t0 = _mm256_unpacklo_ps(b0, b1), t1 = _mm256_unpackhi_ps(b0, b1),
                   t2 = _mm256_unpacklo_ps(b2, b3), t3 = _mm256_unpackhi_ps(b2, b3);
      const __m256 w0 = _mm256_shuffle_ps(t0, t2, 0x44), w1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                   w2 = _mm256_shuffle_ps(t1, t3, 0x44), w3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      // tap k's floats 3c + k: from a1 at lanes (1, 4, 7 | 2, 5 | 0, 3, 6), a2 at (2, 5 |
      // 0, 3, 6 | 1, 4, 7), a0 at the rest
      const __m256 tap0 = _mm256_permutevar8x32_ps(
          _mm256_blend_ps(_mm256_blend_ps(a0, a1, 0x92), a2, 0x24), vti[0]);
      const __m256 tap1 = _mm256_permutevar8x32_ps(
          _mm256_blend_ps(_mm256_blend_ps(a0, a1, 0x24), a2, 0x49), vti[1]);
      const __m256 tap2 = _mm256_permutevar8x32_ps(
          _mm256_blend_ps(_mm256_blend_ps(a0, a1, 0x49), a2, 0x92), vti[2]);
      const __m256 xn = _mm256_loadu_ps(x + c0);
      const __m256 xl = _mm256_permutevar8x32_ps(xn, to_lanes);
      __m256 acc = _mm256_mul_ps(tap0, w0);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(tap1, w1));
      acc = _mm256_add_ps(acc, _mm256_mul_ps(tap2, w2));
      acc = _mm256_add_ps(acc, _mm256_mul_ps(xl, w3));
      if (bias) acc = _mm256_add_ps(acc, _mm256_permutevar8x32_ps(_mm256_loadu_ps(bias + c0),
                                                                  to_lanes));
      float* d = dst + c0 * 3;  // every state float is loaded above before any is stored
      _mm256_storeu_ps(d, _mm256_blend_ps(u0, _mm256_permutevar8x32_ps(xn, xi0), 0x24));
      _mm256_storeu_ps(d + 8, _mm256_blend_ps(u1, _mm256_permutevar8x32_ps(xn, xi1), 0x49));
      _mm256_storeu_ps(d + 16, _mm256_blend_ps(u2, _mm256_permutevar8x32_ps(xn, xi2), 0x92));
      _mm256_storeu_ps(out + c0, _mm256_permutevar8x32_ps(acc, to_natural));
    }
  }
#endif
  for (int64_t c = c0; c < C; ++c) {
    const float* st = src + c * (K - 1);
    float* dt = dst + c * (K - 1);
    const float* wc = w + c * K;
    float acc = 0.f;
    for (int64_t k = 0; k < K - 1; ++k) acc += st[k] * wc[k];
    acc += x[c] * wc[K - 1];
    if (bias) acc += bias[c];
    for (int64_t k = 0; k + 1 < K - 1; ++k) dt[k] = st[k + 1];  // st[k+1] is read before
    dt[K - 2] = x[c];                                           // dt[k+1] is written
    out[c] = acc;
  }
  silu_(out, out, tmp, C);
}

// One Mamba2 head's state update and read-out: d[p] = s[p] * dA + dtB * x[p] over the N
// state floats of each of its P rows, y[p] = d[p] . Cm + Dh * x[p]. A decode step streams
// every live state once (~400 KB a layer and request in the 100m): with AVX-512 the rows go
// 16 floats at a time with the state prefetched 4 KB ahead, which keeps this at the memory's
// streaming speed (a third faster than the `omp simd` loop at batch 32 on a Xeon).
inline void ssm_head(const float* s, float* d, const float* x, const float* dtB,
                     const float* Cm, float dA, float Dh, float* y, int64_t P, int64_t N) {
#ifdef __AVX512F__
  if (N % 16 == 0) {
    const __m512 vdA = _mm512_set1_ps(dA);
    for (int64_t p = 0; p < P; ++p, s += N, d += N) {
      const __m512 xv = _mm512_set1_ps(x[p]);
      __m512 acc = _mm512_setzero_ps();
      prefetch_ahead(s, N);
      if (d != s) prefetch_ahead(d, N);
      for (int64_t n = 0; n < N; n += 16) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(s + n), vdA),
                                       _mm512_mul_ps(_mm512_loadu_ps(dtB + n), xv));
        _mm512_storeu_ps(d + n, v);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, _mm512_loadu_ps(Cm + n)));
      }
      y[p] = _mm512_reduce_add_ps(acc) + Dh * x[p];
    }
    return;
  }
#elif defined(__AVX2__)
  if (N % 8 == 0) {  // the same with 8 lanes
    const __m256 vdA = _mm256_set1_ps(dA);
    for (int64_t p = 0; p < P; ++p, s += N, d += N) {
      const __m256 xv = _mm256_set1_ps(x[p]);
      __m256 acc = _mm256_setzero_ps();
      prefetch_ahead(s, N);
      if (d != s) prefetch_ahead(d, N);
      for (int64_t n = 0; n < N; n += 8) {
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s + n), vdA),
                                       _mm256_mul_ps(_mm256_loadu_ps(dtB + n), xv));
        _mm256_storeu_ps(d + n, v);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, _mm256_loadu_ps(Cm + n)));
      }
      const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
      y[p] = _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1))) + Dh * x[p];
    }
    return;
  }
#endif
  for (int64_t p = 0; p < P; ++p, s += N, d += N) {
    const float xv = x[p];
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < N; ++n) {
      const float v = s[n] * dA + dtB[n] * xv;
      d[n] = v;
      acc += v * Cm[n];
    }
    y[p] = acc + Dh * xv;
  }
}

// One gated DeltaNet head's state update and read-out, the state [dk, dv] read from src and
// written to st (the same rows in plain decode): S = decay * S, mem = S^T k,
// delta = (v - mem) * beta, S += k delta^T, o = S^T q. Two passes over the head's rows (the
// second from L1); mem: dv floats of scratch.
inline void delta_head(const float* src, float* st, const float* q, const float* k,
                       const float* v, float decay, float beta, float* mem, float* oh,
                       int64_t dk, int64_t dv) {
  for (int64_t e = 0; e < dv; ++e) mem[e] = 0.f;
  for (int64_t d = 0; d < dk; ++d) {
    const float* old = src + d * dv;
    float* row = st + d * dv;
    const float kd = k[d];
    prefetch_ahead(old, dv);
    if (st != src) prefetch_ahead(row, dv);
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) {
      row[e] = old[e] * decay;
      mem[e] += row[e] * kd;
    }
  }
  for (int64_t e = 0; e < dv; ++e) mem[e] = (v[e] - mem[e]) * beta;  // delta
  for (int64_t e = 0; e < dv; ++e) oh[e] = 0.f;
  for (int64_t d = 0; d < dk; ++d) {
    float* row = st + d * dv;
    const float kd = k[d], qd = q[d];
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) {
      row[e] = row[e] + kd * mem[e];
      oh[e] += row[e] * qd;
    }
  }
}

// delta_head with the state rows 16 floats at a time and mem and o in registers (dv a
// multiple of 16, at most 128): each element takes the same multiplies and adds in the same
// order (the same bits). The scalar loop kept mem and o in memory (they may alias the state
// for the compiler), a store-to-load chain through every row: the head ran at about half the
// memory's streaming speed at batch 32. False where it does not apply.
template <int V>
inline void delta_head_v(const float* src, float* st, const float* q, const float* k,
                         const float* v, float decay, float beta, float* oh, int64_t dk,
                         int64_t dv) {
  __m512 mem[V], o[V];
  const __m512 vdec = _mm512_set1_ps(decay);
  for (int u = 0; u < V; ++u) mem[u] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dk; ++d) {
    const float* old = src + d * dv;
    float* row = st + d * dv;
    const __m512 kd = _mm512_set1_ps(k[d]);
    prefetch_ahead(old, dv);
    if (st != src) prefetch_ahead(row, dv);
    for (int u = 0; u < V; ++u) {
      const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(old + 16 * u), vdec);
      _mm512_storeu_ps(row + 16 * u, r);
      mem[u] = _mm512_add_ps(mem[u], _mm512_mul_ps(r, kd));
    }
  }
  const __m512 vb = _mm512_set1_ps(beta);
  for (int u = 0; u < V; ++u) {
    mem[u] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + 16 * u), mem[u]), vb);  // delta
    o[u] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < dk; ++d) {
    float* row = st + d * dv;
    const __m512 kd = _mm512_set1_ps(k[d]), qd = _mm512_set1_ps(q[d]);
    for (int u = 0; u < V; ++u) {
      const __m512 r = _mm512_add_ps(_mm512_loadu_ps(row + 16 * u), _mm512_mul_ps(kd, mem[u]));
      _mm512_storeu_ps(row + 16 * u, r);
      o[u] = _mm512_add_ps(o[u], _mm512_mul_ps(r, qd));
    }
  }
  for (int u = 0; u < V; ++u) _mm512_storeu_ps(oh + 16 * u, o[u]);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// delta_head with 8-lane vectors for dv a multiple of 8: the 16 ymm registers do not hold mem
// and o of a 128-wide head, so the first pass goes over the rows once per 64 columns (mem in 8
// registers; the head's rows, 64 KB at 128 x 128, are in L2 from the first) and the second
// once per 32 (delta and o in 4 each). Each element takes delta_head's multiplies and adds in
// its order (the same bits).
inline bool delta_head_avx2(const float* src, float* st, const float* q, const float* k,
                            const float* v, float decay, float beta, float* mem, float* oh,
                            int64_t dk, int64_t dv) {
  if (dv % 8 != 0) return false;
  const __m256 vdec = _mm256_set1_ps(decay), vb = _mm256_set1_ps(beta);
  for (int64_t c0 = 0; c0 < dv; c0 += 64) {
    const int64_t nv = std::min((int64_t)8, (dv - c0) / 8);
    __m256 m[8];
    for (int u = 0; u < 8; ++u) m[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dk; ++d) {
      const float* old = src + d * dv + c0;
      float* row = st + d * dv + c0;
      if (c0 == 0) {
        prefetch_ahead(src + d * dv, dv);
        if (st != src) prefetch_ahead(st + d * dv, dv);
      }
      const __m256 kd = _mm256_set1_ps(k[d]);
      for (int u = 0; u < nv; ++u) {
        const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(old + 8 * u), vdec);
        _mm256_storeu_ps(row + 8 * u, r);
        m[u] = _mm256_add_ps(m[u], _mm256_mul_ps(r, kd));
      }
    }
    for (int u = 0; u < nv; ++u)  // delta
      _mm256_storeu_ps(mem + c0 + 8 * u, _mm256_mul_ps(
          _mm256_sub_ps(_mm256_loadu_ps(v + c0 + 8 * u), m[u]), vb));
  }
  for (int64_t c0 = 0; c0 < dv; c0 += 32) {
    const int64_t nv = std::min((int64_t)4, (dv - c0) / 8);
    __m256 dl[4], o[4];
    for (int u = 0; u < 4; ++u) {
      dl[u] = u < nv ? _mm256_loadu_ps(mem + c0 + 8 * u) : _mm256_setzero_ps();
      o[u] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < dk; ++d) {
      float* row = st + d * dv + c0;
      const __m256 kd = _mm256_set1_ps(k[d]), qd = _mm256_set1_ps(q[d]);
      for (int u = 0; u < nv; ++u) {
        const __m256 r = _mm256_add_ps(_mm256_loadu_ps(row + 8 * u), _mm256_mul_ps(kd, dl[u]));
        _mm256_storeu_ps(row + 8 * u, r);
        o[u] = _mm256_add_ps(o[u], _mm256_mul_ps(r, qd));
      }
    }
    for (int u = 0; u < nv; ++u) _mm256_storeu_ps(oh + c0 + 8 * u, o[u]);
  }
  return true;
}
#endif

inline bool delta_head_avx512(const float* src, float* st, const float* q, const float* k,
                              const float* v, float decay, float beta, float* oh, int64_t dk,
                              int64_t dv) {
#ifdef __AVX512F__
  switch (dv) {
    case 16: delta_head_v<1>(src, st, q, k, v, decay, beta, oh, dk, dv); return true;
    case 32: delta_head_v<2>(src, st, q, k, v, decay, beta, oh, dk, dv); return true;
    case 64: delta_head_v<4>(src, st, q, k, v, decay, beta, oh, dk, dv); return true;
    case 128: delta_head_v<8>(src, st, q, k, v, decay, beta, oh, dk, dv); return true;
    default: return false;
  }
#else
  return false;
#endif
}

}  // namespace


// ss[g] = the sum of squares of y's group g (`size` floats from g * size), each summed front
// to back as one scalar chain (the bits of a plain loop), four groups' chains side by side:
// one chain waits out each add's latency (a Mamba2 step's gated norm, batch 32 on the Zen 2:
// 117 -> 77 us a layer with SiLU's one pass).
void group_sums(const float* y, float* ss, int64_t groups, int64_t size) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) {
    const float *y0 = y + g * size, *y1 = y0 + size, *y2 = y1 + size, *y3 = y2 + size;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    for (int64_t c = 0; c < size; ++c) {
      s0 += y0[c] * y0[c];
      s1 += y1[c] * y1[c];
      s2 += y2[c] * y2[c];
      s3 += y3[c] * y3[c];
    }
    ss[g] = s0; ss[g + 1] = s1; ss[g + 2] = s2; ss[g + 3] = s3;
  }
  for (; g < groups; ++g) {
    const float* yg = y + g * size;
    float s0 = 0.f;
    for (int64_t c = 0; c < size; ++c) s0 += yg[c] * yg[c];
    ss[g] = s0;
  }
}

// One token of a Mamba2 layer after in_proj (see fused.mamba2_step for the same ops in torch).
at::Tensor mamba2_step(const at::Tensor& zxbcdt, at::Tensor conv_pool, at::Tensor ssm_pool,
                       const at::Tensor& slots, const at::Tensor& dst_slots,
                       const at::Tensor& conv_w,
                       const c10::optional<at::Tensor>& conv_b, const at::Tensor& dt_bias,
                       const at::Tensor& A_log, const at::Tensor& D, const at::Tensor& norm_w,
                       int64_t inter, int64_t H, int64_t P, int64_t G, int64_t N, double lo,
                       double hi, int64_t group_size, double eps) {
  check(zxbcdt, "zxbcdt"); check(conv_pool, "conv pool"); check(ssm_pool, "ssm pool");
  TORCH_CHECK(conv_pool.is_contiguous() && ssm_pool.is_contiguous() && conv_w.is_contiguous(),
              "pools and conv weight must be contiguous");
  TORCH_CHECK(zxbcdt.stride(1) == 1, "zxbcdt rows must be contiguous");
  const int64_t b = zxbcdt.size(0), C = conv_pool.size(1), K = conv_pool.size(2) + 1;
  const int64_t zs = zxbcdt.stride(0), r = H / G;
  auto xbc = at::empty({b, C}, zxbcdt.options());
  auto dts = at::empty({b, H}, zxbcdt.options());
  auto y = at::empty({b, inter}, zxbcdt.options());
  const float* z = zxbcdt.data_ptr<float>();
  TORCH_CHECK(slots.numel() == b && dst_slots.numel() == b, "one source and one destination "
              "slot per row");
  const int64_t *sl = slots.data_ptr<int64_t>(), *dl = dst_slots.data_ptr<int64_t>();
  float* cp = conv_pool.data_ptr<float>();
  float* sp = ssm_pool.data_ptr<float>();
  const float* bias = conv_b.has_value() ? conv_b->data_ptr<float>() : nullptr;
  const float *wp = conv_w.data_ptr<float>(), *dtb = dt_bias.data_ptr<float>(),
              *al = A_log.data_ptr<float>(), *Dp = D.data_ptr<float>(),
              *nw = norm_w.data_ptr<float>();
  float *xo = xbc.data_ptr<float>(), *dto = dts.data_ptr<float>(), *yo = y.data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> tmp(C);
    for (int64_t i = i0; i < i1; ++i) {
      const float* row = z + i * zs;
      conv_step(cp + sl[i] * C * (K - 1), cp + dl[i] * C * (K - 1), row + inter, wp, bias,
                xo + i * C, tmp.data(), C, K);
      for (int64_t h = 0; h < H; ++h) {
        float dt = softplus(row[inter + C + h] + dtb[h]);
        dto[i * H + h] = std::fmin(std::fmax(dt, (float)lo), (float)hi);
      }
    }
  });
  at::parallel_for(0, b * H, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> dtB(N);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / H, h = j % H, g = h / r;
      const float* out = xo + i * C;
      const float *x = out + h * P, *B = out + H * P + g * N, *Cm = out + H * P + G * N + g * N;
      const float dt = dto[i * H + h];
      const float dA = std::exp(dt * -std::exp(al[h]));
      for (int64_t n = 0; n < N; ++n) dtB[n] = dt * B[n];
      ssm_head(sp + ((sl[i] * H + h) * P) * N, sp + ((dl[i] * H + h) * P) * N, x,
               dtB.data(), Cm, dA, Dp[h], yo + i * inter + h * P, P, N);
    }
  });
  // gated RMSNorm per group of group_size channels: w * norm(y * silu(gate))
  TORCH_CHECK(group_size > 0 && inter % group_size == 0, "mamba2_step: the norm's group size ",
              group_size, " does not divide ", inter, " channels");
  const int64_t groups = inter / group_size;
  at::parallel_for(0, b, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sg(inter), tmp(inter), ss(groups);
    for (int64_t i = i0; i < i1; ++i) {
      const float* gate = z + i * zs;
      float* yr = yo + i * inter;
      silu_(gate, sg.data(), tmp.data(), inter);
      for (int64_t c = 0; c < inter; ++c) yr[c] = yr[c] * sg[c];
      group_sums(yr, ss.data(), groups, group_size);
      for (int64_t g = 0; g < groups; ++g) {
        const float inv = 1.f / std::sqrt(ss[g] / group_size + (float)eps);
        for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c)
          yr[c] = nw[c] * (yr[c] * inv);
      }
    }
  });
  return y;
}

// One token of a gated DeltaNet layer after its projections (see fused.deltanet_step).
at::Tensor deltanet_step(const at::Tensor& qkv, at::Tensor conv_pool, at::Tensor rec_pool,
                         const at::Tensor& slots, const at::Tensor& dst_slots,
                         const at::Tensor& a,
                         const at::Tensor& beta_logit, const at::Tensor& zg,
                         const at::Tensor& conv_w, const at::Tensor& dt_bias,
                         const at::Tensor& A_log, const at::Tensor& norm_w, int64_t hk,
                         int64_t hv, int64_t dk, int64_t dv, double eps) {
  check(qkv, "qkv"); check(conv_pool, "conv pool"); check(rec_pool, "recurrent pool");
  TORCH_CHECK(conv_pool.is_contiguous() && rec_pool.is_contiguous() && conv_w.is_contiguous()
              && qkv.is_contiguous() && a.is_contiguous() && beta_logit.is_contiguous()
              && zg.is_contiguous(), "deltanet step inputs must be contiguous");
  const int64_t b = qkv.size(0), C = conv_pool.size(1), K = conv_pool.size(2) + 1;
  const int64_t r = hv / hk;
  auto act = at::empty({b, C}, qkv.options());
  auto o = at::empty({b, hv * dv}, qkv.options());
  TORCH_CHECK(slots.numel() == b && dst_slots.numel() == b, "one source and one destination "
              "slot per row");
  const int64_t *sl = slots.data_ptr<int64_t>(), *dl = dst_slots.data_ptr<int64_t>();
  float *cp = conv_pool.data_ptr<float>(), *rp = rec_pool.data_ptr<float>();
  float *ac = act.data_ptr<float>(), *op = o.data_ptr<float>();
  const float *qp = qkv.data_ptr<float>(), *ap = a.data_ptr<float>(),
              *bp = beta_logit.data_ptr<float>(), *zp = zg.data_ptr<float>(),
              *wp = conv_w.data_ptr<float>(), *dtb = dt_bias.data_ptr<float>(),
              *al = A_log.data_ptr<float>(), *nw = norm_w.data_ptr<float>();
  auto zs = at::empty({b, hv * dv}, qkv.options());  // silu(z)
  float* zsp = zs.data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> tmp(std::max(C, hv * dv));
    for (int64_t i = i0; i < i1; ++i) {
      float* out = ac + i * C;
      conv_step(cp + sl[i] * C * (K - 1), cp + dl[i] * C * (K - 1), qp + i * C, wp, nullptr,
                out, tmp.data(), C, K);
      silu_(zp + i * hv * dv, zsp + i * hv * dv, tmp.data(), hv * dv);
      // q and k: L2 norm per key head (q also scaled by dk^-0.5)
      for (int64_t part = 0; part < 2; ++part) {
        for (int64_t h = 0; h < hk; ++h) {
          float* v = out + part * hk * dk + h * dk;
          float ss = 0.f;
          for (int64_t d = 0; d < dk; ++d) ss += v[d] * v[d];
          const float inv = 1.f / std::sqrt(ss + 1e-6f);
          const float sc = part == 0 ? (float)std::pow((double)dk, -0.5) : 1.f;
          for (int64_t d = 0; d < dk; ++d) v[d] = part == 0 ? v[d] * inv * sc : v[d] * inv;
        }
      }
    }
  });
  at::parallel_for(0, b * hv, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> mem(dv);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / hv, h = j % hv, kh = h / r;
      const float* out = ac + i * C;
      const float *q = out + kh * dk, *k = out + hk * dk + kh * dk,
                  *v = out + 2 * hk * dk + h * dv;
      const float g = -std::exp(al[h]) * softplus(ap[i * hv + h] + dtb[h]);
      const float decay = std::exp(g), beta = sigmoid(bp[i * hv + h]);
      const float* src = rp + ((sl[i] * hv + h) * dk) * dv;
      float* st = rp + ((dl[i] * hv + h) * dk) * dv;
      float* oh = op + i * hv * dv + h * dv;
      bool done = delta_head_avx512(src, st, q, k, v, decay, beta, oh, dk, dv);
#if defined(__AVX2__) && !defined(__AVX512F__)
      if (!done) done = delta_head_avx2(src, st, q, k, v, decay, beta, mem.data(), oh, dk, dv);
#endif
      if (!done) delta_head(src, st, q, k, v, decay, beta, mem.data(), oh, dk, dv);
      float ss = 0.f;
      for (int64_t e = 0; e < dv; ++e) ss += oh[e] * oh[e];
      const float inv = 1.f / std::sqrt(ss / dv + (float)eps);
      const float* zh = zsp + i * hv * dv + h * dv;
      for (int64_t e = 0; e < dv; ++e) oh[e] = (oh[e] * inv * nw[e]) * zh[e];
    }
  });
  return o;
}

