// A whole MoE feed-forward of one decode step in one call (Qwen's softmax router with its
// gated shared expert, NemotronH's sigmoid router with its relu2 shared expert): the fast
// decode path's Python ran ~25 small ops a MoE layer, ~150-250 us at batch 1. Included by
// gemv.cpp after its kernels (one translation unit), bound there.
//
// Bits: every step is what the Python path (`baton.model.layers.moe`, `qwen_moe`) computes,
// in the same order, with the same kernels: the linears and expert runs on gemv.cpp's
// functions, the router's softmax / sigmoid / top-k / sums and the gated activations on the
// very ATen ops the Python calls (at:: here, so no Python between them), on the same views.
#pragma once

#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>

namespace {

// `moe.sigmoid_by_element`: through a stride-2 view, so every element takes torch's scalar
// sigmoid whatever the row count.
at::Tensor sigmoid_by_element(const at::Tensor& t) {
  at::Tensor spaced = at::empty({t.size(0), 2 * t.size(1)}, t.options()).slice(1, 0, c10::nullopt,
                                                                               2);
  spaced.copy_(t);
  return at::sigmoid(spaced);
}

// relu(y)^2 of rows y [M, W] (any row stride) into a new contiguous [M, W]; exact, as
// torch.square(F.relu(y)) (NaN stays NaN).
at::Tensor relu2_rows(const at::Tensor& y) {
  const int64_t m = y.size(0), w = y.size(1), ys = y.stride(0);
  TORCH_CHECK(y.stride(1) == 1, "cpu kernel: relu2 rows must be contiguous");
  at::Tensor out = at::empty({m, w}, y.options());
  const float* yp = y.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < w; ++j) {
      const float v = yp[i * ys + j] < 0.f ? 0.f : yp[i * ys + j];
      o[i * w + j] = v * v;
    }
  return out;
}

// F.silu(gu[:, :W]) * gu[:, W:] on the column views (torch's ops, so its rounding).
at::Tensor swiglu_views(const at::Tensor& gu) {
  const int64_t w = gu.size(1) / 2;
  return at::mul(at::silu(gu.narrow(1, 0, w)), gu.narrow(1, w, w));
}

// `moe._kernel_experts` with every expert held: sort the pairs, the up run, the activation
// (0: relu2, 1: SwiGLU on [gate | up]), the down run, the weighted sum; the counts are added
// into `routed` (the layer's expert load).
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& experts,
                          const at::Tensor& weights, const at::Tensor& up,
                          const at::Tensor& down, int64_t act, at::Tensor routed) {
  const int64_t held = up.size(0);
  auto sorted = moe_sort(experts, 0, held, held);
  const at::Tensor &pair = sorted[0], &token = sorted[1], &counts = sorted[2];
  TORCH_CHECK(routed.scalar_type() == at::kLong && routed.is_contiguous() &&
              routed.numel() == held, "cpu kernel: routed_tokens must be [E] long");
  int64_t* rp = routed.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t e = 0; e < held; ++e) rp[e] += cp[e];
  at::Tensor ys = grouped_linear(x, up, counts, token, -1);
  ys = act == 0 ? relu2_rows(ys) : swiglu_views(ys);
  ys = grouped_linear(ys, down, counts, c10::nullopt, -1);
  return moe_combine(ys, pair, token, weights.reshape({-1}), x.size(0));
}

// Qwen's MoE block on x [N, d] (`QwenSparseMoe.forward` on the fast path), plus `residual`:
// residual + (routed + sigmoid(shared gate) * shared expert).
at::Tensor qwen_moe(at::Tensor x, at::Tensor gate_w, at::Tensor shared_gate_w,
                    at::Tensor se_gate_w, at::Tensor se_up_w, at::Tensor se_down_w,
                    at::Tensor up, at::Tensor down, int64_t top_k, bool norm,
                    at::Tensor routed, at::Tensor residual) {
  const int64_t e = gate_w.size(0), w = se_gate_w.size(0);
  const at::Tensor y = linear_cat(x, {gate_w, shared_gate_w, se_gate_w, se_up_w}, -1);
  const at::Tensor probs = at::softmax(y.narrow(1, 0, e), -1, at::kFloat);
  auto [weights, experts] = at::topk(probs, top_k, -1, true, true);
  if (norm) weights = at::div(weights, at::sum(weights, {-1}, true));
  const at::Tensor out = routed_experts(x, experts, weights, up, down, 1, routed);
  const at::Tensor se = linear(swiglu_views(y.narrow(1, e + 1, 2 * w)), se_down_w,
                               c10::nullopt, -1, c10::nullopt, false);
  const at::Tensor shared = at::mul(sigmoid_by_element(y.narrow(1, e, 1)), se);
  return at::add(residual, at::add(out, shared));
}

// NemotronH's `E` block on x [N, d] (`MoE.forward` on the fast path, every group kept, no
// latent projection, no biases), plus `residual`: residual + (routed + shared expert).
at::Tensor nemotron_moe(at::Tensor x, at::Tensor router_w, at::Tensor choice_bias,
                        at::Tensor se_up_w, at::Tensor se_down_w, at::Tensor up,
                        at::Tensor down, int64_t top_k, bool norm, double scale,
                        at::Tensor routed, at::Tensor residual) {
  const int64_t e = router_w.size(0), w = se_up_w.size(0);
  const at::Tensor y = linear_cat(x, {router_w, se_up_w}, -1);
  const at::Tensor scores = sigmoid_by_element(y.narrow(1, 0, e));
  const at::Tensor experts = std::get<1>(at::topk(at::add(scores, choice_bias), top_k, -1,
                                                  true, false));
  at::Tensor weights = at::gather(scores, 1, experts);
  if (norm) weights = at::div(weights, at::add(at::sum(weights, {-1}, true), 1e-20));
  weights = at::mul(weights, scale);
  const at::Tensor out = routed_experts(x, experts, weights, up, down, 0, routed);
  const at::Tensor shared = linear(relu2_rows(y.narrow(1, e, w)), se_down_w, c10::nullopt, -1,
                                   c10::nullopt, false);
  return at::add(residual, at::add(out, shared));
}

}  // namespace
