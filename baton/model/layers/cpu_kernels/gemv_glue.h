// Entry points of the gemv kernel for a decode layer's glue (included and bound by gemv.cpp,
// one translation unit: gemv_kernels.h defines the kernels once): every output
// element is computed exactly as `linear` computes it (gemv.cpp's contract), only the outputs
// land where the layer wants them, so the Python between two kernel calls has less to do.

#pragma once

#include "gemv_common.h"

namespace baton_gemv {

// Several weights [N_i, K] on one x, no bias: [x @ W_0^T, x @ W_1^T, ...], each its own
// contiguous [M, N_i] tensor (what `linear_cat`'s column views are, without the views and the
// copies a step kernel needs of them at M > 1); one thread split over all the weights' blocks.
std::vector<at::Tensor> linear_split(at::Tensor x, std::vector<at::Tensor> ws, int64_t isa) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<int64_t> first_block{0};
  std::vector<at::Tensor> ys;
  for (const auto& w : ws) {
    check_w(w, 2, k);
    weight_type(w);
    first_block.push_back(first_block.back() + (w.size(0) + 7) / 8);
    ys.push_back(at::empty({m, w.size(0)}, x.options()));
  }
  if (m == 0 || first_block.back() == 0) return ys;
  std::vector<float*> outs;
  std::vector<int64_t> lds;
  for (auto& y : ys) {
    outs.push_back(y.data_ptr<float>());
    lds.push_back(y.size(1));
  }
  run_weights(x, ws, outs, lds, first_block, isa);
  return ys;
}

}  // namespace baton_gemv
