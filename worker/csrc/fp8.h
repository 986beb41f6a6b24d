// FP8 KV (worker/kv_quant.py is the reference these match bit for bit): a token's K or V
// vector of one KV head stored as x / scale in E4M3 or E5M2 bytes, scale = amax / max
// (1 for zeros), float32, beside the pages; read back as fp8 * scale rounded to the
// model's dtype. (One exception, out of any K or V's reach: read back into bf16 with
// AVX512_BF16, a product below float32's normal range, 1.2e-38, becomes zero.)
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum class Fp8Kind { kE4M3, kE5M2 };

// The FP8 pages of one layer and their scales, as a kernel reads them; data == nullptr:
// the KV is not FP8.
struct Fp8Pages {
  const uint8_t* data = nullptr;  // [pages, page_size, Hkv, D]
  const float* scales = nullptr;  // [pages, page_size, Hkv]
  Fp8Kind kind = Fp8Kind::kE4M3;
  explicit operator bool() const { return data != nullptr; }
};

inline uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline float bits_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

inline float fp8_max(Fp8Kind kind) { return kind == Fp8Kind::kE4M3 ? 448.f : 57344.f; }

// x (finite) clamped to +-max and rounded to FP8, nearest even, as torch's clamp and
// conversion do: the clamp on the magnitude's bits (a float's order is its bits' order;
// -0 keeps its sign), then below the smallest normal by adding a constant whose ulp is
// the format's smallest subnormal (the FPU rounds), above it by rounding the mantissa's
// cut bits in integers. Branch-free, so that the loops calling it vectorize.
template <Fp8Kind kKind>
inline uint8_t fp8_from_float(float x) {
  constexpr int M = kKind == Fp8Kind::kE4M3 ? 3 : 2;    // mantissa bits
  constexpr int B = kKind == Fp8Kind::kE4M3 ? 7 : 15;   // exponent bias
  constexpr uint32_t kMinNormal = uint32_t(127 - B + 1) << 23;
  constexpr uint32_t kSubnormalMagic = uint32_t(127 - B + 23 - M + 1) << 23;
  const uint32_t kMax = float_bits(fp8_max(kKind));
  const uint32_t bits = float_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = std::min(bits & 0x7FFFFFFFu, kMax);
  const uint32_t sub = float_bits(bits_float(mag) + bits_float(kSubnormalMagic)) - kSubnormalMagic;
  const uint32_t odd = (mag >> (23 - M)) & 1u;
  const uint32_t normal =
      (mag - (uint32_t(127 - B) << 23) + ((1u << (22 - M)) - 1u) + odd) >> (23 - M);
  return static_cast<uint8_t>((mag < kMinNormal ? sub : normal) | sign);
}

// One vector x[0, d) quantized into out[0, d), its scale returned. The reference's
// arithmetic: amax in float32 (exact in any order), scale = amax / max, each x / scale
// (a division, not a multiply by the reciprocal), clamped.
template <Fp8Kind kKind>
inline float quantize_vector(const float* x, int64_t d, uint8_t* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax == 0.f ? 1.f : amax / fp8_max(kKind);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = fp8_from_float<kKind>(x[i] / scale);
  return scale;
}

inline float quantize_vector(Fp8Kind kind, const float* x, int64_t d, uint8_t* out) {
  return kind == Fp8Kind::kE4M3 ? quantize_vector<Fp8Kind::kE4M3>(x, d, out)
                                : quantize_vector<Fp8Kind::kE5M2>(x, d, out);
}

// An FP8 byte's value as the bits of a float16 that is it times 2^-8 (E4M3: its exponent
// field has 4 bits and bias 7, a float16's 5 and bias 15) or exactly it (E5M2 is a
// float16's top byte). Float16 takes the FP8 subnormals as its own subnormals, exactly.
inline uint16_t fp8_as_half_bits(uint8_t b, Fp8Kind kind) {
  if (kind == Fp8Kind::kE5M2) return static_cast<uint16_t>(b << 8);
  return static_cast<uint16_t>(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
}

// The factor that makes such a float16 the value times `scale`: exact (a power of two).
inline float half_factor(float scale, Fp8Kind kind) {
  return kind == Fp8Kind::kE4M3 ? scale * 256.f : scale;
}

// float32 -> the kernels' row types, rounded to nearest even as torch rounds.
template <typename T> inline T round_to(float x) { return static_cast<T>(x); }
template <> inline float round_to<float>(float x) { return x; }
template <> inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  const uint32_t b = float_bits(x);
  const uint16_t top = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  c10::BFloat16 out;
  std::memcpy(&out, &top, sizeof out);
  return out;
}

#ifdef __AVX512BF16__  // (which brings AVX512BW)
// 32 FP8 bytes times `f` (half_factor) as 32 bf16: the bytes widened to float16 bits in one
// vector, each half to float32 and multiplied, both halves rounded in one VCVTNE2PS2BF16
// (nearest even, as torch rounds, but a float32 subnormal -- a product below 1.2e-38,
// which no K or V comes near -- becomes zero).
inline __m512i fp8x32_to_bf16(const uint8_t* src, __m512 f, Fp8Kind kind) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i h =
      kind == Fp8Kind::kE5M2
          ? _mm512_slli_epi16(b, 8)
          : _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 7),
                            _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), f);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), f);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

// dst[0, d) = src[0, d) * scale, rounded to T: one head's K or V row read back.
template <typename T>
inline void dequantize_vector(const uint8_t* src, float scale, int64_t d, Fp8Kind kind, T* dst) {
  const float factor = half_factor(scale, kind);
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(factor);
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; i + 32 <= d; i += 32)
      _mm512_storeu_si512(dst + i, fp8x32_to_bf16(src + i, f, kind));
#endif
  const __m256i low7 = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
  for (; i + 16 <= d; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i h = kind == Fp8Kind::kE5M2
                          ? _mm256_slli_epi16(b, 8)
                          : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, low7), 7),
                                            _mm256_slli_epi16(_mm256_and_si256(b, sign), 8));
    const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(h), f);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(dst + i, x);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m512i bits = _mm512_castps_si512(x);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
    } else {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, x);
      for (int j = 0; j < 16; ++j) dst[i + j] = round_to<T>(tmp[j]);
    }
  }
#endif
  for (; i < d; ++i)
    dst[i] = round_to<T>(static_cast<float>(c10::Half(fp8_as_half_bits(src[i], kind),
                                                      c10::Half::from_bits())) * factor);
}

// The FP8 kind of a tensor's dtype; the checks the attention kernels and the K/V store
// share for FP8 pages and their scales ([pages, page_size, Hkv] float32, contiguous).
inline Fp8Kind fp8_kind(const torch::Tensor& pages) {
  TORCH_CHECK(pages.scalar_type() == at::kFloat8_e4m3fn || pages.scalar_type() == at::kFloat8_e5m2,
              "scales come with FP8 pages (float8_e4m3fn or float8_e5m2), not ",
              pages.scalar_type());
  return pages.scalar_type() == at::kFloat8_e4m3fn ? Fp8Kind::kE4M3 : Fp8Kind::kE5M2;
}

inline Fp8Pages fp8_pages(const torch::Tensor& pages, const torch::Tensor& scales) {
  const Fp8Kind kind = fp8_kind(pages);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == pages.size(0) &&
                  scales.size(1) == pages.size(1) && scales.size(2) == pages.size(2),
              "FP8 scales: float32 [pages, page_size, Hkv], contiguous, like the pages");
  return {static_cast<const uint8_t*>(pages.data_ptr()), scales.data_ptr<float>(), kind};
}
