// Reading a sequence's K or V rows out of the paged cache, shared by the attention kernels.
#pragma once

#include "fp8.h"

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// One token's K (or V) row as float32: float rows are read where they are; 16-bit
// rows are widened once into `buf` by a loop the compiler vectorizes (element-wise
// c10 conversions do not vectorize, which left bf16 no faster than float32 and fp16
// four times slower).
inline const float* as_float(const float* row, float*, int64_t) { return row; }

inline const float* as_float(const c10::BFloat16* row, float* buf, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;  // bf16 is float's top half
    std::memcpy(buf + i, &wide, sizeof(float));
  }
  return buf;
}

inline const float* as_float(const c10::Half* row, float* buf, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(row[i]);
  return buf;
}

// Calls fn(i, row) for the tokens t0 + i in [t0, t1) of one sequence, `row` pointing at
// that token's K (or V) row of every KV head: page by page, so no division per token.
template <typename scalar_t, typename Fn>
inline void for_each_row(const scalar_t* cache, const int32_t* pages, int64_t t0, int64_t t1,
                         int64_t page_size, int64_t slot_stride, Fn fn) {
  int64_t i = 0;
  for (int64_t p = t0 / page_size; i < t1 - t0; ++p) {
    const scalar_t* page = cache + pages[p] * page_size * slot_stride;
    const int64_t first = (p == t0 / page_size) ? t0 % page_size : 0;
    const int64_t last = std::min(page_size, first + (t1 - t0 - i));
    for (int64_t slot = first; slot < last; ++slot, ++i) fn(i, page + slot * slot_stride);
  }
}

// Calls fn(i, slot) for the tokens t0 + i in [t0, t1) of one sequence, `slot` its flat
// slot in the pages (page id * page_size + offset): where FP8 rows and their scales are.
template <typename Fn>
inline void for_each_slot(const int32_t* pages, int64_t t0, int64_t t1, int64_t page_size,
                          Fn fn) {
  int64_t i = 0;
  for (int64_t p = t0 / page_size; i < t1 - t0; ++p) {
    const int64_t first = (p == t0 / page_size) ? t0 % page_size : 0;
    const int64_t last = std::min(page_size, first + (t1 - t0 - i));
    for (int64_t slot = first; slot < last; ++slot, ++i) fn(i, pages[p] * page_size + slot);
  }
}

// One token's FP8 row of every KV head (Hkv x D) read back into dst, in the query's dtype.
template <typename T>
inline void dequantize_row(const Fp8Pages& src, int64_t slot, int64_t Hkv, int64_t D, T* dst) {
  for (int64_t h = 0; h < Hkv; ++h)
    dequantize_vector(src.data + (slot * Hkv + h) * D, src.scales[slot * Hkv + h], D, src.kind,
                      dst + h * D);
}

// __builtin_prefetch's locality hints: towards L1 (PREFETCHT0) or L2 (PREFETCHT1).
constexpr int kToL1 = 3, kToL2 = 2;

// Every 64-byte line of [p, p + bytes) fetched ahead of its use, towards L1 or, for many
// lines at once (more than L1's few fill buffers keep in flight), towards L2.
template <int kTo = kToL1>
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, kTo);
}

#ifdef __AVX512BF16__
// Two bf16 rows x and y interleaved into (x[d], y[d]) pairs, one 32-bit word each, for
// VDPBF16PS against a weight pair per key pair: pairs(x, y, out) puts dims 0..15 of the
// 32 in out[0], 16..31 in out[1] (one VPERMT2W each). The attention kernels' value
// passes take two keys at a time this way.
class PairInterleave {
 public:
  PairInterleave() {
    alignas(64) static const uint16_t kIdx[2][32] = {
        {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
        {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
    lo_ = _mm512_load_si512(kIdx[0]);
    hi_ = _mm512_load_si512(kIdx[1]);
  }
  inline void operator()(__m512i x, __m512i y, __m512i out[2]) const {
    out[0] = _mm512_permutex2var_epi16(x, lo_, y);
    out[1] = _mm512_permutex2var_epi16(x, hi_, y);
  }

 private:
  __m512i lo_, hi_;
};
#endif

// The checks paged_decode and paged_prefill share: their tensors' shapes, dtypes and
// layouts (see paged_decode.cpp). Returns the FP8 K and V pages with their scales, or two
// empty ones where the pages are q's dtype.
inline std::pair<Fp8Pages, Fp8Pages> check_paged_inputs(
    const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
    const torch::Tensor& v_cache, const torch::Tensor& rows, const torch::Tensor& n_q,
    const torch::Tensor& page_start, const torch::Tensor& kv_lens,
    const torch::Tensor& kv_indices, const std::optional<torch::Tensor>& k_scale,
    const std::optional<torch::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV pages must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v: [N, page, Hkv, D]");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "both KV scales, or none");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and out share a dtype, K and V another");
  TORCH_CHECK(k_scale.has_value() || q.scalar_type() == k_cache.scalar_type(),
              "q, KV and out must share a dtype (FP8 KV: with its scales)");
  TORCH_CHECK(rows.scalar_type() == at::kLong && n_q.scalar_type() == at::kLong &&
                  page_start.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong &&
                  kv_indices.scalar_type() == at::kInt,
              "rows, n_q, page_start, kv_lens: int64; kv_indices: int32");
  TORCH_CHECK(rows.is_contiguous() && n_q.is_contiguous() && page_start.is_contiguous() &&
                  kv_lens.is_contiguous() && kv_indices.is_contiguous(),
              "index tensors must be contiguous");
  TORCH_CHECK(n_q.numel() == rows.numel(), "one query count per sequence");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "head_dim or head counts do not match");
  if (!k_scale.has_value()) return {};
  return {fp8_pages(k_cache, *k_scale), fp8_pages(v_cache, *v_scale)};
}
