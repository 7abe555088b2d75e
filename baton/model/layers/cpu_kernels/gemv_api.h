// The gemv module's decode entry points as a table of C++ function pointers, handed to the
// step module's layer runner (step_kernels/layers.cpp) in a capsule (`gemv.api()`), so a
// whole decode step's layers run in one call from Python with no Python between kernels.
// Both builds list this header, so a change to it rebuilds both; `size` guards the layout.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace baton_api {

constexpr const char* kGemvCapsule = "baton.gemv_api";

struct Gemv {
  int64_t size;  // sizeof(Gemv) where the table was filled
  at::Tensor (*linear)(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t isa,
                       c10::optional<at::Tensor> residual, bool relu2);
  std::vector<at::Tensor> (*linear_split)(at::Tensor x, std::vector<at::Tensor> ws,
                                          int64_t isa);
  at::Tensor (*linear_cat)(at::Tensor x, std::vector<at::Tensor> ws, int64_t isa);
  at::Tensor (*softmax_moe)(at::Tensor x, at::Tensor gate_w, at::Tensor shared_gate_w,
                            at::Tensor se_gate_w, at::Tensor se_up_w, at::Tensor se_down_w,
                            at::Tensor up, at::Tensor down, int64_t top_k, bool norm,
                            at::Tensor routed, at::Tensor residual);
  at::Tensor (*sigmoid_group_moe)(at::Tensor x, at::Tensor router_w, at::Tensor choice_bias,
                                  at::Tensor se_up_w, at::Tensor se_down_w, at::Tensor up,
                                  at::Tensor down, int64_t top_k, bool norm, double scale,
                                  at::Tensor routed, at::Tensor residual);
};

}  // namespace baton_api
