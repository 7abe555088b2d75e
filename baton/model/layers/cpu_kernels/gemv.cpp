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
// contiguous. Threads split the outputs N into contiguous ranges (torch's OpenMP pool); a
// thread streams its own rows of W once, all M rows of x reusing each block of W from cache,
// and one done early takes blocks from the back of the other's range (`split_blocks`: at 2
// threads the first thread's half ran late, 4.6% of a NemotronH batch-32 pass of the linears
// spent by the second waiting for it; 3.2% with this).

// Only the headers it needs (not torch/extension.h): the JIT build takes ~10 s, not ~40.
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include "gemv_common.h"
#include "gemv_glue.h"  // the layer-glue entry points (bound below)

namespace {
using namespace baton_gemv;

// `residual` [M, N] (optional): y = residual + (x @ W^T + bias), the sum rounded as torch's
// `residual + y` rounds it (a decode layer's output projection and its residual add, one call).
// `relu2`: y = relu(x @ W^T + bias)^2 (NemotronH's MLP activation, torch.square(F.relu(.))).
at::Tensor linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t isa,
                  c10::optional<at::Tensor> residual, bool relu2) {
  check_x(x);
  check_w(w, 2, x.size(1));
  const int wt = weight_type(w);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "cpu kernel: bias has ", b.numel(), " elements, want ", n);
  }
  const bool res = residual.has_value() && residual->defined();
  if (res) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 &&
                residual->size(0) == m && residual->size(1) == n && residual->stride(1) == 1,
                "cpu kernel: residual must be [", m, ", ", n, "] float32, got ",
                residual->sizes());
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Padded xp = padded(x);
  const int is = pick(isa);
  float* yp = y.data_ptr<float>();
  const float* rp = res ? residual->data_ptr<float>() : nullptr;
  const int64_t rs = res ? residual->stride(0) : 0;
  Args a{xp.p, xp.ld, w.data_ptr(), w.stride(0), k, yp, n,
         m, b.defined() ? b.data_ptr<float>() : nullptr,
         prepare_int(xp.p, xp.ld, m, k, int_weight(w), is)};
  const int64_t blocks = (n + 7) / 8;
  split_blocks(blocks, grain_blocks(k, wsize(wt)), [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 8, n1 = std::min(b1 * 8, n);
    run_range(a, is, wt, n0, n1);
    for (int64_t i = 0; relu2 && i < m; ++i)
      relu2_span(yp + i * n + n0, yp + i * n + n0, n1 - n0);
    for (int64_t i = 0; rp && i < m; ++i)
      for (int64_t j = n0; j < n1; ++j) yp[i * n + j] = rp[i * rs + j] + yp[i * n + j];
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
  float* yp = y.data_ptr<float>();
  std::vector<float*> outs;
  for (size_t i = 0; i < ws.size(); ++i) outs.push_back(yp + col[i]);
  run_weights(x, ws, outs, std::vector<int64_t>(ws.size(), total), first_block, isa);
  return y;
}

// Mixture-of-experts runs: x's rows sorted by expert, counts [E] long the rows of each expert
// of the stack w [E, N, K] (summing to M): rows [start_e, start_e + counts[e]) times expert e.
// Each output is computed exactly as `linear(x rows, w[e])` computes it, so a row's result
// does not depend on the other rows of its run. One call for all of a layer's active experts.
at::Tensor grouped_linear(at::Tensor x, at::Tensor w, at::Tensor counts,
                          c10::optional<at::Tensor> rows, int64_t isa) {
  check_x(x);
  at::Tensor ri;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->device().is_cpu(),
                "cpu kernel: rows must be 1-d long on CPU, got ", rows->sizes());
    ri = rows->contiguous();
  }
  const int64_t m = ri.defined() ? ri.numel() : x.size(0), k = x.size(1);
  check_w(w, 3, k);
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong &&
              counts.dim() == 1 && counts.size(0) == w.size(0),
              "cpu kernel: counts must be [E] long on CPU with E=", w.size(0), ", got ",
              counts.sizes(), " ", counts.scalar_type());
  const int wt = weight_type(w);
  const int64_t n = w.size(1);
  at::Tensor c = counts.contiguous();
  const int64_t* cp = c.data_ptr<int64_t>();
  std::vector<int64_t> expert, start, run_rows;  // the active experts' runs
  int64_t at = 0;
  for (int64_t e = 0; e < w.size(0); ++e) {
    TORCH_CHECK(cp[e] >= 0, "cpu kernel: expert ", e, " has ", cp[e], " rows");
    if (cp[e] == 0) continue;
    expert.push_back(e), start.push_back(at), run_rows.push_back(cp[e]);
    at += cp[e];
  }
  TORCH_CHECK(at == m, "cpu kernel: counts hold ", at, " rows, x has ", m);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Padded xp = padded(x, ri);
  const int is = pick(isa);
  const int64_t nb = (n + 7) / 8, es = wsize(wt), ldx = xp.ld;
  const int64_t groups = static_cast<int64_t>(expert.size());
  const char* wp = static_cast<const char*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const float* xpp = xp.p;
  const QRows* qr = prepare_int(xpp, ldx, m, k, int_weight(w), is);
  at::parallel_for(0, groups * nb, grain_blocks(k, es), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const int64_t g = b / nb, end = std::min(b1, (g + 1) * nb);
      Args a{xpp + start[g] * ldx, ldx, wp + expert[g] * w.stride(0) * es, w.stride(1), k,
             yp + start[g] * n, n, run_rows[g], nullptr, qr, start[g]};
      run_range(a, is, wt, (b - g * nb) * 8, std::min((end - g * nb) * 8, n));
      b = end;
    }
  });
  return y;
}

// A MoE layer's routing bookkeeping, with no sort call and no host round trip: experts
// [N, k] long, each token's choices. The (token, choice) pairs p = token * k + choice whose
// expert is held here ([first, first + held) of `total`), ordered by expert and, within one,
// by p (a stable counting sort); returns (pairs [P], their tokens [P], counts [total]: pairs
// per expert over all experts).
std::vector<at::Tensor> moe_sort(at::Tensor experts, int64_t first, int64_t held,
                                 int64_t total) {
  TORCH_CHECK(experts.device().is_cpu() && experts.scalar_type() == at::kLong &&
              experts.dim() == 2, "cpu kernel: experts must be [N, k] long on CPU, got ",
              experts.sizes(), " ", experts.scalar_type());
  TORCH_CHECK(first >= 0 && held >= 0 && first + held <= total, "cpu kernel: experts [", first,
              ", ", first + held, ") not within ", total);
  const at::Tensor e = experts.contiguous();
  const int64_t pairs = e.numel(), k = e.size(1);
  const int64_t* ep = e.data_ptr<int64_t>();
  at::Tensor counts = at::zeros({total}, e.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ep[p] >= 0 && ep[p] < total, "cpu kernel: expert ", ep[p], " of ", total);
    ++cp[ep[p]];
  }
  std::vector<int64_t> next(held + 1, 0);
  for (int64_t i = 0; i < held; ++i) next[i + 1] = next[i] + cp[first + i];
  at::Tensor order = at::empty({next[held]}, e.options()), token = at::empty_like(order);
  int64_t *op = order.data_ptr<int64_t>(), *tp = token.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t i = ep[p] - first;
    if (i < 0 || i >= held) continue;
    const int64_t at = next[i]++;
    op[at] = p, tp[at] = p / k;
  }
  return {order, token, counts};
}

// out [n, d] float32: zeros, then for each sorted pair q in order
// out[token[q]] += ys[q] * weights[pair[q]] (the product rounded, then the sum: what
// `index_add_` of the weighted rows does, in the same order). weights: [N * k] float32.
at::Tensor moe_combine(at::Tensor ys, at::Tensor pair, at::Tensor token, at::Tensor weights,
                       int64_t n) {
  TORCH_CHECK(ys.scalar_type() == at::kFloat && ys.dim() == 2 && weights.scalar_type() ==
              at::kFloat && pair.numel() == ys.size(0) && token.numel() == ys.size(0),
              "cpu kernel: moe_combine wants ys [P, d] and weights float32, P pairs and tokens");
  const at::Tensor y = ys.contiguous(), w = weights.contiguous();
  const at::Tensor pc = pair.contiguous(), tc = token.contiguous();
  const int64_t d = y.size(1), P = y.size(0);
  at::Tensor out = at::zeros({n, d}, y.options());
  const float *yp = y.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t *pp = pc.data_ptr<int64_t>(), *tp = tc.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t q = 0; q < P; ++q) {
    TORCH_CHECK(tp[q] >= 0 && tp[q] < n && pp[q] >= 0 && pp[q] < w.numel(),
                "cpu kernel: pair ", pp[q], " token ", tp[q], " out of range");
    const float wt = wp[pp[q]];
    float* orow = o + tp[q] * d;
    const float* yr = yp + q * d;
    for (int64_t j = 0; j < d; ++j) orow[j] = orow[j] + yr[j] * wt;
  }
  return out;
}

std::string isa_name() {
  const int isa = best_isa();
  return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar";
}

}  // namespace

#include "gemv_moe.h"  // a MoE block in one call, on the functions above (bound below)
#include "gemv_api.h"

namespace {
const baton_api::Gemv kApi{sizeof(baton_api::Gemv), &linear, &baton_gemv::linear_split,
                           &linear_cat, &softmax_moe, &sigmoid_group_moe};
}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T (+ bias), fixed accumulation order (see gemv.cpp)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("isa") = -1,
        py::arg("residual") = py::none(), py::arg("relu2") = false);
  m.def("linear_split", &linear_split, "[x @ w.T for w in ws], one call, each its own tensor",
        py::arg("x"), py::arg("ws"), py::arg("isa") = -1);
  m.def("linear_cat", &linear_cat, "[x @ w.T for w in ws] side by side, one call (gemv.cpp)",
        py::arg("x"), py::arg("ws"), py::arg("isa") = -1);
  m.def("grouped_linear", &grouped_linear, "x's runs of rows times their experts (gemv.cpp)",
        py::arg("x"), py::arg("w"), py::arg("counts"), py::arg("rows") = py::none(),
        py::arg("isa") = -1);
  m.def("moe_sort", &moe_sort, "a MoE layer's pairs sorted by expert, and the expert counts",
        py::arg("experts"), py::arg("first"), py::arg("held"), py::arg("total"));
  m.def("moe_combine", &moe_combine, "the weighted sum of each token's expert rows",
        py::arg("ys"), py::arg("pair"), py::arg("token"), py::arg("weights"), py::arg("n"));
  m.def("softmax_moe", &softmax_moe,
        "residual + a softmax-routed MoE block with a gated shared expert, one call (gemv_moe.h)");
  m.def("sigmoid_group_moe", &sigmoid_group_moe,
        "residual + a sigmoid group-routed MoE block with a relu2 shared expert, one call");
  m.def("route_available", &baton_route::available,
        "whether `softmax_moe` can use gemv_route.h");
  m.def("route_sigmoid_available", &baton_route::sigmoid_available,
        "whether `sigmoid_group_moe` can use gemv_route.h's sigmoid router");
  m.def("route_applies", &route_applies,
        "whether `softmax_moe` of these sizes takes gemv_route.h",
        py::arg("m"), py::arg("top_k"), py::arg("expert_w"), py::arg("shared_w"));
  m.def("route_replica", &route_replica, "a router's weights and experts (gemv_route.h)");
  m.def("route_sigmoid_replica", &route_sigmoid_replica,
        "the sigmoid group router's weights and experts (gemv_route.h)");
  m.def("swiglu_replica", &swiglu_replica, "silu(gate) * up of rows (gemv_route.h)");
  m.def("isa", &isa_name, "the instruction set `linear` uses on this CPU");
  m.def("api", [] { return py::capsule(&kApi, baton_api::kGemvCapsule); },
        "the entry points above as C++ function pointers (gemv_api.h), for the step module");
}
