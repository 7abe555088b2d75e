// Stochastic rounding float32 -> bfloat16, the same bits as baton/cache/rounding.py's torch
// reference (`draws` + `_bf16_stochastic`): a draw per element from MurmurHash3's fmix32 over
// (the element's index, the row's 64-bit stream key), and 0xFFFF - draw16 added below the
// upper half before truncating. One pass, no temporaries (docs/state-precision.md).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr uint32_t kGolden = 0x9E3779B9u;

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

inline uint32_t draw24(int64_t idx, int64_t key) {
  const uint64_t k = static_cast<uint64_t>(key), i = static_cast<uint64_t>(idx);
  uint32_t h = fmix32(static_cast<uint32_t>(i) ^ static_cast<uint32_t>(k));
  h = fmix32(h ^ static_cast<uint32_t>(k >> 32));
  h = fmix32(h ^ static_cast<uint32_t>(i >> 32) ^ kGolden);
  return h >> 8;
}

inline uint16_t round_one(float x, uint32_t r24) {
  if (!std::isfinite(x)) return c10::BFloat16(x).x;  // as nearest stores it
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t add = 0xFFFFu - (r24 >> 8);
  uint32_t up = (bits + add) & 0xFFFF0000u;
  if ((up & 0x7F800000u) == 0x7F800000u) up = (up & 0x80000000u) | 0x7F7F0000u;  // saturate
  return static_cast<uint16_t>(up >> 16);
}

}  // namespace

// x: float32 [R, ...] contiguous; keys: int64 [R]; index: int64 [N] (N = x.numel() / R; each
// element's number in the whole TP 1 tensor) or empty (0..N-1). Returns bfloat16, x's shape.
torch::Tensor round_bf16_stochastic(torch::Tensor x, torch::Tensor keys, torch::Tensor index) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "round_bf16_stochastic reads contiguous float32 on the CPU");
  keys = keys.to(torch::kInt64).contiguous();
  const int64_t R = keys.numel(), N = R ? x.numel() / R : 0;
  TORCH_CHECK(R * N == x.numel(), "keys do not divide x");
  const bool has_index = index.numel() > 0;
  if (has_index) {
    index = index.to(torch::kInt64).contiguous();
    TORCH_CHECK(index.numel() == N, "index has ", index.numel(), " elements, not ", N);
  }
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kBFloat16));
  const float* src = x.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* idx = has_index ? index.data_ptr<int64_t>() : nullptr;
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, R * N, 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t row = e / N, i = e - row * N;
      dst[e] = round_one(src[e], draw24(has_index ? idx[i] : i, k[row]));
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("round_bf16_stochastic", &round_bf16_stochastic);
}
