// The step module's entry points, declared once for the files that call or bind them across
// translation units (attention.cpp binds them all; glue.cpp and layers.cpp call some).
#pragma once

#include <ATen/core/Tensor.h>

#include <pybind11/pybind11.h>

// recurrent.cpp
at::Tensor mamba2_step(const at::Tensor& zxbcdt, at::Tensor conv_pool, at::Tensor ssm_pool,
                       const at::Tensor& slots, const at::Tensor& dst_slots,
                       const at::Tensor& conv_w,
                       const c10::optional<at::Tensor>& conv_b, const at::Tensor& dt_bias,
                       const at::Tensor& A_log, const at::Tensor& D, const at::Tensor& norm_w,
                       int64_t inter, int64_t H, int64_t P, int64_t G, int64_t N, double lo,
                       double hi, int64_t group_size, double eps);
at::Tensor deltanet_step(const at::Tensor& qkv, at::Tensor conv_pool, at::Tensor rec_pool,
                         const at::Tensor& slots, const at::Tensor& dst_slots,
                         const at::Tensor& a,
                         const at::Tensor& beta_logit, const at::Tensor& zg,
                         const at::Tensor& conv_w, const at::Tensor& dt_bias,
                         const at::Tensor& A_log, const at::Tensor& norm_w, int64_t hk,
                         int64_t hv, int64_t dk, int64_t dv, double eps);

// attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor pool, const at::Tensor& tables, const at::Tensor& lens,
                           double scale, const c10::optional<at::Tensor>& keys);
at::Tensor kv_rows(const at::Tensor& x, int64_t fmt);
at::Tensor paged_attention_q(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             at::Tensor pool, const at::Tensor& tables, const at::Tensor& lens,
                             double scale, const c10::optional<at::Tensor>& keys, int64_t fmt);
c10::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// glue.cpp
at::Tensor swiglu(const at::Tensor& gu);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor gated_attention(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& qw, const at::Tensor& kw, double eps,
                           const at::Tensor& cos, const at::Tensor& sin, at::Tensor pool,
                           const at::Tensor& tables, const at::Tensor& lens, double scale,
                           const c10::optional<at::Tensor>& keys);
at::Tensor torch_sigmoid_of(const at::Tensor& x);

// prefill.cpp
at::Tensor conv_silu(const at::Tensor& x, const at::Tensor& state, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias);
at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& gate, const at::Tensor& w,
                          int64_t group, double eps, bool norm_first);
at::Tensor prefill_exp_of(const at::Tensor& x, bool vector);
at::Tensor decay_matmul(const at::Tensor& CB, const at::Tensor& cum, int64_t r,
                        const c10::optional<at::Tensor>& C, const at::Tensor& X);
at::Tensor ssd_carry(const at::Tensor& states, const at::Tensor& decay, at::Tensor X,
                     const c10::optional<at::Tensor>& state0, int64_t l);
at::Tensor ssd_decay(const at::Tensor& CB, const at::Tensor& cum, int64_t r,
                     const c10::optional<at::Tensor>& C);
at::Tensor unit_lower_solve(const at::Tensor& A, const at::Tensor& rhs);
at::Tensor grouped_mm(const at::Tensor& xs, const at::Tensor& w, const at::Tensor& counts);
bool flush_denormals(bool on);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& pos, double scale);
at::Tensor prefill_attention_q(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& pos, double scale, int64_t fmt);

// gemm.cpp
bool prefill_gemm_built();
at::Tensor prefill_gemm(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias);

// layers.cpp
void bind_layers(pybind11::module& m);
