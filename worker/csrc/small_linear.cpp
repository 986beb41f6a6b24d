// x [M, K] @ w [N, K]^T for a few rows of x: the linear layers of a decode step (one
// row per sequence) or a speculative verify (1 + K rows).
//
// With few rows a linear layer is a read of its weights: M rows do 2M FLOPs per weight
// read. torch's CPU GEMM reads them at 8-10 GB/s for one row and, from two rows up, at
// 2-5 GB/s (it packs the weights for a GEMM whose M is tiny), where the machine's memory
// gives 20+ GB/s. Here every weight row is loaded once per block of up to 16 rows of x
// (8 without AVX-512) and multiplied into all of them from registers, so the weights
// stream from memory once and the rows of x stay in L1 or L2.
//
// Weights float32 or bfloat16 (widened in registers: bf16 is float32's top half); x of the
// weights' dtype, computed in float32, the result rounded to that dtype once (as torch
// accumulates in float32). Where the CPU has bf16 dot products (AVX512_BF16), bf16 x and
// weights are multiplied as they are, 32 pairs an instruction summed into float32 lanes:
// widening every weight had made bf16 compute-bound at half float32's weight bandwidth. The vector width is the machine's: 16 floats with AVX-512,
// 8 without; register blocking is sized to that register file.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

// kRowsOfX: the rows of x one weight load is multiplied into. Up to it, the weights
// stream from memory once; more rows take another pass.
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kAccumulators = 24;  // of 32 vector registers: the rest hold w and x
constexpr int kRowsOfX = 16;
#else
constexpr int kLanes = 8;
constexpr int kAccumulators = 10;  // of 16
constexpr int kRowsOfX = 8;
#endif
constexpr int64_t kRowsOfW = 32;   // weight rows a work item covers

typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vbits16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vbits32 __attribute__((vector_size(4 * kLanes)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat load(const c10::BFloat16* p) {
  vbits16 half;
  std::memcpy(&half, p, sizeof half);
  const vbits32 wide = __builtin_convertvector(half, vbits32) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline float widen(float w) { return w; }
inline float widen(c10::BFloat16 w) { return static_cast<float>(w); }

inline float horizontal_sum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// y[a, n0 + b] for a < MB, b < NB: MB rows of x against NB weight rows, MB * NB
// accumulators in registers.
template <int MB, int NB, typename W>
inline void tile(const float* x, const W* w, int64_t k, float* y, int64_t n, int64_t n0) {
  vfloat acc[MB][NB] = {};
  const int64_t k_vec = k / kLanes * kLanes;
  for (int64_t i = 0; i < k_vec; i += kLanes) {
    vfloat wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load(w + (n0 + b) * k + i);
    for (int a = 0; a < MB; ++a) {
      const vfloat xv = load(x + a * k + i);
      for (int b = 0; b < NB; ++b) acc[a][b] += xv * wv[b];
    }
  }
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < NB; ++b) {
      float s = horizontal_sum(acc[a][b]);
      for (int64_t i = k_vec; i < k; ++i) s += x[a * k + i] * widen(w[(n0 + b) * k + i]);
      y[a * n + n0 + b] = s;
    }
}

template <int MB, typename W>
void weight_rows(const float* x, const W* w, int64_t k, float* y, int64_t n, int64_t n0,
                 int64_t n1) {
  constexpr int NB = std::max(1, std::min(8, kAccumulators / MB));
  int64_t at = n0;
  for (; at + NB <= n1; at += NB) tile<MB, NB>(x, w, k, y, n, at);
  for (; at < n1; ++at) tile<MB, 1>(x, w, k, y, n, at);
}

template <typename W>
void rows_of_x(const float* x, int64_t m, const W* w, int64_t k, float* y, int64_t n,
               int64_t n0, int64_t n1) {
  for (int64_t a = 0; a < m; a += kRowsOfX) {
    const float* xa = x + a * k;
    float* ya = y + a * n;
    switch (std::min<int64_t>(kRowsOfX, m - a)) {
      case 1: weight_rows<1>(xa, w, k, ya, n, n0, n1); break;
      case 2: weight_rows<2>(xa, w, k, ya, n, n0, n1); break;
      case 3: weight_rows<3>(xa, w, k, ya, n, n0, n1); break;
      case 4: weight_rows<4>(xa, w, k, ya, n, n0, n1); break;
      case 5: weight_rows<5>(xa, w, k, ya, n, n0, n1); break;
      case 6: weight_rows<6>(xa, w, k, ya, n, n0, n1); break;
      case 7: weight_rows<7>(xa, w, k, ya, n, n0, n1); break;
      case 8: weight_rows<8>(xa, w, k, ya, n, n0, n1); break;
#ifdef __AVX512F__
      case 9: weight_rows<9>(xa, w, k, ya, n, n0, n1); break;
      case 10: weight_rows<10>(xa, w, k, ya, n, n0, n1); break;
      case 11: weight_rows<11>(xa, w, k, ya, n, n0, n1); break;
      case 12: weight_rows<12>(xa, w, k, ya, n, n0, n1); break;
      case 13: weight_rows<13>(xa, w, k, ya, n, n0, n1); break;
      case 14: weight_rows<14>(xa, w, k, ya, n, n0, n1); break;
      case 15: weight_rows<15>(xa, w, k, ya, n, n0, n1); break;
      case 16: weight_rows<16>(xa, w, k, ya, n, n0, n1); break;
#endif
      default: break;  // unreachable: min(kRowsOfX, rows left) >= 1
    }
  }
}

template <typename W>
void run(const float* x, int64_t m, const W* w, int64_t n, int64_t k, float* y) {
  // Split along the weight rows, so every thread streams its own part of w once.
  const int64_t items = (n + kRowsOfW - 1) / kRowsOfW;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    rows_of_x(x, m, w, k, y, n, i0 * kRowsOfW, std::min(n, i1 * kRowsOfW));
  });
}


#ifdef __AVX512BF16__
// The bf16 dot product: y[a, n0 + b] for MB rows of bf16 x against NB bf16 weight rows.
template <int MB, int NB>
inline void tile_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, float* y,
                      int64_t n, int64_t n0) {
  __m512 acc[MB][NB];
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_setzero_ps();
  const int64_t k_vec = k / 32 * 32;
  for (int64_t i = 0; i < k_vec; i += 32) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (n0 + b) * k + i);
    for (int a = 0; a < MB; ++a) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + a * k + i);
      for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], xv, wv[b]);
    }
  }
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < NB; ++b) {
      float s = _mm512_reduce_add_ps(acc[a][b]);
      for (int64_t i = k_vec; i < k; ++i)
        s += static_cast<float>(x[a * k + i]) * static_cast<float>(w[(n0 + b) * k + i]);
      y[a * n + n0 + b] = s;
    }
}

template <int MB>
void weight_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, float* y,
                      int64_t n, int64_t n0, int64_t n1) {
  constexpr int NB = std::max(1, std::min(8, kAccumulators / MB));
  int64_t at = n0;
  for (; at + NB <= n1; at += NB) tile_bf16<MB, NB>(x, w, k, y, n, at);
  for (; at < n1; ++at) tile_bf16<MB, 1>(x, w, k, y, n, at);
}

template <int... MB>
void rows_of_x_bf16(const c10::BFloat16* x, int64_t m, const c10::BFloat16* w, int64_t k,
                    float* y, int64_t n, int64_t n0, int64_t n1,
                    std::integer_sequence<int, MB...>) {
  using Fn = void (*)(const c10::BFloat16*, const c10::BFloat16*, int64_t, float*, int64_t,
                      int64_t, int64_t);
  static constexpr Fn by_rows[] = {weight_rows_bf16<MB + 1>...};
  for (int64_t a = 0; a < m; a += kRowsOfX)
    by_rows[std::min<int64_t>(kRowsOfX, m - a) - 1](x + a * k, w, k, y + a * n, n, n0, n1);
}

void run_bf16(const c10::BFloat16* x, int64_t m, const c10::BFloat16* w, int64_t n, int64_t k,
              float* y) {
  const int64_t items = (n + kRowsOfW - 1) / kRowsOfW;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    rows_of_x_bf16(x, m, w, k, y, n, i0 * kRowsOfW, std::min(n, i1 * kRowsOfW),
                   std::make_integer_sequence<int, kRowsOfX>{});
  });
}
#endif

}  // namespace

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(w.is_contiguous(), "small_linear: w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "small_linear: x and w must share a dtype");
#ifdef __AVX512BF16__
  if (w.scalar_type() == at::kBFloat16) {
    const auto xb = x.contiguous();
    const int64_t m = xb.size(0), k = xb.size(1), n = w.size(0);
    auto y = torch::empty({m, n}, xb.options().dtype(at::kFloat));
    run_bf16(xb.data_ptr<c10::BFloat16>(), m, w.data_ptr<c10::BFloat16>(), n, k,
             y.data_ptr<float>());
    return y.to(at::kBFloat16);
  }
#endif
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), n = w.size(0);
  auto y = torch::empty({m, n}, xf.options());
  switch (w.scalar_type()) {
    case at::kFloat:
      run(xf.data_ptr<float>(), m, w.data_ptr<float>(), n, k, y.data_ptr<float>());
      return y;
    case at::kBFloat16:
      run(xf.data_ptr<float>(), m, w.data_ptr<c10::BFloat16>(), n, k, y.data_ptr<float>());
      return y.to(at::kBFloat16);
    default:
      TORCH_CHECK(false, "small_linear takes float32 or bfloat16 weights, not ", w.scalar_type());
  }
}
