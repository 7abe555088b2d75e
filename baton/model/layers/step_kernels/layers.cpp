// A decode step's layers in one call (`DecodeLayers`, built by baton.model.layers.fast_decode):
// the same kernel calls, on the same inputs and in the same order, as the per-part closures of
// fast_blocks.py made from Python, so the bits are the closures' (and the module path's); only
// the Python between the calls is gone (~1.5 ms of a 30 ms batch-1 step on the Zen 2: the
// interpreter, pybind's argument parsing and tensor wrapping, with caches cold after every
// weight stream). The gemv module's kernels come in through its function table (gemv_api.h).
//
// A program is a list of parts, each `h = h + body(rms_norm(h))`: a mixer (DeltaNet, Mamba2,
// gated or plain paged attention, each with its output projection and the residual add in one
// `linear`) or a feed-forward (SwiGLU, relu2 MLP, a softmax- or sigmoid-group-routed MoE block). A part's
// tensors, integers and floats are given once, in the order `body` reads them (`Part`); a
// step passes what changes: h, the state slots and the attention metadata.
//
// `run_rows` is a speculative verify pass on the same program (baton.engine.speculative.
// kernel_verify): the rows are several positions of each request, every row-wise kernel runs
// over all of them at once as in `run` (a row's bits do not depend on the rows beside it), and
// a recurrent part steps its kernel once per position over the rows that have one (`RowStep`:
// the rows, the slot each reads and the slot it writes), in order, as the Python verify pass
// (`kernel_verify.recurrent_rows`) calls the same kernels.

#include "common.h"
#include "kernels.h"

#include "gemv_api.h"

#include <pybind11/stl.h>

#include <tuple>

using namespace baton_step;
namespace py = pybind11;

namespace {

// What a part's body is; the tensors / ints / floats each reads, in order (t[0] is always the
// part's norm weight and f[0] its eps; "?" marks a tensor that may be None):
enum Kind : int64_t {
  kDeltaNet = 1,     // t: norm, qkv_w, a_w, b_w, z_w, out_w, out_b?, conv, rec, conv_w,
                     //    dt_bias, A_log, gate_norm_w   i: hk, hv, dk, dv   f: eps, norm_eps
  kMamba2 = 2,       // t: norm, in_w, in_b?, out_w, out_b?, conv, ssm, conv_w, conv_b?, dt_bias,
                     //    A_log, D, gate_norm_w   i: inter, H, P, G, N, group   f: eps, lo, hi,
                     //    norm_eps
  kGatedAttn = 3,    // t: norm, q_w, k_w, v_w, q_norm, k_norm, kv pool, out_w, out_b?
                     //    f: eps, qk_eps, scale   (the step's cos / sin)
  kAttention = 4,    // t: norm, q_w, k_w, v_w, kv pool, out_w, out_b?   i: heads, hd
                     //    f: eps, scale
  kSwiGLU = 5,       // t: norm, gate_w, up_w, down_w   f: eps
  kRelu2 = 6,        // t: norm, up_w, up_b?, down_w, down_b?   f: eps
  kSoftmaxMoE = 7,   // t: norm, gate, shared_gate, se_gate, se_up, se_down, up, down,
                     //    routed   i: top_k, norm_topk   f: eps
  kSigmoidGroupMoE = 8,  // t: norm, router, choice_bias, se_up, se_down, up, down, routed
                         //    i: top_k, norm_topk   f: eps, routed_scaling
};

constexpr int kTensors[] = {0, 13, 13, 9, 7, 4, 5, 9, 8};
constexpr int kInts[] = {0, 4, 6, 0, 2, 0, 0, 2, 2};
constexpr int kFloats[] = {0, 2, 4, 3, 2, 1, 1, 1, 2};
constexpr uint32_t kOptional[] = {0, 1u << 6, 1u << 2 | 1u << 4 | 1u << 8, 1u << 8, 1u << 6, 0,
                                   1u << 2 | 1u << 4, 0, 0};  // the "?" tensors, by position
constexpr int64_t kKinds = 8;

struct Part {
  Kind kind;
  std::vector<c10::optional<at::Tensor>> t;
  std::vector<int64_t> i;
  std::vector<double> f;
  const at::Tensor& T(size_t n) const { return *t[n]; }
};

// One position of a verify pass (`run_rows`): its rows of the pass (all of them when `all`,
// the range [lo, hi) when lo >= 0, else the gathered `rows`), per row the slot its state is
// read from and the slot the next state is written to.
struct RowStep {
  c10::optional<at::Tensor> rows;
  int64_t lo, hi;
  bool all;
  at::Tensor src, dst;
};

// The per-step inputs: the state slots of the batch's rows, the attention metadata
// (`AttnMeta`: tables, lens, keys) and the rotary tables of gated attention.
struct Step {
  const at::Tensor& slots;
  const c10::optional<at::Tensor>& tables;
  const c10::optional<at::Tensor>& lens;
  const c10::optional<at::Tensor>& keys;
  const c10::optional<at::Tensor>& cos;
  const c10::optional<at::Tensor>& sin;
  const std::vector<RowStep>* steps = nullptr;  // a verify pass (`run_rows`), else null
};

class DecodeLayers {
 public:
  explicit DecodeLayers(const py::capsule& gemv) {
    TORCH_CHECK(std::string(gemv.name()) == baton_api::kGemvCapsule,
                "DecodeLayers wants the gemv module's api() capsule");
    g_ = gemv.get_pointer<const baton_api::Gemv>();
    TORCH_CHECK(g_->size == static_cast<int64_t>(sizeof(baton_api::Gemv)),
                "the gemv and step modules were built against different gemv_api.h");
  }

  void add(int64_t kind, std::vector<c10::optional<at::Tensor>> t, std::vector<int64_t> i,
           std::vector<double> f) {
    TORCH_CHECK(kind >= 1 && kind <= kKinds, "DecodeLayers: no part kind ", kind);
    TORCH_CHECK(t.size() == static_cast<size_t>(kTensors[kind]) &&
                i.size() == static_cast<size_t>(kInts[kind]) &&
                f.size() == static_cast<size_t>(kFloats[kind]),
                "DecodeLayers: part kind ", kind, " takes ", kTensors[kind], " tensors, ",
                kInts[kind], " ints and ", kFloats[kind], " floats; got ", t.size(), ", ",
                i.size(), ", ", f.size());
    for (size_t n = 0; n < t.size(); ++n)
      TORCH_CHECK(t[n].has_value() || (kOptional[kind] >> n & 1u),
                  "DecodeLayers: part kind ", kind, " needs tensor ", n);
    parts_.push_back(Part{static_cast<Kind>(kind), std::move(t), std::move(i), std::move(f)});
  }

  // Part n's body alone on x (already normed) and h: a feed-forward's (a mixer's reads the
  // step's slots and metadata, which this does not take).
  at::Tensor body_of(int64_t n, const at::Tensor& x, const at::Tensor& h) const {
    TORCH_CHECK(n >= 0 && n < size(), "DecodeLayers: no part ", n);
    const at::Tensor none;
    const c10::optional<at::Tensor> absent;
    return body(parts_[n], x, h, Step{none, absent, absent, absent, absent, absent});
  }

  int64_t size() const { return static_cast<int64_t>(parts_.size()); }

  // h [B, hidden] through every part; the GIL is released (nothing here touches Python).
  at::Tensor run(at::Tensor h, const at::Tensor& slots, const c10::optional<at::Tensor>& tables,
                 const c10::optional<at::Tensor>& lens, const c10::optional<at::Tensor>& keys,
                 const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
    const Step s{slots, tables, lens, keys, cos, sin};
    py::gil_scoped_release unlocked;
    return through(h, s);
  }

  // A verify pass: h [R, hidden] (rows ordered by request, then position) through every part,
  // the recurrent parts position by position (`RowStep`, see the file's head).
  at::Tensor run_rows(at::Tensor h,
                      const std::vector<std::tuple<c10::optional<at::Tensor>, int64_t, int64_t,
                                                   bool, at::Tensor, at::Tensor>>& steps,
                      const c10::optional<at::Tensor>& tables,
                      const c10::optional<at::Tensor>& lens,
                      const c10::optional<at::Tensor>& keys,
                      const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
    std::vector<RowStep> rs;
    rs.reserve(steps.size());
    for (const auto& t : steps)
      rs.push_back(RowStep{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t),
                           std::get<4>(t), std::get<5>(t)});
    TORCH_CHECK(!rs.empty(), "DecodeLayers.run_rows: no steps");
    const at::Tensor none;
    const Step s{none, tables, lens, keys, cos, sin, &rs};
    py::gil_scoped_release unlocked;
    return through(h, s);
  }

 private:
  // h through every part (the GIL released by the caller): a decode step or a verify pass.
  at::Tensor through(at::Tensor h, const Step& s) const {
    for (const Part& p : parts_) {
      c10::optional<at::Tensor> x = rms_norm(h, p.T(0), p.f[0]);
      TORCH_CHECK(x.has_value(), "DecodeLayers: h must be contiguous rows");
      h = body(p, *x, h, s);
    }
    return h;
  }

  // A recurrent part's kernel over the pass's rows (`s.steps`) or, in a decode step, once
  // over the batch in its slots: `step(inputs of the rows, src, dst)`.
  template <class F>
  static at::Tensor stepwise(const Step& s, const std::vector<at::Tensor>& inputs, F step) {
    if (s.steps == nullptr) return step(inputs, s.slots, s.slots);
    at::Tensor y;
    std::vector<at::Tensor> part(inputs.size());
    for (const RowStep& r : *s.steps) {
      for (size_t n = 0; n < inputs.size(); ++n)
        part[n] = r.all ? inputs[n]
                  : r.lo >= 0 ? inputs[n].slice(0, r.lo, r.hi)
                              : inputs[n].index_select(0, *r.rows);
      at::Tensor out = step(part, r.src, r.dst);
      if (r.all) {
        y = out;
        continue;
      }
      if (!y.defined()) y = at::empty({inputs[0].size(0), out.size(1)}, out.options());
      if (r.lo >= 0)
        y.slice(0, r.lo, r.hi).copy_(out);
      else
        y.index_copy_(0, *r.rows, out);
    }
    return y;
  }

  static void need_tables(const Step& s) {
    TORCH_CHECK(s.tables.has_value() && s.lens.has_value(),
                "DecodeLayers: an attention part needs the step's tables and lens");
  }

  at::Tensor body(const Part& p, const at::Tensor& x, const at::Tensor& h, const Step& s) const {
    const auto& t = p.t;
    switch (p.kind) {
      case kDeltaNet: {
        auto y = g_->linear_split(x, {p.T(1), p.T(2), p.T(3), p.T(4)}, -1);
        at::Tensor o = stepwise(s, {y[0], y[1], y[2], y[3]},
                                [&](const std::vector<at::Tensor>& in, const at::Tensor& src,
                                    const at::Tensor& dst) {
          return deltanet_step(in[0], p.T(7), p.T(8), src, dst, in[1], in[2], in[3], p.T(9),
                               p.T(10), p.T(11), p.T(12), p.i[0], p.i[1], p.i[2], p.i[3],
                               p.f[1]);
        });
        return g_->linear(o, p.T(5), t[6], -1, h, false);
      }
      case kMamba2: {
        at::Tensor zx = g_->linear(x, p.T(1), t[2], -1, c10::nullopt, false);
        at::Tensor y = stepwise(s, {zx}, [&](const std::vector<at::Tensor>& in,
                                             const at::Tensor& src, const at::Tensor& dst) {
          return mamba2_step(in[0], p.T(5), p.T(6), src, dst, p.T(7), t[8], p.T(9), p.T(10),
                             p.T(11), p.T(12), p.i[0], p.i[1], p.i[2], p.i[3], p.i[4], p.f[1],
                             p.f[2], p.i[5], p.f[3]);
        });
        return g_->linear(y, p.T(3), t[4], -1, h, false);
      }
      case kGatedAttn: {
        TORCH_CHECK(s.cos.has_value() && s.sin.has_value(),
                    "DecodeLayers: a gated attention part needs the step's cos and sin");
        need_tables(s);
        auto y = g_->linear_split(x, {p.T(1), p.T(2), p.T(3)}, -1);
        at::Tensor o = gated_attention(y[0], y[1], y[2], p.T(4), p.T(5), p.f[1], *s.cos, *s.sin,
                                       p.T(6), *s.tables, *s.lens, p.f[2], s.keys);
        return g_->linear(o, p.T(7), t[8], -1, h, false);
      }
      case kAttention: {
        need_tables(s);
        auto y = g_->linear_split(x, {p.T(1), p.T(2), p.T(3)}, -1);
        const at::Tensor q = y[0].view({y[0].size(0), p.i[0], p.i[1]}).contiguous();
        at::Tensor o = paged_attention(q, y[1].contiguous(), y[2].contiguous(), p.T(4),
                                       *s.tables, *s.lens, p.f[1], s.keys);
        return g_->linear(o, p.T(5), t[6], -1, h, false);
      }
      case kSwiGLU: {
        at::Tensor gu = g_->linear_cat(x, {p.T(1), p.T(2)}, -1);
        return g_->linear(swiglu(gu), p.T(3), c10::nullopt, -1, h, false);
      }
      case kRelu2: {
        at::Tensor u = g_->linear(x, p.T(1), t[2], -1, c10::nullopt, true);
        return g_->linear(u, p.T(3), t[4], -1, h, false);
      }
      case kSoftmaxMoE:
        return g_->softmax_moe(x, p.T(1), p.T(2), p.T(3), p.T(4), p.T(5), p.T(6), p.T(7), p.i[0],
                               p.i[1] != 0, p.T(8), h);
      case kSigmoidGroupMoE:
        return g_->sigmoid_group_moe(x, p.T(1), p.T(2), p.T(3), p.T(4), p.T(5), p.T(6), p.i[0],
                                     p.i[1] != 0, p.f[1], p.T(7), h);
    }
    TORCH_CHECK(false, "DecodeLayers: no part kind ", static_cast<int64_t>(p.kind));
  }

  const baton_api::Gemv* g_ = nullptr;
  std::vector<Part> parts_;
};

}  // namespace

void bind_layers(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<const py::capsule&>(), py::arg("gemv_api"))
      .def("add", &DecodeLayers::add, py::arg("kind"), py::arg("tensors"), py::arg("ints"),
           py::arg("floats"))
      .def("run", &DecodeLayers::run, py::arg("h"), py::arg("slots"), py::arg("tables"),
           py::arg("lens"), py::arg("keys"), py::arg("cos"), py::arg("sin"))
      .def("run_rows", &DecodeLayers::run_rows, py::arg("h"), py::arg("steps"),
           py::arg("tables"), py::arg("lens"), py::arg("keys"), py::arg("cos"), py::arg("sin"))
      .def("body", &DecodeLayers::body_of, py::arg("n"), py::arg("x"), py::arg("h"))
      .def("__len__", &DecodeLayers::size);
}
