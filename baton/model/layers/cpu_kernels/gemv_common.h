// What gemv.cpp's bindings share (the argument checks, the padded copy of x, the thread
// split), so the layer-glue entry points of gemv_glue.cpp take the same kernels the same way.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "gemv_kernels.h"

namespace baton_gemv {

// Outputs a thread takes at a time: blocks of 8 (whole register blocks, so a thread's range
// never splits one) holding at least ~64 KiB of weights (a few microseconds of streaming, more
// than waking a thread costs), so tiny layers stay on one thread.
inline int64_t grain_blocks(int64_t k, int64_t es) {
  const int64_t block_bytes = 8 * k * es;
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(block_bytes, 1));
}

// Blocks [0, n) over torch's threads (one per `grain` blocks at most), each thread a contiguous
// share taken from its front in pieces of a 16th of it; a thread done with its own share takes
// `grain` blocks at a time from the back of the others'
// (so a thread the machine slows does less, and each thread still streams its own weights in
// order). fn(b0, b1) runs on whichever thread claims [b0, b1), each block exactly once.
template <class F>
void split_blocks(int64_t n, int64_t grain, const F& fn) {
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(
      at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || n >= (int64_t{1} << 31)) {
    fn(0, n);
    return;
  }
  const auto pack = [](int64_t f, int64_t b) {
    return static_cast<uint64_t>(f) << 32 | static_cast<uint64_t>(b);
  };
  struct alignas(64) Share { std::atomic<uint64_t> v; };  // a cache line each
  std::unique_ptr<Share[]> share(new Share[threads]);
  const int64_t own = std::max(grain, n / threads / 16);
  for (int64_t t = 0; t < threads; ++t)
    share[t].v.store(pack(n * t / threads, n * (t + 1) / threads), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t o = 0; o < threads; ++o) {  // o = 0: its own share, from the front
        std::atomic<uint64_t>& s = share[(t + o) % threads].v;
        uint64_t v = s.load(std::memory_order_relaxed);
        for (;;) {
          const int64_t f = static_cast<int64_t>(v >> 32), b = static_cast<int64_t>(v & 0xffffffffu);
          if (f >= b) break;
          const int64_t lo = o == 0 ? f : std::max(f, b - grain);
          const int64_t hi = o == 0 ? std::min(b, f + own) : b;
          if (s.compare_exchange_weak(v, o == 0 ? pack(hi, b) : pack(f, lo),
                                      std::memory_order_relaxed)) {
            fn(lo, hi);
            v = s.load(std::memory_order_relaxed);
          }
        }
      }
    }
  });
}

inline int weight_type(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kChar:  // packed int8 (baton/model/quant/packed.py): per row, or per 32 columns
      return w.numel() > 0 && i8_grouped(static_cast<const char*>(w.data_ptr())) ? kI8G : kI8;
    case at::kFloat8_e4m3fn: return kF8;  // packed fp8
    case at::kFloat4_e2m1fn_x2:  // packed NVFP4
      TORCH_CHECK(w.size(-1) % kE2M1Group == 0, "cpu kernel: packed NVFP4 weight of width ",
                  w.size(-1), ": a multiple of ", kE2M1Group, " is read");
      return kE2M1;
    case at::kByte:  // packed int4
      TORCH_CHECK(w.size(-1) % kI4Group == 0, "cpu kernel: packed int4 weight of width ",
                  w.size(-1), ": a multiple of ", kI4Group, " is read");
      return kI4;
    default: TORCH_CHECK(false, "cpu kernel: weight dtype ", w.scalar_type(), " not supported");
  }
  return kF32;
}

// A packed int8 / int4 weight marked for the integer path (gemv_int.h): the bit of the
// layout of x its kernel reads (int_need_bit), else 0.
inline int int_weight(const at::Tensor& w) {
  const int wt = weight_type(w);
  return (wt == kI8 || wt == kI8G || wt == kI4) && w.numel() > 0 &&
         int_marked(static_cast<const char*>(w.data_ptr()), wt, w.size(-1)) ? int_need_bit(wt) : 0;
}

inline void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "cpu kernel: x must be 2-d float32 on CPU, got ", x.sizes(), " ", x.scalar_type());
}

inline void check_w(const at::Tensor& w, int64_t dims, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == dims && w.size(dims - 1) == k &&
              w.stride(dims - 1) == 1, "cpu kernel: weight must be ", dims == 2 ? "" : "[E, ",
              "[N, K] with K=", k, " contiguous in K, got ", w.sizes(), " strides ", w.strides());
}

// x padded with zeros to whole 16-lane chunks; one line more a row, so rows a multiple of
// 4 KiB apart (K = 1024, 2048) do not all fall in one L1 set. In a scratch buffer of the
// calling thread, reused call to call (a tensor would cost ~5 ATen calls per matmul: a tenth
// of a small layer's time at batch 1), valid until its next call.
struct Padded {
  const float* p;
  int64_t ld;
};

// A padded row's stride for k floats.
inline int64_t padded_ld(int64_t k) { return (k + kLanes - 1) / kLanes * kLanes + kLanes; }

// One row as the kernels read it: k floats of src, then zeros to ld.
inline void pad_row(float* row, const float* src, int64_t k, int64_t ld) {
  std::memcpy(row, src, k * sizeof(float));
  std::memset(row + k, 0, (ld - k) * sizeof(float));
}

// relu(v)^2 as torch.square(F.relu(v)) rounds it (NaN stays NaN).
inline float relu2(float v) {
  const float r = v < 0.f ? 0.f : v;
  return r * r;
}

// relu2 of n floats of src into dst (dst == src: in place), 4 lanes at a time without a
// branch: the scalar loop's branch on the sign mispredicts about every other element, ~6 ns
// an element (3 ms of a NemotronH batch-32 decode step, 2% of it, on the Zen 2). The lane
// keeps v where !(v < 0) (NaN too) and 0 else, then squares it: relu2()'s bits.
inline void relu2_span(float* dst, const float* src, int64_t n) {
  int64_t j = 0;
  const __m128 zero = _mm_setzero_ps();
  for (; j + 4 <= n; j += 4) {
    const __m128 v = _mm_loadu_ps(src + j);
    const __m128 r = _mm_and_ps(_mm_cmpnlt_ps(v, zero), v);
    _mm_storeu_ps(dst + j, _mm_mul_ps(r, r));
  }
  for (; j < n; ++j) dst[j] = relu2(src[j]);
}

// `rows` (optional, long): row r of the result is x[rows[r]] (MoE: each pair's token).
// Rows that are whole 16-lane chunks already (K % 16 == 0, contiguous in K) and not a
// multiple of 4 KiB apart are read where they are: the copy ran on the calling thread alone,
// ~0.7 ms of a NemotronH batch-32 step (7 MB), which the second thread spent waiting.
inline Padded padded(const at::Tensor& x, const at::Tensor& rows = at::Tensor()) {
  const int64_t m = rows.defined() ? rows.numel() : x.size(0), k = x.size(1);
  if (!rows.defined() && k % kLanes == 0 && x.stride(1) == 1 &&
      (m == 1 || (x.stride(0) >= k && x.stride(0) * 4 % 4096 != 0)))
    return {x.data_ptr<float>(), m == 1 ? k : x.stride(0)};
  const int64_t ldx = padded_ld(k);
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < m * ldx) buf.resize(m * ldx);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const float* src = xc.data_ptr<float>();
  const int64_t* idx = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = idx ? idx[i] : i;
    TORCH_CHECK(r >= 0 && r < x.size(0), "cpu kernel: row ", r, " of x with ", x.size(0));
    pad_row(buf.data() + i * ldx, src + r * xc.stride(0), k, ldx);
  }
  return {buf.data(), ldx};
}

inline int pick(int64_t isa) {
  return isa < 0 || isa > best_isa() ? best_isa() : static_cast<int>(isa);
}

// x @ W_i^T for every weight i into outs[i] (row stride lds[i]), no bias; `first_block` holds
// the running count of each weight's 8-output blocks, all of which split over the threads at
// once (linear_cat's one tensor and linear_split's several: the same outputs, other places).
inline void run_weights(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                        const std::vector<float*>& outs, const std::vector<int64_t>& lds,
                        const std::vector<int64_t>& first_block, int64_t isa) {
  const int64_t m = x.size(0), k = x.size(1);
  const Padded xp = padded(x);
  const int is = pick(isa);
  int need = 0;
  for (const auto& w : ws) need |= int_weight(w);
  const QRows* qr = prepare_int(xp.p, xp.ld, m, k, need, is);
  split_blocks(first_block.back(), grain_blocks(k, 2), [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(b0, first_block[i]), hi = std::min(b1, first_block[i + 1]);
      if (lo >= hi) continue;
      const at::Tensor& w = ws[i];
      const int64_t n = w.size(0);
      Args a{xp.p, xp.ld, w.data_ptr(), w.stride(0), k, outs[i], lds[i], m, nullptr, qr};
      run_range(a, is, weight_type(w), (lo - first_block[i]) * 8,
                std::min((hi - first_block[i]) * 8, n));
    }
  });
}

}  // namespace baton_gemv
