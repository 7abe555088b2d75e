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

at::Tensor linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias,
                     int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cpu kernel: tensors must be on CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "cpu kernel: x must be 2-d float32, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.stride(1) == 1,
              "cpu kernel: weight must be [N, K] with K=", x.size(1), " contiguous in K, got ",
              w.sizes(), " strides ", w.strides());
  int wt;
  switch (w.scalar_type()) {
    case at::kFloat: wt = kF32; break;
    case at::kHalf: wt = kF16; break;
    case at::kBFloat16: wt = kBF16; break;
    default: TORCH_CHECK(false, "cpu kernel: weight dtype ", w.scalar_type(), " not supported");
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "cpu kernel: bias has ", b.numel(), " elements, want ", n);
  }
  // x padded with zeros to whole 16-lane chunks; one line more a row, so rows a multiple of
  // 4 KiB apart (K = 1024, 2048) do not all fall in one L1 set.
  const int64_t ldx = (k + kLanes - 1) / kLanes * kLanes + kLanes;
  at::Tensor xp = at::zeros({m, ldx}, x.options());
  xp.narrow(1, 0, k).copy_(x);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (isa < 0 || isa > best_isa()) isa = best_isa();
  Args a{xp.data_ptr<float>(), ldx, w.data_ptr(), w.stride(0), k, y.data_ptr<float>(), n, m,
         b.defined() ? b.data_ptr<float>() : nullptr};
  const int64_t blocks = (n + 7) / 8;
  at::parallel_for(0, blocks, grain_blocks(k, wt == kF32 ? 4 : 2), [&](int64_t b0, int64_t b1) {
    run_range(a, static_cast<int>(isa), wt, b0 * 8, std::min(b1 * 8, n));
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
  m.def("isa", &isa_name, "the instruction set `linear` uses on this CPU");
}
