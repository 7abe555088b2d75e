// Decode-sized linears on CPU: y[M,N] = x[M,K] @ W[N,K]^T (+ bias), W in float32, float16 or
// bfloat16 (upcast exactly), arithmetic in float32. Built by `baton.model.layers.cpu_kernels`.
//
// Exactness contract: output (i, n) is computed the same way whatever M, the row's place in
// the batch, the thread count or the instruction set:
//   16 lanes; lane l accumulates x[i,k] * W[n,k] for k = l, l+16, l+32, ... in that order, one
//   fused multiply-add each, starting from +0 (a K tail is read as zeros in the lanes past K);
//   then s8[l] = a[l] + a[l+8], s4[l] = s8[l] + s8[l+4], s2[l] = s4[l] + s4[l+2],
//   sum = s2[0] + s2[1]; then y = sum + bias[n] (when there is a bias).
// Blocks of rows and outputs only decide which accumulators live in registers together; the
// AVX-512 (one zmm a lane set), AVX2 (two ymm) and plain (std::fma) paths all follow it, so a
// row alone equals the same row inside any batch, bit for bit.
//
// Layout: W is read in place, row-major [N, K] (no repacked copy): each output's K weights are
// contiguous. Threads split the outputs N into contiguous ranges (at::parallel_for, torch's
// OpenMP pool); a thread streams its own rows of W once, all M rows of x reusing each block
// of W from cache.

// Only the headers it needs (not torch/extension.h): the JIT build takes ~10 s, not ~40.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "gemv_kernels.h"

namespace {
using namespace baton_gemv;

// Outputs a thread takes at a time: blocks of 8 (whole register blocks, so a thread's range
// never splits one) holding at least ~64 KiB of weights (a few microseconds of streaming, more
// than waking a thread costs), so tiny layers stay on one thread.
int64_t grain_blocks(int64_t k, int64_t es) {
  const int64_t block_bytes = 8 * k * es;
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(block_bytes, 1));
}

int weight_type(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: TORCH_CHECK(false, "cpu kernel: weight dtype ", w.scalar_type(), " not supported");
  }
  return kF32;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "cpu kernel: x must be 2-d float32 on CPU, got ", x.sizes(), " ", x.scalar_type());
}

void check_w(const at::Tensor& w, int64_t dims, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == dims && w.size(dims - 1) == k &&
              w.stride(dims - 1) == 1, "cpu kernel: weight must be ", dims == 2 ? "" : "[E, ",
              "[N, K] with K=", k, " contiguous in K, got ", w.sizes(), " strides ", w.strides());
}

// x padded with zeros to whole 16-lane chunks; one line more a row, so rows a multiple of
// 4 KiB apart (K = 1024, 2048) do not all fall in one L1 set.
at::Tensor padded(const at::Tensor& x) {
  const int64_t k = x.size(1), ldx = (k + kLanes - 1) / kLanes * kLanes + kLanes;
  at::Tensor xp = at::zeros({x.size(0), ldx}, x.options());
  xp.narrow(1, 0, k).copy_(x);
  return xp;
}

int pick(int64_t isa) { return isa < 0 || isa > best_isa() ? best_isa() : static_cast<int>(isa); }

at::Tensor linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t isa) {
  check_x(x);
  check_w(w, 2, x.size(1));
  const int wt = weight_type(w);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "cpu kernel: bias has ", b.numel(), " elements, want ", n);
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  at::Tensor xp = padded(x);
  const int is = pick(isa);
  Args a{xp.data_ptr<float>(), xp.size(1), w.data_ptr(), w.stride(0), k, y.data_ptr<float>(), n,
         m, b.defined() ? b.data_ptr<float>() : nullptr};
  const int64_t blocks = (n + 7) / 8;
  at::parallel_for(0, blocks, grain_blocks(k, wt == kF32 ? 4 : 2), [&](int64_t b0, int64_t b1) {
    run_range(a, is, wt, b0 * 8, std::min(b1 * 8, n));
  });
  return y;
}

// Several weights [N_i, K] on one x, no bias: y = [x @ W_0^T | x @ W_1^T | ...] [M, sum N_i],
// each output computed exactly as `linear` computes it (x padded once, one thread split over
// all the weights' blocks: one call where a layer has several input projections).
at::Tensor linear_cat(at::Tensor x, std::vector<at::Tensor> ws, int64_t isa) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<int64_t> first_block{0}, col{0};
  for (const auto& w : ws) {
    check_w(w, 2, k);
    weight_type(w);
    first_block.push_back(first_block.back() + (w.size(0) + 7) / 8);
    col.push_back(col.back() + w.size(0));
  }
  const int64_t total = col.back();
  at::Tensor y = at::empty({m, total}, x.options());
  if (m == 0 || total == 0) return y;
  at::Tensor xp = padded(x);
  const int is = pick(isa);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, first_block.back(), grain_blocks(k, 2), [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(b0, first_block[i]), hi = std::min(b1, first_block[i + 1]);
      if (lo >= hi) continue;
      const at::Tensor& w = ws[i];
      const int64_t n = w.size(0);
      Args a{xp.data_ptr<float>(), xp.size(1), w.data_ptr(), w.stride(0), k, yp + col[i], total,
             m, nullptr};
      run_range(a, is, weight_type(w), (lo - first_block[i]) * 8,
                std::min((hi - first_block[i]) * 8, n));
    }
  });
  return y;
}

// Mixture-of-experts runs: x's rows sorted by expert, counts [E] long the rows of each expert
// of the stack w [E, N, K] (summing to M): rows [start_e, start_e + counts[e]) times expert e.
// Each output is computed exactly as `linear(x rows, w[e])` computes it, so a row's result
// does not depend on the other rows of its run. One call for all of a layer's active experts.
at::Tensor grouped_linear(at::Tensor x, at::Tensor w, at::Tensor counts, int64_t isa) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1);
  check_w(w, 3, k);
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong &&
              counts.dim() == 1 && counts.size(0) == w.size(0),
              "cpu kernel: counts must be [E] long on CPU with E=", w.size(0), ", got ",
              counts.sizes(), " ", counts.scalar_type());
  const int wt = weight_type(w);
  const int64_t n = w.size(1);
  at::Tensor c = counts.contiguous();
  const int64_t* cp = c.data_ptr<int64_t>();
  std::vector<int64_t> expert, start, rows;  // the active experts' runs
  int64_t at = 0;
  for (int64_t e = 0; e < w.size(0); ++e) {
    TORCH_CHECK(cp[e] >= 0, "cpu kernel: expert ", e, " has ", cp[e], " rows");
    if (cp[e] == 0) continue;
    expert.push_back(e), start.push_back(at), rows.push_back(cp[e]);
    at += cp[e];
  }
  TORCH_CHECK(at == m, "cpu kernel: counts hold ", at, " rows, x has ", m);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  at::Tensor xp = padded(x);
  const int is = pick(isa);
  const int64_t nb = (n + 7) / 8, es = wt == kF32 ? 4 : 2, ldx = xp.size(1);
  const int64_t groups = static_cast<int64_t>(expert.size());
  const char* wp = static_cast<const char*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const float* xpp = xp.data_ptr<float>();
  at::parallel_for(0, groups * nb, grain_blocks(k, es), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const int64_t g = b / nb, end = std::min(b1, (g + 1) * nb);
      Args a{xpp + start[g] * ldx, ldx, wp + expert[g] * w.stride(0) * es, w.stride(1), k,
             yp + start[g] * n, n, rows[g], nullptr};
      run_range(a, is, wt, (b - g * nb) * 8, std::min((end - g * nb) * 8, n));
      b = end;
    }
  });
  return y;
}

std::string isa_name() {
  const int isa = best_isa();
  return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar";
}

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T (+ bias), fixed accumulation order (see gemv.cpp)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("isa") = -1);
  m.def("linear_cat", &linear_cat, "[x @ w.T for w in ws] side by side, one call (gemv.cpp)",
        py::arg("x"), py::arg("ws"), py::arg("isa") = -1);
  m.def("grouped_linear", &grouped_linear, "x's runs of rows times their experts (gemv.cpp)",
        py::arg("x"), py::arg("w"), py::arg("counts"), py::arg("isa") = -1);
  m.def("isa", &isa_name, "the instruction set `linear` uses on this CPU");
}
