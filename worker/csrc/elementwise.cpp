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
#include "fp8.h"
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// Where rope_rows stores a row's K and V: pages of the activations' dtype, or FP8 pages
// and their scales (k8 != nullptr), each head's vector quantized as worker/kv_quant.py does.
template <typename T>
struct KvStore {
  T* k = nullptr;
  T* v = nullptr;
  uint8_t* k8 = nullptr;
  uint8_t* v8 = nullptr;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  Fp8Kind kind = Fp8Kind::kE4M3;
};

// Rotary embedding (HF's rotate-half) of the q and k heads of each fused qkv row, q to
// `q` [rows, H, D], k and v stored at the row's slot of this layer's KV pages
// [slots, Hkv, D]. torch's order and rounding: x * cos rounded, the rotated half's product
// rounded, their difference (first half) or sum (second half) rounded; no FMA contraction,
// so float32 is bit for bit torch's too. One pass instead of about ten dispatches a layer
// (split, the rotary's multiplies and slices, two index copies). FP8 pages take the
// rotated K (rounded to T, as the torch path has it) and V quantized per head.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rope_rows(const T* qkv, int64_t ldq, const T* cos, const T* sin, T* q, KvStore<T> kv,
               const int64_t* slots, int64_t rows, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t half = D / 2, slot_len = Hkv * D;
  at::parallel_for(0, rows, grain((H + 2 * Hkv) * D), [&](int64_t r0, int64_t r1) {
    thread_local std::vector<T> k_row;  // FP8: the rotated K heads before quantizing
    thread_local std::vector<float> wide;
    if (kv.k8) {
      k_row.resize(slot_len);
      wide.resize(D);
    }
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = qkv + r * ldq;
      const T* c = cos + r * D;
      const T* s = sin + r * D;
      T* k_slot = kv.k8 ? k_row.data() : kv.k + slots[r] * slot_len;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const T* xh = x + h * D;
        T* o = h < H ? q + (r * H + h) * D : k_slot + (h - H) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = widen(narrow<T>(widen(xh[i]) * widen(c[i])));
          const float b = widen(narrow<T>(widen(xh[i + half]) * widen(s[i])));
          o[i] = narrow<T>(a - b);
        }
        for (int64_t i = half; i < D; ++i) {
          const float a = widen(narrow<T>(widen(xh[i]) * widen(c[i])));
          const float b = widen(narrow<T>(widen(xh[i - half]) * widen(s[i])));
          o[i] = narrow<T>(a + b);
        }
      }
      const T* v_row = x + (H + Hkv) * D;
      if (!kv.k8) {
        std::memcpy(kv.v + slots[r] * slot_len, v_row, slot_len * sizeof(T));
        continue;
      }
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        const int64_t at = slots[r] * Hkv + hk;  // the (slot, head) of its scale
        for (int64_t i = 0; i < D; ++i) wide[i] = widen(k_slot[hk * D + i]);
        kv.k_scale[at] = quantize_vector(kv.kind, wide.data(), D, kv.k8 + at * D);
        for (int64_t i = 0; i < D; ++i) wide[i] = widen(v_row[hk * D + i]);
        kv.v_scale[at] = quantize_vector(kv.kind, wide.data(), D, kv.v8 + at * D);
      }
    }
  });
}
#pragma GCC pop_options

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

torch::Tensor rope_store_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                            int64_t num_heads, std::optional<torch::Tensor> k_scale,
                            std::optional<torch::Tensor> v_scale) {
  check_rows(qkv, "rope_store_kv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4 &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "rope_store_kv: one layer's K and V pages [pages, page, Hkv, D], contiguous");
  const int64_t rows = qkv.size(0), hkv = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * hkv) * d && d % 2 == 0,
              "rope_store_kv: qkv rows are H + 2 Hkv heads of an even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d &&
                  sin.numel() == rows * d,
              "rope_store_kv: cos and sin [rows, 1, D], contiguous");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "rope_store_kv: both scales or none");
  const bool fp8 = k_scale.has_value();
  TORCH_CHECK((fp8 || qkv.scalar_type() == k_cache.scalar_type()) &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_store_kv: qkv, cos, sin and the pages share a dtype (FP8 pages: with scales)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "rope_store_kv: one int64 slot per row");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, "rope_store_kv: slot ", slot[r],
                " outside the pages (", capacity, " slots)");
  auto q = torch::empty({rows, num_heads, d}, qkv.options());
  by_dtype(qkv, [&](auto zero) {
    using T = decltype(zero);
    KvStore<T> kv;
    if (fp8) {
      const Fp8Pages k8 = fp8_pages(k_cache, *k_scale), v8 = fp8_pages(v_cache, *v_scale);
      kv.k8 = static_cast<uint8_t*>(k_cache.data_ptr());
      kv.v8 = static_cast<uint8_t*>(v_cache.data_ptr());
      kv.k_scale = const_cast<float*>(k8.scales);
      kv.v_scale = const_cast<float*>(v8.scales);
      kv.kind = k8.kind;
    } else {
      kv.k = k_cache.data_ptr<T>();
      kv.v = v_cache.data_ptr<T>();
    }
    rope_rows(qkv.data_ptr<T>(), qkv.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(),
              q.data_ptr<T>(), kv, slot, rows, num_heads, hkv, d);
  });
  return q;
}
