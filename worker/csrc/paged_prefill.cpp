// Paged prefill attention on CPU: the queries of a prefill chunk (behind a cached prefix
// or not) against every key they see, read from the KV pages in place, flash-style: blocks
// of keys, a running max and sum per query row, no [q, kv] score matrix and no mask.
//
// Why not torch's fused SDPA kernel: it needs the pages gathered into one K and V first
// (a copy of the context per layer), KV repeated to the query heads or two calls merged
// by log-sum-exp behind a prefix, and it computes bfloat16 in float32 FMAs: on a CPU
// with bf16 dot products (AVX512_BF16) it ran bf16 at its float32 rate (~135 GFLOP/s on
// 2 cores of an AMD EPYC), where the same CPU's bf16 matmul runs 3-4x faster. Here a
// work item is one KV head and a block of query tokens: the G query heads that read the
// KV head are rows of one tile, so each K and V row is read once for all of them; both
// products are register-tiled like a GEMM (a query row's broadcast against vectors of
// keys, then a weight against vectors of V); the softmax runs on a row of a key block
// at a time. bfloat16 goes through VDPBF16PS where the CPU has it (~2x torch's rate);
// float32 at or above torch's rate (on a Zen 4, 77-92% of its float32 matmul rate with
// AVX-512, 79-84% with AVX2 alone), float16 and (without VDPBF16PS) bfloat16 widened to float32.
//
// Layouts are paged_decode's: q [T, H, D] (D contiguous), k_cache / v_cache [num_pages,
// page_size, Hkv, D] contiguous, out [T, H, D] contiguous. Sequence b has its n_q[b]
// queries at rows rows[b] .. rows[b] + n_q[b] - 1, the last of them seeing kv_lens[b]
// keys and each one before it one key fewer (causal, aligned to the right: the first
// kv_lens[b] - n_q[b] keys are the cached prefix); its pages are kv_indices[page_start[b]
// ...]. The softmax and every sum are float32, the output rounded once to the inputs'
// dtype; with the bf16 dot product the softmax weights are rounded to bf16 for the
// product with V, as GPU flash attention does.
//
// FP8 KV (fp8.h): a key block's FP8 rows of the item's KV head are widened in registers,
// each times its scale, into q's dtype as they are packed (bf16), or into rows of q's
// dtype that the packing then reads as pages of it: the output is bit for bit that over
// those rows stored in q's dtype.

#include "kernels.h"
#include "kv_rows.h"
#include "vec_math.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// The register tiles: accumulators, a score tile's vectors of keys and the vectors of a
// V row a value tile takes at a time (its rows then sweep the keys once per such chunk).
// AVX2 has 16 registers and its loads are what runs out first (two a cycle on a Zen 4,
// against two FMAs): 6 query rows x 2 vectors of keys, then 3 rows x 4 vectors of V,
// load a vector per 1.5-2 FMAs, where 2 x 4 and 1 x 8 loaded one per FMA (x86-64-v3
// build on a Zen 4, float32 1,000 queries behind 12,000: 95 -> 145-155 GFLOP/s). AVX-512:
// 6 rows x 4 vectors both ways; with 4 x 4 GCC folded every key load into its FMA, 20 loads
// to 16 FMAs (Zen 4 float32: 91-151 -> 149-181 GFLOP/s; bf16, whose tiles these also size,
// unchanged at 287-337).
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kAccumulators = 24;  // of 32 vector registers
constexpr int64_t kKeyVectors = 4;
constexpr int64_t kValueVectors = 8;  // a whole row of head dim 128
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kAccumulators = 12;  // of 16
constexpr int64_t kKeyVectors = 2;
constexpr int64_t kValueVectors = 4;
#else
constexpr int kLanes = 8;
constexpr int kAccumulators = 8;  // of 16
constexpr int64_t kKeyVectors = 4;
constexpr int64_t kValueVectors = 8;
#endif
typedef float vfloat __attribute__((vector_size(4 * kLanes)));

constexpr int64_t kBlockQ = 128;         // query tokens a work item takes (times G rows): each
                                         // packs every key block of the context, so 128
                                         // over 64 halves the packing (4 x 216 behind 2,800
                                         // tokens: +5-7%)
constexpr int64_t kBlockVectors = 8;     // a key block is this many: the softmax's per-row
                                         // work (max and sum across the lanes, rescaling
                                         // the output) comes once a block, so 128 keys over
                                         // 64 halve it (216 queries behind 2,800: +5-10%
                                         // on one thread; 256 keys lost 3-13%)
constexpr int64_t kBlockK = kBlockVectors * kLanes;
static_assert(kBlockVectors % kKeyVectors == 0, "a key block is whole score tiles");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// x in every lane: one VBROADCASTSS (vfloat{} + x cost an add before it)
inline vfloat vsplat(float x) {
#ifdef __AVX512F__
  return (vfloat)_mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)
  return (vfloat)_mm256_set1_ps(x);
#else
  return vfloat{} + x;
#endif
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The largest and the sum of a vector's 8 lanes.
inline float lanes_max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float lanes_sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

// S[r, k0 + j] = Q[r, :] . Kt[:, k0 + j] for RT rows r0.. and the kKeyVectors vectors of
// keys from k0.
template <int RT, int64_t kD>
inline void scores_tile(const float* qt, const float* kt, float* s, int64_t r0, int64_t k0) {
  vfloat acc[RT][kKeyVectors] = {};
  for (int64_t d = 0; d < kD; ++d) {
    vfloat kv[kKeyVectors];
    for (int v = 0; v < kKeyVectors; ++v) kv[v] = vload(kt + d * kBlockK + k0 + v * kLanes);
    for (int r = 0; r < RT; ++r) {
      const vfloat qb = vsplat(qt[(r0 + r) * kD + d]);
      for (int v = 0; v < kKeyVectors; ++v) acc[r][v] += qb * kv[v];
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kKeyVectors; ++v)
      vstore(s + (r0 + r) * kBlockK + k0 + v * kLanes, acc[r][v]);
}

// O[r, :] += P[r, :n] @ V[:n, :] for RT rows r0.. (V rows contiguous, kD wide), VC
// vectors of the row at a time.
template <int RT, int64_t kD>
inline void values_tile(const float* p, const float* vb, float* o, int64_t r0, int64_t n) {
  constexpr int64_t VD = kD / kLanes, VC = std::min(VD, kValueVectors);
  for (int64_t c = 0; c < VD; c += VC) {
    vfloat acc[RT][VC];
    for (int r = 0; r < RT; ++r)
      for (int64_t v = 0; v < VC; ++v) acc[r][v] = vload(o + (r0 + r) * kD + (c + v) * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      vfloat vv[VC];
      for (int64_t v = 0; v < VC; ++v) vv[v] = vload(vb + j * kD + (c + v) * kLanes);
      for (int r = 0; r < RT; ++r) {
        const vfloat pb = vsplat(p[(r0 + r) * kBlockK + j]);
        for (int64_t v = 0; v < VC; ++v) acc[r][v] += pb * vv[v];
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int64_t v = 0; v < VC; ++v) vstore(o + (r0 + r) * kD + (c + v) * kLanes, acc[r][v]);
  }
}

#ifdef __AVX512BF16__
// bfloat16 K, V and queries: the products as pairs of bf16 multiplied and summed into
// float32 lanes (VDPBF16PS), twice the multiplies of a float32 FMA per instruction. A
// 32-bit word holds two neighbours along the reduction: (q[2p], q[2p+1]) of a query row
// against (k[2p], k[2p+1]) of 16 keys; then (w[2j], w[2j+1]) of a row's weights against
// (v[2j][d], v[2j+1][d]) of 16 dims. The weights are rounded to bf16 for that product,
// as GPU flash attention rounds them.
template <int RT, int64_t kD>
inline void scores_tile_bf16(const uint32_t* qt, const uint32_t* kp, float* s, int64_t r0,
                             int64_t k0, float scale) {
  __m512 acc[RT][kKeyVectors];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kKeyVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kD / 2; ++p) {
    __m512bh kv[kKeyVectors];
    for (int v = 0; v < kKeyVectors; ++v)
      kv[v] = (__m512bh)_mm512_loadu_si512(kp + p * kBlockK + k0 + v * kLanes);
    for (int r = 0; r < RT; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qt[(r0 + r) * (kD / 2) + p]);
      for (int v = 0; v < kKeyVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qb, kv[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < kKeyVectors; ++v)
      _mm512_storeu_ps(s + (r0 + r) * kBlockK + k0 + v * kLanes, _mm512_mul_ps(acc[r][v], sc));
}

template <int RT, int64_t kD>
inline void values_tile_bf16(const uint32_t* w, const uint32_t* vp, float* o, int64_t r0,
                             int64_t pairs) {
  constexpr int64_t VD = kD / kLanes;
  __m512 acc[RT][VD];
  for (int r = 0; r < RT; ++r)
    for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_loadu_ps(o + (r0 + r) * kD + v * kLanes);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh vv[VD];
    for (int64_t v = 0; v < VD; ++v)
      vv[v] = (__m512bh)_mm512_loadu_si512(vp + j * kD + v * kLanes);
    for (int r = 0; r < RT; ++r) {
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(w[(r0 + r) * (kBlockK / 2) + j]);
      for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wb, vv[v]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int64_t v = 0; v < VD; ++v) _mm512_storeu_ps(o + (r0 + r) * kD + v * kLanes, acc[r][v]);
}

// A row of kBlockK float32 weights as bf16 pairs (round to nearest even).
inline void weights_to_bf16(const float* s, uint32_t* w) {
  for (int64_t j = 0; j < kBlockK; j += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j));
    _mm512_storeu_si512(w + j / 2, (__m512i)h);
  }
}

// 16 rows of 16 32-bit words transposed in registers: r[c] becomes column c (four
// rounds: pairs of words, pairs of pairs, then 128-bit lanes twice).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e]: rows 4i..4i+3, word 4L + e of each lane L
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i lo01 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
    const __m512i lo23 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    const __m512i hi01 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i hi23 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
  }
  for (int c = 0; c < 16; ++c) r[c] = t[c];
}

// A key block's rows of one KV head as the bf16 packing reads them, 32 dims at a time:
// bf16 rows where they are, or FP8 rows widened in registers, each times its scale.
struct Bf16Rows {
  const c10::BFloat16* const* bf16 = nullptr;
  const uint8_t* const* fp8 = nullptr;
  const __m512* factor = nullptr;  // each FP8 row's half_factor
  Fp8Kind kind = Fp8Kind::kE4M3;

  __m512i load32(int64_t j, int64_t d) const {
    return bf16 ? _mm512_loadu_si512(bf16[j] + d) : fp8x32_to_bf16(fp8[j] + d, factor[j], kind);
  }
};

// The key block's K rows (j < n; zeros past n) as (k[2p], k[2p+1]) pairs with the keys
// along the vectors: k32[p * kBlockK + j], 16 keys x 16 pairs a transpose.
template <int64_t kD>
inline void pack_keys_bf16(const Bf16Rows& krow, int64_t n, uint32_t* k32) {
  for (int64_t j0 = 0; j0 < kBlockK; j0 += 16)
    for (int64_t p0 = 0; p0 < kD / 2; p0 += 16) {
      __m512i r[16];
      for (int u = 0; u < 16; ++u)
        r[u] = j0 + u < n ? krow.load32(j0 + u, 2 * p0) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(k32 + (p0 + c) * kBlockK + j0, r[c]);
    }
}

// The key block's V rows as (v[2j][d], v[2j+1][d]) pairs along d: v32[j * kD + d] for the
// (n + 1) / 2 key pairs j (an odd last key paired with zeros).
template <int64_t kD>
inline void pack_values_bf16(const Bf16Rows& vrow, int64_t n, uint32_t* v32) {
  const PairInterleave pairs;
  for (int64_t j = 0; 2 * j < n; ++j) {
    for (int64_t d = 0; d < kD; d += 32) {
      const __m512i x = vrow.load32(2 * j, d);
      const __m512i y = 2 * j + 1 < n ? vrow.load32(2 * j + 1, d) : _mm512_setzero_si512();
      __m512i out[2];
      pairs(x, y, out);
      _mm512_storeu_si512(v32 + j * kD + d, out[0]);
      _mm512_storeu_si512(v32 + j * kD + d + 16, out[1]);
    }
  }
}
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// One row of a key block: its `seen` scores become weights exp(score - max) (0 past
// them), its running max m and sum l move on; returns the factor its output so far is
// rescaled by. With AVX-512 or AVX2 the row is kBlockVectors vectors, the max and sum
// reduced in registers (the plain loops were half of a bf16 prefill's time with AVX-512,
// a third of a float32 one with AVX2, where the compiler left the exp scalar); weights
// for a bf16 product with V come from the shorter exp (vec_math.h).
template <bool kBf16Weights>
inline float softmax_row(float* sr, int64_t seen, float& m, float& l) {
#ifdef __AVX512F__
  static_assert(kLanes == 16, "a key block is AVX-512 vectors");
  __m512 x[kBlockVectors];
  __mmask16 valid[kBlockVectors];
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int v = 0; v < kBlockVectors; ++v) {
    const int64_t lanes = std::clamp<int64_t>(seen - 16 * v, 0, 16);
    valid[v] = static_cast<__mmask16>((1u << lanes) - 1u);
    x[v] = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), valid[v], sr + 16 * v);
    vmax = _mm512_max_ps(vmax, x[v]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  // ~0 at the row's first block; 1 while the max stands
  const float alpha = m_new == m ? 1.f : exp_nonpositive(m - m_new);
  const __m512 shift = _mm512_set1_ps(kBf16Weights ? m_new * 1.4426950408889634f : m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < kBlockVectors; ++v) {
    __m512 p;
    if constexpr (kBf16Weights)
      p = exp_shifted_for_bf16(x[v], shift, valid[v]);  // the shift times log2(e)
    else
      p = _mm512_maskz_mov_ps(valid[v], exp_nonpositive(_mm512_sub_ps(x[v], shift)));
    _mm512_storeu_ps(sr + 16 * v, p);
    sum = _mm512_add_ps(sum, p);
  }
  m = m_new;
  l = l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
#elif defined(__AVX2__) && defined(__FMA__)
  // the same on 8 lanes; the lanes past `seen` are -inf into the max and 0 out of the exp
  static_assert(kLanes == 8, "a key block is AVX2 vectors");
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 x[kBlockVectors], valid[kBlockVectors];
  __m256 vmax = neg_inf;
  for (int v = 0; v < kBlockVectors; ++v) {
    const int64_t lanes = std::clamp<int64_t>(seen - 8 * v, 0, 8);
    valid[v] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), lane));
    x[v] = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(sr + 8 * v), valid[v]);
    vmax = _mm256_max_ps(vmax, x[v]);
  }
  const float m_new = std::max(m, lanes_max8(vmax));
  const float alpha = m_new == m ? 1.f : exp_nonpositive(m - m_new);
  const __m256 shift = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int v = 0; v < kBlockVectors; ++v) {
    const __m256 p = _mm256_and_ps(valid[v], exp_nonpositive(_mm256_sub_ps(x[v], shift)));
    _mm256_storeu_ps(sr + 8 * v, p);
    sum = _mm256_add_ps(sum, p);
  }
  m = m_new;
  l = l * alpha + lanes_sum8(sum);
  return alpha;
#else
  float mx = kNegInf;
  for (int64_t j = 0; j < seen; ++j) mx = std::max(mx, sr[j]);
  const float m_new = std::max(m, mx);
  const float alpha = exp_nonpositive(m - m_new);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < seen; ++j) {
    sr[j] = exp_nonpositive(sr[j] - m_new);
    sum += sr[j];
  }
  for (int64_t j = seen; j < kBlockK; ++j) sr[j] = 0.f;
  m = m_new;
  l = l * alpha + sum;
  return alpha;
#endif
}

// The online softmax of rows [r0, r1) of one key block (scores in `s`, n keys of which
// the rows see a causal share): each row's weights replace its scores, its running max
// `m` and sum `l` move on, and its output so far is rescaled. Query token t (row
// r = t * G + g) sees keys up to first_limit + t.
template <int64_t kD, bool kBf16Weights>
inline void softmax_rows(float* s, float* m, float* l, float* o, int64_t r0, int64_t r1,
                         int64_t G, int64_t kb, int64_t n, int64_t first_limit) {
  const bool diagonal = kb + n - 1 > first_limit;  // some row sees only part of the block
  for (int64_t r = r0; r < r1; ++r) {
    float* sr = s + r * kBlockK;
    const int64_t seen = diagonal ? std::min(n, first_limit + r / G + 1 - kb) : n;
    if (seen <= 0) {  // keys all after this row's position: weight 0
      std::fill(sr, sr + kBlockK, 0.f);
      continue;
    }
    const float alpha = softmax_row<kBf16Weights>(sr, seen, m[r], l[r]);
    if (alpha != 1.f) {
      float* orow = o + r * kD;
      for (int64_t d = 0; d < kD; ++d) orow[d] *= alpha;
    }
  }
}

// One work item: KV head hk, query tokens [t0, t0 + nt) of a sequence whose queries start
// at q row `row0`, over the keys they see. Rows of the tile are r = t * G + g.
template <typename scalar_t, int64_t kD>
struct Prefill {
  const scalar_t* q;
  int64_t q_row_stride, q_head_stride;
  const scalar_t* k_cache;  // nullptr with FP8 pages
  const scalar_t* v_cache;
  Fp8Pages k8, v8;
  scalar_t* out;
  int64_t H, Hkv, page_size;
  float scale;

  static constexpr int RS = std::max<int>(1, kAccumulators / kKeyVectors);  // score rows
  static constexpr int RV =  // value rows
      std::max<int>(1, kAccumulators / std::min<int64_t>(kD / kLanes, kValueVectors));
  static constexpr bool kBf16Dot = kHasBf16Dot && std::is_same_v<scalar_t, c10::BFloat16>;
  static constexpr int kGroup = std::max(RS, RV);  // rows through the passes at once

  struct BlockRows {  // one key block's buffers, as run() lays them out
    const float* qt;
    const float* kt;
    const float* vb;
    float* s;
    float* w;
    float* m;
    float* l;
    float* o;
    int64_t G, kb, n, first_limit;
  };

  // Rows [r0, r0 + R) of the tile through one key block: scores, online softmax, then the
  // weights times V into their outputs.
  template <int R>
  void block_rows(const BlockRows& b, int64_t r0) const {
    constexpr int kS = std::min(R, RS), kV = std::min(R, RV);
    for (int i = 0; i < R; i += kS) scores<kS>(b.qt, b.kt, b.s, r0 + i);
    softmax_rows<kD, kBf16Dot>(b.s, b.m, b.l, b.o, r0, r0 + R, b.G, b.kb, b.n, b.first_limit);
    if constexpr (kBf16Dot) {
#ifdef __AVX512BF16__
      uint32_t* w16 = reinterpret_cast<uint32_t*>(b.w);
      for (int i = 0; i < R; ++i)
        weights_to_bf16(b.s + (r0 + i) * kBlockK, w16 + (r0 + i) * (kBlockK / 2));
      const uint32_t* v16 = reinterpret_cast<const uint32_t*>(b.vb);
      const int64_t pairs = (b.n + 1) / 2;
      for (int i = 0; i < R; i += kV) values_tile_bf16<kV, kD>(w16, v16, b.o, r0 + i, pairs);
#endif
    } else {
      for (int i = 0; i < R; i += kV) values_tile<kV, kD>(b.s, b.vb, b.o, r0 + i, b.n);
    }
  }

  void run(int64_t row0, int64_t prefix, int64_t t0, int64_t nt, int64_t hk,
           const int32_t* pages, std::vector<float>& buf) const {
    const int64_t G = H / Hkv, M = nt * G, slot_stride = Hkv * kD;
    // float32 words; the bf16 path keeps pairs of bf16 in some of them
    // FP8 without the bf16 dot product: a key block's K and V rows of this head read back
    constexpr size_t kWidened = kBf16Dot ? 0 : (2 * kBlockK * kD * sizeof(scalar_t) + 3) / 4;
    const size_t words = M * kD * 2 + M * kBlockK * 2 + kD * kBlockK + kBlockK * kD + 2 * M + kD +
                         (k8 ? kWidened : 0);
    if (buf.size() < words) buf.resize(words);  // grown only: every part is set before use
    float* qt = buf.data();             // [M, D]: scaled floats, or bf16 pairs [M, D/2]
    float* o = qt + M * kD;             // [M, D]
    float* s = o + M * kD;              // [M, kBlockK]: scores, then weights
    float* w = s + M * kBlockK;         // [M, kBlockK / 2]: the weights as bf16 pairs
    float* kt = w + M * kBlockK;        // [D, kBlockK] floats, or [D/2, kBlockK] bf16 pairs
    float* vb = kt + kD * kBlockK;      // [kBlockK, D] floats, or [kBlockK/2, D] bf16 pairs
    float* m = vb + kBlockK * kD;       // [M] running max
    float* l = m + M;                   // [M] running sum
    float* row = l + M;                 // [D] one widened 16-bit row
    scalar_t* widened = reinterpret_cast<scalar_t*>(row + kD);  // FP8: [2, kBlockK, D]
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = q + (row0 + t0 + t) * q_row_stride + (hk * G + g) * q_head_stride;
        if constexpr (kBf16Dot) {
          std::memcpy(qt + (t * G + g) * (kD / 2), src, kD * sizeof(scalar_t));
        } else {
          const float* x = as_float(src, row, kD);
          float* dst = qt + (t * G + g) * kD;
          for (int64_t d = 0; d < kD; ++d) dst[d] = x[d] * scale;
        }
      }
    std::fill(o, o + M * kD, 0.f);
    std::fill(m, m + M, kNegInf);
    std::fill(l, l + M, 0.f);
    const int64_t first_limit = prefix + t0, end = prefix + t0 + nt;
    for (int64_t kb = 0; kb < end; kb += kBlockK) {
      const int64_t n = std::min(kBlockK, end - kb);
      pack(kt, vb, row, widened, kb, n, end, hk, pages, slot_stride);
      // A group of rows at a time through all three passes (scores, softmax, weights
      // times V), so that its scores and weights are still in L1 when the next pass reads
      // them (a pass over all M rows streamed them through L2 three times).
      const BlockRows rows{qt, kt, vb, s, w, m, l, o, G, kb, n, first_limit};
      int64_t r = 0;
      for (; r + kGroup <= M; r += kGroup) block_rows<kGroup>(rows, r);
      for (; r < M; ++r) block_rows<1>(rows, r);
    }
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t rr = t * G + g;
        const float inv = 1.f / l[rr];
        scalar_t* dst = out + ((row0 + t0 + t) * H + hk * G + g) * kD;
        for (int64_t d = 0; d < kD; ++d) dst[d] = static_cast<scalar_t>(o[rr * kD + d] * inv);
      }
  }

  // Scores of RT rows from r0 against the whole key block, a tile of keys at a time.
  template <int RT>
  void scores(const float* qt, const float* kt, float* s, int64_t r0) const {
    for (int64_t k0 = 0; k0 < kBlockK; k0 += kKeyVectors * kLanes) {
      if constexpr (kBf16Dot) {
#ifdef __AVX512BF16__
        scores_tile_bf16<RT, kD>(reinterpret_cast<const uint32_t*>(qt),
                                 reinterpret_cast<const uint32_t*>(kt), s, r0, k0, scale);
#endif
      } else {
        scores_tile<RT, kD>(qt, kt, s, r0, k0);
      }
    }
  }

  // The rows of KV head hk for the keys [kb, kb + n): in the pages, or (FP8) read back
  // into `widened` (kD apart).
  void head_rows(const scalar_t* cache, const Fp8Pages& fp8, int64_t kb, int64_t n, int64_t hk,
                 const int32_t* pages, int64_t slot_stride, scalar_t* widened,
                 const scalar_t** rows) const {
    if (fp8) {
      for_each_slot(pages, kb, kb + n, page_size, [&](int64_t j, int64_t slot) {
        const int64_t at = slot * Hkv + hk;
        dequantize_vector(fp8.data + at * kD, fp8.scales[at], kD, fp8.kind, widened + j * kD);
        rows[j] = widened + j * kD;
      });
    } else {
      for_each_row(cache, pages, kb, kb + n, page_size, slot_stride,
                   [&](int64_t j, const scalar_t* r) { rows[j] = r + hk * kD; });
    }
  }

  // The rows of KV head hk for the keys [kb, next) towards L1 (the pages, FP8 or not, are
  // scattered runs of 16 rows: the hardware prefetcher does not cross them).
  void fetch_rows(int64_t kb, int64_t next, int64_t hk, const int32_t* pages,
                  int64_t slot_stride) const {
    if (k8) {
      for_each_slot(pages, kb, next, page_size, [&](int64_t, int64_t slot) {
        prefetch_lines(k8.data + (slot * Hkv + hk) * kD, kD);
        prefetch_lines(v8.data + (slot * Hkv + hk) * kD, kD);
      });
      return;
    }
    auto fetch = [&](int64_t, const scalar_t* r) {
      prefetch_lines(r + hk * kD, kD * sizeof(scalar_t));
    };
    for_each_row(k_cache, pages, kb, next, page_size, slot_stride, fetch);
    for_each_row(v_cache, pages, kb, next, page_size, slot_stride, fetch);
  }

  // The key block [kb, kb + n) of KV head hk: K transposed (keys along the vectors), V
  // as rows; past n, zeros. With the bf16 dot product, K as (k[2p], k[2p+1]) pairs per
  // key and V as (v[2j][d], v[2j+1][d]) pairs per dim, both packed in registers (the
  // word-by-word copies took a third of a bf16 prefill), V only as far as the block's
  // last pair (values_tile_bf16 reads no further).
  // (FP8 with the bf16 dot product: the rows widened in registers as they are packed;
  // otherwise into `widened` first.)
  void pack(float* kt, float* vb, float* row, scalar_t* widened, int64_t kb, int64_t n,
            int64_t end, int64_t hk, const int32_t* pages, int64_t slot_stride) const {
    const scalar_t* krow[kBlockK];
    const scalar_t* vrow[kBlockK];
    if constexpr (kBf16Dot) {
#ifdef __AVX512BF16__
      Bf16Rows keys{krow}, values{vrow};
      const uint8_t* k8row[kBlockK];
      const uint8_t* v8row[kBlockK];
      __m512 k_factor[kBlockK], v_factor[kBlockK];
      if (k8) {
        for_each_slot(pages, kb, kb + n, page_size, [&](int64_t j, int64_t slot) {
          const int64_t at = slot * Hkv + hk;
          k8row[j] = k8.data + at * kD;
          v8row[j] = v8.data + at * kD;
          k_factor[j] = _mm512_set1_ps(half_factor(k8.scales[at], k8.kind));
          v_factor[j] = _mm512_set1_ps(half_factor(v8.scales[at], v8.kind));
        });
        keys = {nullptr, k8row, k_factor, k8.kind};
        values = {nullptr, v8row, v_factor, v8.kind};
      } else {
        head_rows(k_cache, k8, kb, n, hk, pages, slot_stride, widened, krow);
        head_rows(v_cache, v8, kb, n, hk, pages, slot_stride, widened, vrow);
      }
      pack_keys_bf16<kD>(keys, n, reinterpret_cast<uint32_t*>(kt));
      pack_values_bf16<kD>(values, n, reinterpret_cast<uint32_t*>(vb));
      // the next block's rows towards L1 while this one is multiplied
      const int64_t next = std::min(kb + 2 * kBlockK, end);
      if (kb + kBlockK < next) fetch_rows(kb + kBlockK, next, hk, pages, slot_stride);
#endif
    } else {
      head_rows(k_cache, k8, kb, n, hk, pages, slot_stride, widened, krow);
      head_rows(v_cache, v8, kb, n, hk, pages, slot_stride, widened + kBlockK * kD, vrow);
      std::fill(kt, kt + kD * kBlockK, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float* x = as_float(krow[j], row, kD);
        for (int64_t d = 0; d < kD; ++d) kt[d * kBlockK + j] = x[d];
      }
      for (int64_t j = 0; j < n; ++j)
        std::memcpy(vb + j * kD, as_float(vrow[j], row, kD), kD * sizeof(float));
    }
  }
};

template <typename scalar_t, int64_t kD>
void prefill(const Prefill<scalar_t, kD>& p, const int64_t* rows, const int64_t* n_q,
             const int64_t* page_start, const int64_t* kv_lens, const int32_t* kv_indices,
             int64_t B) {
  // Work items (sequence, query block, KV head). A block late in a causal prefill sees
  // more keys than an early one, and each thread takes a contiguous run of items: so
  // the blocks are taken from both ends in turn (first, last, second, ...), which gives
  // every run about the same number of keys.
  struct Item {
    int64_t b, t0, hk;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nb = (n_q[b] + kBlockQ - 1) / kBlockQ;
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t block = i % 2 == 0 ? i / 2 : nb - 1 - i / 2;
      for (int64_t hk = 0; hk < p.Hkv; ++hk) items.push_back({b, block * kBlockQ, hk});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;  // kept by each thread: a fresh 0.6 MB page-faults
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t nt = std::min(kBlockQ, n_q[it.b] - it.t0);
      p.run(rows[it.b], kv_lens[it.b] - n_q[it.b], it.t0, nt, it.hk,
            kv_indices + page_start[it.b], buf);
    }
  });
}

}  // namespace

void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                   torch::Tensor v_cache, torch::Tensor rows, torch::Tensor n_q,
                   torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
                   double scale, std::optional<torch::Tensor> k_scale,
                   std::optional<torch::Tensor> v_scale) {
  const std::pair<Fp8Pages, Fp8Pages> fp8 = check_paged_inputs(
      out, q, k_cache, v_cache, rows, n_q, page_start, kv_lens, kv_indices, k_scale, v_scale);
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(D == 32 || D == 64 || D == 128, "paged_prefill takes head_dim 32, 64 or 128, not ",
              D);
  auto run = [&](auto zero, auto dim) {
    using scalar_t = decltype(zero);
    constexpr int64_t kD = decltype(dim)::value;
    const Prefill<scalar_t, kD> p{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
                                  fp8.first ? nullptr : k_cache.data_ptr<scalar_t>(),
                                  fp8.second ? nullptr : v_cache.data_ptr<scalar_t>(),
                                  fp8.first, fp8.second, out.data_ptr<scalar_t>(), H, Hkv,
                                  k_cache.size(1), static_cast<float>(scale)};
    prefill(p, rows.data_ptr<int64_t>(), n_q.data_ptr<int64_t>(),
            page_start.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
            kv_indices.data_ptr<int32_t>(), rows.numel());
  };
  auto by_dim = [&](auto zero) {
    if (D == 32)
      run(zero, std::integral_constant<int64_t, 32>{});
    else if (D == 64)
      run(zero, std::integral_constant<int64_t, 64>{});
    else
      run(zero, std::integral_constant<int64_t, 128>{});
  };
  switch (q.scalar_type()) {
    case at::kFloat: by_dim(0.f); break;
    case at::kBFloat16: by_dim(c10::BFloat16(0.f)); break;
    case at::kHalf: by_dim(c10::Half(0.f)); break;
    default: TORCH_CHECK(false, "paged_prefill takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
}
