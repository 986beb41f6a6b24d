// x [M, K] @ w [N, K]^T for a few rows of x: the linear layers of a decode step (one
// row per sequence) or a speculative verify (1 + K rows).
//
// With few rows a linear layer is a read of its weights: M rows do 2M FLOPs per weight
// read. torch's CPU GEMM reads them at 8-10 GB/s for one row and, from two rows up, at
// 2-5 GB/s (it packs the weights for a GEMM whose M is tiny), where the machine's memory
// gives 20+ GB/s. Here a tile of weight rows is loaded from memory once and multiplied
// into every row of x, four rows at a time from registers while the tile stays in L1, so
// the weights stream from memory once and the rows of x stay in L1 or L2.
//
// Weights float32 or bfloat16 (widened in registers: bf16 is float32's top half); x of the
// weights' dtype, computed in float32, the result rounded to that dtype once (as torch
// accumulates in float32), as each thread stores it: no float32 result and no second pass
// (a torch conversion per call, 4 a layer, each its own dispatch and parallel region).
// Where the CPU has bf16 dot products (AVX512_BF16), bf16 x and weights are multiplied as
// they are, 32 pairs an instruction summed into float32 lanes: widening every weight had
// made bf16 compute-bound at half float32's weight bandwidth. The vector width is the
// machine's: 16 floats with AVX-512, 8 without; register blocking is sized to that
// register file.
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

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kAccumulators = 24;  // of 32 vector registers: the rest hold w and x
#else
constexpr int kLanes = 8;
constexpr int kAccumulators = 10;  // of 16
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

// The next weight tile (the rows after this one: contiguous) fetched towards L1 a slice
// per step along k while this tile is multiplied. A tile reads its NB rows side by side,
// short strided streams that the hardware prefetcher barely follows: from memory the
// tiles ran at 16 GB/s on one core of an AMD EPYC (Zen 5), 25 with this.
struct NextTile {
  const char* p;
  int64_t bytes, per_step, at = 0;
  NextTile(const void* next, int64_t next_bytes, int64_t steps)
      : p(static_cast<const char*>(next)), bytes(next_bytes),
        per_step(steps > 0 ? (next_bytes / steps + 63) / 64 * 64 : 0) {}
  inline void step() {
    for (const int64_t end = std::min(bytes, at + per_step); at < end; at += 64)
      __builtin_prefetch(p + at, 0, 3);
  }
};

// y[a, n0 + b] for a < MB, b < NB: MB rows of x against NB weight rows, MB * NB
// accumulators in registers.
template <int MB, int NB, typename W, typename Y>
inline void tile(const float* x, const W* w, int64_t k, Y* y, int64_t n, int64_t n0,
                 NextTile next) {
  vfloat acc[MB][NB] = {};
  const int64_t k_vec = k / kLanes * kLanes;
  for (int64_t i = 0; i < k_vec; i += kLanes) {
    if constexpr (MB > 1) next.step();  // one row of x: see weight_tiles
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
      y[a * n + n0 + b] = static_cast<Y>(s);
    }
}

// Rows of x a tile multiplies at once, and weight rows per tile for that many: MB * NB
// accumulators, the rest of the registers for the loads. More rows of x than kGroup
// run as groups against each weight tile while it is in L1: one tile of 16 rows x 1
// weight row loaded 17 vectors for 16 products (the x rows), and ran at a quarter of
// the rate 4 x 6 does.
constexpr int kGroup = 4;
template <int MB>
constexpr int weight_rows_per_tile() { return std::max(1, std::min(8, kAccumulators / MB)); }

// y rows [0, m) for the weight rows [n0, n1): Tile<MB, NB>::run(x, w, k, y, n, n0) is
// one tile. NB is the first group's (every group shares the weight tile).
template <template <int, int> class Tile, typename X, typename W, typename Y>
void weight_tiles(const X* x, int64_t m, const W* w, int64_t k, Y* y, int64_t n,
                  int64_t n0, int64_t n1) {
  auto groups = [&](auto nb, int64_t at) {
    constexpr int NB = decltype(nb)::value;
    for (int64_t a = 0; a < m; a += kGroup) {
      const X* xa = x + a * k;
      Y* ya = y + a * n;
      // the first group fetches the next tile (the others find this one in L1); one row
      // of x alone (a tile of MB = 1) streams the weights as fast without, and was
      // slower with it on 2 cores
      const int64_t next_rows = a == 0 ? std::clamp<int64_t>(n1 - at - NB, 0, NB) : 0;
      const NextTile next(w + (at + NB) * k, next_rows * k * static_cast<int64_t>(sizeof(W)),
                          k / Tile<1, NB>::kStep);
      switch (std::min<int64_t>(kGroup, m - a)) {
        case 1: Tile<1, NB>::run(xa, w, k, ya, n, at, next); break;
        case 2: Tile<2, NB>::run(xa, w, k, ya, n, at, next); break;
        case 3: Tile<3, NB>::run(xa, w, k, ya, n, at, next); break;
        default: Tile<4, NB>::run(xa, w, k, ya, n, at, next); break;
      }
    }
  };
  auto tiles = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    int64_t at = n0;
    for (; at + NB <= n1; at += NB) groups(nb, at);
    for (; at < n1; ++at) groups(std::integral_constant<int, 1>{}, at);
  };
  switch (std::min<int64_t>(kGroup, m)) {
    case 1: tiles(std::integral_constant<int, weight_rows_per_tile<1>()>{}); break;
    case 2: tiles(std::integral_constant<int, weight_rows_per_tile<2>()>{}); break;
    case 3: tiles(std::integral_constant<int, weight_rows_per_tile<3>()>{}); break;
    default: tiles(std::integral_constant<int, weight_rows_per_tile<4>()>{}); break;
  }
}

template <int MB, int NB>
struct FloatTile {
  static constexpr int64_t kStep = kLanes;  // k per step
  template <typename W, typename Y>
  static void run(const float* x, const W* w, int64_t k, Y* y, int64_t n, int64_t n0,
                  NextTile next) {
    tile<MB, NB>(x, w, k, y, n, n0, next);
  }
};

template <typename W, typename Y>
void run(const float* x, int64_t m, const W* w, int64_t n, int64_t k, Y* y) {
  // Split along the weight rows, so every thread streams its own part of w once.
  const int64_t items = (n + kRowsOfW - 1) / kRowsOfW;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    weight_tiles<FloatTile>(x, m, w, k, y, n, i0 * kRowsOfW, std::min(n, i1 * kRowsOfW));
  });
}


#ifdef __AVX512BF16__
// The bf16 dot product: y[a, n0 + b] for MB rows of bf16 x against NB bf16 weight rows.
template <int MB, int NB, typename Y>
inline void tile_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, Y* y,
                      int64_t n, int64_t n0, NextTile next) {
  __m512 acc[MB][NB];
  for (int a = 0; a < MB; ++a)
    for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_setzero_ps();
  const int64_t k_vec = k / 32 * 32;
  for (int64_t i = 0; i < k_vec; i += 32) {
    if constexpr (MB > 1) next.step();  // one row of x: see weight_tiles
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
      y[a * n + n0 + b] = static_cast<Y>(s);
    }
}

template <int MB, int NB>
struct Bf16Tile {
  static constexpr int64_t kStep = 32;  // k per step
  template <typename Y>
  static void run(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, Y* y,
                  int64_t n, int64_t n0, NextTile next) {
    tile_bf16<MB, NB>(x, w, k, y, n, n0, next);
  }
};

void run_bf16(const c10::BFloat16* x, int64_t m, const c10::BFloat16* w, int64_t n, int64_t k,
              c10::BFloat16* y) {
  const int64_t items = (n + kRowsOfW - 1) / kRowsOfW;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    weight_tiles<Bf16Tile>(x, m, w, k, y, n, i0 * kRowsOfW, std::min(n, i1 * kRowsOfW));
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
    auto y = torch::empty({m, n}, xb.options());
    run_bf16(xb.data_ptr<c10::BFloat16>(), m, w.data_ptr<c10::BFloat16>(), n, k,
             y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), n = w.size(0);
  auto y = torch::empty({m, n}, x.options());  // rounded to x's dtype as it is stored
  switch (w.scalar_type()) {
    case at::kFloat:
      run(xf.data_ptr<float>(), m, w.data_ptr<float>(), n, k, y.data_ptr<float>());
      return y;
    case at::kBFloat16:
      run(xf.data_ptr<float>(), m, w.data_ptr<c10::BFloat16>(), n, k,
          y.data_ptr<c10::BFloat16>());
      return y;
    default:
      TORCH_CHECK(false, "small_linear takes float32 or bfloat16 weights, not ", w.scalar_type());
  }
}
