// A whole MoE feed-forward of one decode step in one call (a softmax router with
// a gated shared expert, a sigmoid group router with a relu2 shared expert): the fast
// decode path's Python ran ~25 small ops a MoE layer, ~150-250 us at batch 1. Included by
// gemv.cpp after its kernels (one translation unit), bound there.
//
// Bits: every step is what the Python path (`baton.model.layers.moe`, `softmax_moe`)
// computes, in the same order, with the same kernels: the linears and expert runs on gemv.cpp's
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

#include "gemv_route.h"

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
  for (int64_t i = 0; i < m; ++i) relu2_span(o + i * w, yp + i * ys, w);
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

// Weight runs of one parallel region: outputs [0, n) of `a` for each job, their 8-output
// blocks split over the threads together (one region where a layer has several runs that
// need only the same inputs), each output computed as `linear` computes it.
struct Job {
  Args a;
  int wt;
  int64_t n;
};

// The threads take equal shares of the cost, not of the blocks: a block costs about its rows
// plus its weight stream (kStream rows' worth), and the shared expert's blocks hold every
// token's row where a routed expert's hold its own tokens' (batch 32 at 2 threads, an even
// split of the blocks left one thread ~2x the other's work: Qwen3.5-MoE's 16 blocks 58 ->
// 68 ms over the module path's ATen ops). Which thread computes a block changes no bit.
void run_jobs(const std::vector<Job>& jobs, int is, int64_t grain) {
  constexpr int64_t kStream = 4;
  std::vector<int64_t> first{0}, cost{0};
  for (const Job& j : jobs) {
    const int64_t nb = (j.n + 7) / 8;
    first.push_back(first.back() + nb);
    cost.push_back(cost.back() + nb * (j.a.m + kStream));
  }
  const int64_t nb = first.back();
  auto blocks = [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      const int64_t lo = std::max(b0, first[i]), hi = std::min(b1, first[i + 1]);
      if (lo < hi)
        run_range(jobs[i].a, is, jobs[i].wt, (lo - first[i]) * 8,
                  std::min((hi - first[i]) * 8, jobs[i].n));
    }
  };
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), (nb + grain - 1) / grain);
  if (parts <= 1 || at::in_parallel_region()) {
    blocks(0, nb);
    return;
  }
  // part p: from the first block whose cost before it reaches p / parts of the total
  std::vector<int64_t> cut{0};
  for (int64_t p = 1, i = 0; p < parts; ++p) {
    const int64_t target = cost.back() * p / parts;
    while (cost[i + 1] < target) ++i;
    const int64_t per = jobs[i].a.m + kStream;
    cut.push_back(std::max(cut.back(), first[i] + (target - cost[i] + per - 1) / per));
  }
  cut.push_back(nb);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) blocks(cut[p], cut[p + 1]);
  });
}

// Rows of x as the kernels read them (gemv_common.h's `padded`): row r of the block is
// src[rows[r]] (or src[r]), k floats then zeros to ld; appended to `buf`, returns its offset.
int64_t pack_rows(std::vector<float>& buf, const float* src, int64_t src_ld,
                  const int64_t* rows, int64_t m, int64_t k, int64_t ld) {
  const int64_t at = static_cast<int64_t>(buf.size());
  buf.resize(at + m * ld);
  for (int64_t i = 0; i < m; ++i)
    pad_row(buf.data() + at + i * ld, src + (rows ? rows[i] : i) * src_ld, k, ld);
  return at;
}

// Whether gemv_route.h's replicas give ATen's bits for a Qwen MoE block of m tokens: torch's
// AVX-512 or AVX2 kernels and a renormalising sum of under 16 weights. (A silu call torch
// splits over its threads is cut where they split it: `swiglu_rows`.)
bool route_applies(int64_t, int64_t top_k, int64_t, int64_t) {
  return baton_route::available() && top_k < 16;
}

// Row i's activation in place of the kernels' padded input: 0 relu2 (src [w]), 1 SwiGLU (src
// [gate w | up w]; `span`: swiglu_rows'); zeros to ld.
void activate_row(const float* src, int64_t w, int act, float* row, int64_t ld, int64_t i,
                  int64_t span) {
  if (act == 1) {
    baton_route::swiglu_rows(src, 2 * w, 1, w, row, i, span);
  } else {
    relu2_span(row, src, w);
  }
  std::memset(row + w, 0, (ld - w) * sizeof(float));
}

// The routed experts of a routing (experts [m, k], weights [m * k]) and a shared expert, in
// two parallel regions: every active expert's up run with the shared expert's up projections
// (`shared_ups`: [gate, up] for SwiGLU, [up] for relu2), then, after the activations (`act`,
// as `activate_row`), every down run with the shared down projection. Outputs: `out` [m, d]
// the weighted sum in moe_combine's order, `sd` [m, d] the shared expert. Each output element
// is computed as gemv.cpp's `linear` computes it, so this is `routed_experts` + the shared
// expert's `linear` calls, bit for bit; `routed` counts the tokens per expert.
void experts_glued(const at::Tensor& x, const at::Tensor& experts, const float* wp,
                   const at::Tensor& up, const at::Tensor& down, int act,
                   const std::vector<at::Tensor>& shared_ups, const at::Tensor& se_down,
                   at::Tensor& routed, std::vector<float>& out, std::vector<float>& sd) {
  const int64_t m = x.size(0), k = x.size(1), e = up.size(0), ws = se_down.size(1);
  const int64_t w = act == 1 ? up.size(1) / 2 : up.size(1), d = down.size(1), is = pick(-1);
  check_w(up, 3, k);
  check_w(down, 3, w);
  check_w(se_down, 2, ws);
  for (const auto& u : shared_ups) check_w(u, 2, k);
  TORCH_CHECK(down.size(0) == e && se_down.size(0) == d && d == k &&
              static_cast<int64_t>(shared_ups.size()) == act + 1 &&
              shared_ups[0].size(0) == ws && shared_ups.back().size(0) == ws,
              "cpu kernel: MoE weights do not fit together");
  TORCH_CHECK(routed.scalar_type() == at::kLong && routed.is_contiguous() &&
              routed.numel() == e, "cpu kernel: routed_tokens must be [E] long");
  auto sorted = moe_sort(experts, 0, e, e);
  const int64_t *pair = sorted[0].data_ptr<int64_t>(), *token = sorted[1].data_ptr<int64_t>(),
                *counts = sorted[2].data_ptr<int64_t>();
  const int64_t pairs = sorted[0].numel(), uw = up.size(1), su = (act + 1) * ws;
  int64_t* tally = routed.data_ptr<int64_t>();
  for (int64_t i = 0; i < e; ++i) tally[i] += counts[i];

  static thread_local std::vector<float> buf;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t ldk = padded_ld(k), ldw = padded_ld(w), lds = padded_ld(ws);
  buf.clear();
  const int64_t xe = pack_rows(buf, xc.data_ptr<float>(), xc.stride(0), token, pairs, k, ldk);
  const int64_t xs = pack_rows(buf, xc.data_ptr<float>(), xc.stride(0), nullptr, m, k, ldk);
  // up: [pairs, uw] by expert run, and the shared [m, su] (gate | up, or up)
  std::vector<float> yu(pairs * uw), syu(m * su);
  const int64_t es = wsize(weight_type(up));
  const char* upp = static_cast<const char*>(up.data_ptr());
  std::vector<Job> jobs;
  for (int64_t x0 = 0, ex = 0; ex < e; x0 += counts[ex], ++ex) {
    if (counts[ex] == 0) continue;
    jobs.push_back({{buf.data() + xe + x0 * ldk, ldk, upp + ex * up.stride(0) * es, up.stride(1),
                     k, yu.data() + x0 * uw, uw, counts[ex], nullptr}, weight_type(up), uw});
  }
  for (size_t i = 0; i < shared_ups.size(); ++i)
    jobs.push_back({{buf.data() + xs, ldk, shared_ups[i].data_ptr(), shared_ups[i].stride(0), k,
                     syu.data() + i * ws, su, m, nullptr}, weight_type(shared_ups[i]), ws});
  run_jobs(jobs, is, grain_blocks(k, 2));
  // the activations, into the down projections' padded rows
  buf.clear();
  buf.resize(pairs * ldw + m * lds);
  const int64_t span = baton_route::thread_span(pairs * w);
  for (int64_t i = 0; i < pairs; ++i)
    activate_row(yu.data() + i * uw, w, act, buf.data() + i * ldw, ldw, i, span);
  float* sact = buf.data() + pairs * ldw;
  const int64_t shared_span = baton_route::thread_span(m * ws);
  for (int64_t i = 0; i < m; ++i)
    activate_row(syu.data() + i * su, ws, act, sact + i * lds, lds, i, shared_span);
  // down: [pairs, d] by expert run, and the shared [m, d]
  std::vector<float> yd(pairs * d);
  sd.assign(m * d, 0.f);
  const int64_t esd = wsize(weight_type(down));
  const char* dp = static_cast<const char*>(down.data_ptr());
  jobs.clear();
  for (int64_t x0 = 0, ex = 0; ex < e; x0 += counts[ex], ++ex) {
    if (counts[ex] == 0) continue;
    jobs.push_back({{buf.data() + x0 * ldw, ldw, dp + ex * down.stride(0) * esd, down.stride(1),
                     w, yd.data() + x0 * d, d, counts[ex], nullptr}, weight_type(down), d});
  }
  jobs.push_back({{sact, lds, se_down.data_ptr(), se_down.stride(0), ws, sd.data(), d, m,
                   nullptr}, weight_type(se_down), d});
  run_jobs(jobs, is, grain_blocks(std::max(w, ws), 2));
  // moe_combine's weighted sum
  out.assign(m * d, 0.f);
  for (int64_t q = 0; q < pairs; ++q) {
    const float wt = wp[pair[q]];
    float* orow = out.data() + token[q] * d;
    const float* yr = yd.data() + q * d;
    for (int64_t j = 0; j < d; ++j) orow[j] = orow[j] + yr[j] * wt;
  }
}

void check_residual(const at::Tensor& residual, int64_t m, int64_t d) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.dim() == 2 &&
              residual.size(0) == m && residual.size(1) == d && residual.stride(1) == 1,
              "cpu kernel: residual must be [", m, ", ", d, "] float32, got ", residual.sizes());
}

// `softmax_moe` where `route_applies`: the router and the shared gate (one small call), the
// routing on gemv_route.h, `experts_glued` (SwiGLU), then residual + (routed + sigmoid(gate)
// * shared).
at::Tensor softmax_moe_glued(const at::Tensor& x, const at::Tensor& gate_w,
                             const at::Tensor& shared_gate_w, const at::Tensor& se_gate_w,
                             const at::Tensor& se_up_w, const at::Tensor& se_down_w,
                             const at::Tensor& up, const at::Tensor& down, int64_t top_k,
                             bool norm, at::Tensor& routed, const at::Tensor& residual) {
  const int64_t m = x.size(0), e = gate_w.size(0), d = x.size(1);
  TORCH_CHECK(up.size(0) == e, "cpu kernel: softmax_moe's router and experts disagree on E");
  check_residual(residual, m, d);
  const at::Tensor r = linear_cat(x, {gate_w, shared_gate_w}, -1);
  const float* rp = r.data_ptr<float>();
  at::Tensor weights = at::empty({m, top_k}, x.options());
  at::Tensor experts = at::empty({m, top_k}, x.options().dtype(at::kLong));
  baton_route::route(rp, e + 1, m, e, top_k, norm, weights.data_ptr<float>(),
                     experts.data_ptr<int64_t>());
  std::vector<float> out, sd;
  experts_glued(x, experts, weights.data_ptr<float>(), up, down, 1, {se_gate_w, se_up_w},
                se_down_w, routed, out, sd);
  at::Tensor res = at::empty({m, d}, x.options());
  float* o = res.data_ptr<float>();
  const float* hp = residual.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    const float g = baton_route::sigmoid(rp[i * (e + 1) + e]);
    const float* hr = hp + i * residual.stride(0);
    for (int64_t j = 0; j < d; ++j)
      o[i * d + j] = hr[j] + (out[i * d + j] + g * sd[i * d + j]);
  }
  return res;
}

// A softmax-routed MoE block on x [N, d] (`SoftmaxMoE.forward` on the fast path), plus
// `residual`: residual + (routed + sigmoid(shared gate) * shared expert): `softmax_moe_glued`
// where `route_applies`, else the module path's ATen ops between the linears.
at::Tensor softmax_moe(at::Tensor x, at::Tensor gate_w, at::Tensor shared_gate_w,
                       at::Tensor se_gate_w, at::Tensor se_up_w, at::Tensor se_down_w,
                       at::Tensor up, at::Tensor down, int64_t top_k, bool norm,
                       at::Tensor routed, at::Tensor residual) {
  const int64_t e = gate_w.size(0), w = se_gate_w.size(0);
  check_x(x);
  if (x.size(0) > 0 && top_k >= 1 && top_k <= e &&
      route_applies(x.size(0), top_k, up.size(1) / 2, w))
    return softmax_moe_glued(x, gate_w, shared_gate_w, se_gate_w, se_up_w, se_down_w, up, down,
                             top_k, norm, routed, residual);
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

// A sigmoid group-routed MoE block on x [N, d] (`MoE.forward` on the fast path, every group
// kept, no latent projection, no biases), plus `residual`: residual + (routed + shared expert). Where
// torch runs its AVX2 or AVX-512 kernels (a renormalising sum of under 16 weights), the
// routing is gemv_route.h's and the projections `experts_glued`'s; else the module path's
// ATen ops.
at::Tensor sigmoid_group_moe(at::Tensor x, at::Tensor router_w, at::Tensor choice_bias,
                             at::Tensor se_up_w, at::Tensor se_down_w, at::Tensor up,
                             at::Tensor down, int64_t top_k, bool norm, double scale,
                             at::Tensor routed, at::Tensor residual) {
  const int64_t e = router_w.size(0), w = se_up_w.size(0), m = x.size(0);
  check_x(x);
  if (m > 0 && top_k >= 1 && top_k <= e && top_k < 16 && baton_route::sigmoid_available() &&
      choice_bias.scalar_type() == at::kFloat && choice_bias.is_contiguous() &&
      choice_bias.numel() == e && up.size(0) == e) {
    check_residual(residual, m, x.size(1));
    const at::Tensor r = linear(x, router_w, c10::nullopt, -1, c10::nullopt, false);
    at::Tensor weights = at::empty({m, top_k}, x.options());
    at::Tensor experts = at::empty({m, top_k}, x.options().dtype(at::kLong));
    baton_route::route_sigmoid(r.data_ptr<float>(), e, m, e, choice_bias.data_ptr<float>(),
                               top_k, norm, static_cast<float>(scale),
                               weights.data_ptr<float>(), experts.data_ptr<int64_t>());
    std::vector<float> out, sd;
    experts_glued(x, experts, weights.data_ptr<float>(), up, down, 0, {se_up_w}, se_down_w,
                  routed, out, sd);
    const int64_t d = x.size(1);
    at::Tensor res = at::empty({m, d}, x.options());
    float* o = res.data_ptr<float>();
    const float* hp = residual.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i) {
      const float* hr = hp + i * residual.stride(0);
      for (int64_t j = 0; j < d; ++j) o[i * d + j] = hr[j] + (out[i * d + j] + sd[i * d + j]);
    }
    return res;
  }
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

// The tests' handles on gemv_route.h: (weights, experts) of a router's logits [M, E] (rows
// contiguous; Qwen's softmax router, NemotronH's sigmoid one), and SwiGLU of rows
// [gate | up]; each what `softmax_moe` / `sigmoid_group_moe` compute where they take
// gemv_route.h.
std::vector<at::Tensor> route_replica(const at::Tensor& logits, int64_t top_k, bool norm) {
  TORCH_CHECK(baton_route::available(), "cpu kernel: the routing replicas need torch's AVX-512 "
              "or AVX2 kernels");
  check_x(logits);
  TORCH_CHECK(logits.stride(1) == 1 && top_k >= 1 && top_k <= logits.size(1),
              "cpu kernel: logits rows must be contiguous and top_k in [1, E]");
  const int64_t m = logits.size(0);
  at::Tensor weights = at::empty({m, top_k}, logits.options());
  at::Tensor experts = at::empty({m, top_k}, logits.options().dtype(at::kLong));
  baton_route::route(logits.data_ptr<float>(), logits.stride(0), m, logits.size(1), top_k, norm,
                     weights.data_ptr<float>(), experts.data_ptr<int64_t>());
  return {weights, experts};
}

std::vector<at::Tensor> route_sigmoid_replica(const at::Tensor& logits, const at::Tensor& bias,
                                              int64_t top_k, bool norm, double scale) {
  TORCH_CHECK(baton_route::sigmoid_available(), "cpu kernel: the sigmoid router's replicas "
              "need torch's AVX2 or AVX-512 kernels");
  check_x(logits);
  const int64_t m = logits.size(0), e = logits.size(1);
  TORCH_CHECK(logits.stride(1) == 1 && top_k >= 1 && top_k <= e && bias.numel() == e &&
              bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "cpu kernel: logits rows contiguous, bias [E] float32, top_k in [1, E]");
  at::Tensor weights = at::empty({m, top_k}, logits.options());
  at::Tensor experts = at::empty({m, top_k}, logits.options().dtype(at::kLong));
  baton_route::route_sigmoid(logits.data_ptr<float>(), logits.stride(0), m, e,
                             bias.data_ptr<float>(), top_k, norm, static_cast<float>(scale),
                             weights.data_ptr<float>(), experts.data_ptr<int64_t>());
  return {weights, experts};
}

at::Tensor swiglu_replica(const at::Tensor& gu) {
  TORCH_CHECK(baton_route::available(), "cpu kernel: the routing replicas need torch's AVX-512 "
              "or AVX2 kernels");
  check_x(gu);
  TORCH_CHECK(gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "cpu kernel: gate_up must be [M, 2W] with contiguous rows");
  const int64_t m = gu.size(0), w = gu.size(1) / 2;
  at::Tensor out = at::empty({m, w}, gu.options());
  baton_route::swiglu_rows(gu.data_ptr<float>(), gu.stride(0), m, w, out.data_ptr<float>());
  return out;
}

}  // namespace
