// The elementwise passes of a decoder layer, fused: RMSNorm (with the residual add before
// it) and SiLU(gate) * up.
//
// In plain torch each is four to six passes over the activations (pow, mean, rsqrt, two
// multiplies; silu, multiply; the add) and as many dispatches: at prefill they were
// 15-20% of a layer's time, at decode a dispatch cost per op per layer. Here each is one
// pass per row. Rounding follows HF's modules: RMSNorm computes in float32 and rounds
// once before the weight's multiply (in the weight's dtype), SiLU rounds to the dtype
// before the multiply by up, the residual sum rounds to the dtype; float32 is exact
// float32 math in another summation order.
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// float -> the storage type, round to nearest even (no NaN here: activations are finite)
template <typename T> inline T narrow(float v);
template <> inline float narrow<float>(float v) { return v; }
template <> inline c10::BFloat16 narrow<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint16_t top = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  c10::BFloat16 out;
  std::memcpy(&out, &top, sizeof out);
  return out;
}

// Rows per work item: enough elements that a thread's share is worth its wake-up.
inline int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / row_len); }

template <typename T>
void norm_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t rows, int64_t d,
               float eps) {
  at::parallel_for(0, rows, grain(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * ldx;
      T* o = out + r * d;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) squares += widen(xr[i]) * widen(xr[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i)
        o[i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(xr[i]) * inv)));
    }
  });
}

template <typename T>
void add_rows(T* h, const T* delta, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) h[i] = narrow<T>(widen(h[i]) + widen(delta[i]));
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(2 * inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = widen(g[i]);
        const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|): never overflows
        const float sigmoid = (x >= 0.f ? 1.f : e) / (1.f + e);
        o[i] = narrow<T>(widen(narrow<T>(x * sigmoid)) * widen(u[i]));
      }
    }
  });
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": [rows, n] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              " takes float32 or bfloat16, not ", x.scalar_type());
}

template <typename Fn>
void by_dtype(const torch::Tensor& x, Fn fn) {
  if (x.scalar_type() == at::kFloat) fn(0.f);
  else fn(c10::BFloat16(0.f));
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: one weight per column, of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    norm_rows(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), out.data_ptr<T>(),
              x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.dim() == 2, "add_rms_norm: residual [rows, n]");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "add_rms_norm: delta like the residual");
  const auto d = delta.contiguous();
  by_dtype(residual, [&](auto zero) {
    using T = decltype(zero);
    add_rows(residual.data_ptr<T>(), d.data_ptr<T>(), residual.numel());
  });
  return rms_norm(residual, weight, eps);
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: [rows, 2 * intermediate]");
  const auto gu = gate_up.contiguous();
  const int64_t inter = gu.size(1) / 2;
  auto out = torch::empty({gu.size(0), inter}, gu.options());
  by_dtype(gu, [&](auto zero) {
    using T = decltype(zero);
    silu_mul_rows(gu.data_ptr<T>(), out.data_ptr<T>(), gu.size(0), inter);
  });
  return out;
}
