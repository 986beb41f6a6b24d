// Scalar math written so that the compiler vectorizes the loops that call it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp does not, and a
// decode takes one per context token and query head): 2^(x log2 e) split into an
// integer part (the exponent bits) and a fraction in [-0.5, 0.5] (a degree-6
// polynomial, relative error 1e-7, float32's own rounding).
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5465312520617985e-4f;
  p = p * f + 1.3395279800723324e-3f;
  p = p * f + 9.6180399450030800e-3f;
  p = p * f + 5.5503406807439634e-2f;
  p = p * f + 2.4022651101321707e-1f;
  p = p * f + 6.9314720006268040e-1f;
  p = p * f + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

// exp_nonpositive's polynomial for 2^f (highest power first) for the vector versions
inline constexpr float kExpPow2[] = {1.5465312520617985e-4f, 1.3395279800723324e-3f,
                                     9.6180399450030800e-3f, 5.5503406807439634e-2f,
                                     2.4022651101321707e-1f, 6.9314720006268040e-1f, 1.f};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes (AVX2): the same polynomial; with no VSCALEFPS the power of
// two is built in the exponent bits (n >= -126 after the clamp, a normal float).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)),
                                 _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExpPow2[0]);
  for (size_t i = 1; i < std::size(kExpPow2); ++i)
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPow2[i]));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#ifdef __AVX512F__

// 2^t on 16 lanes: n = round(t) and the fraction f = t - n in [-0.5, 0.5], 2^f by
// Horner's rule on `coeffs` (highest power first, the constant 1 last); returns that
// polynomial and sets n, for VSCALEFPS to make p * 2^n. The exps below differ only in
// the polynomial and in what they do around it.
template <size_t N>
inline __m512 pow2_fraction(__m512 t, const float (&coeffs)[N], __m512& n) {
  n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(coeffs[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coeffs[i]));
  return p;
}

// exp_nonpositive on 16 lanes: the same polynomial, the power of two by VSCALEFPS.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(1.4426950408889634f));
  __m512 n;
  const __m512 p = pow2_fraction(t, kExpPow2, n);
  return _mm512_scalef_ps(p, n);
}

// exp(x - m) for the softmax weights of a bf16 product with V (they are rounded to bf16,
// 2^-9, right after), where `m_log2e` is m log2(e): a degree-4 polynomial (relative error
// 3e-6) and the shift folded into one FMA, zero in the lanes `keep` leaves out (their x
// may be -inf). Three instructions a vector fewer than exp_nonpositive.
inline __m512 exp_shifted_for_bf16(__m512 x, __m512 m_log2e, __mmask16 keep) {
  static constexpr float kPow2[] = {9.582850150763988e-3f, 5.590643361210823e-2f,
                                    2.4024099111557007e-1f, 6.931241750717163e-1f, 1.f};
  const __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.4426950408889634f), m_log2e);
  __m512 n;
  const __m512 p = pow2_fraction(t, kPow2, n);
  return _mm512_maskz_scalef_ps(keep, p, n);
}
#endif
