// Paged decode attention on CPU: a few query tokens per sequence (one for a decode; up
// to 16 for a speculative verify), read straight from the KV pages (no gather into a
// padded copy), split along the context so that every thread has work even for one
// sequence (flash-decoding), then merged. A sequence's query rows share each read of a
// K or V row: a verify of 1 + K tokens reads the context once, not 1 + K times.
//
// Sequences whose page lists name the same pages (agents on one system prompt, through
// the prefix cache) read each split they share once, as one work item for all their
// query rows (plan_items): a decode step of 4 agents on a shared 2,000 tokens reads
// about half the bytes. Splits sit where each sequence alone would split them, so a
// sequence's output does not depend on who shares its pages.
//
// A thread claims its next work item before it runs one, and streams that item's K and V
// rows towards L2 while this one computes (AheadStream), so memory and arithmetic overlap.
//
// With AVX-512 and head dim 64 or 128 a split runs as vector passes (DecodeAvx512): the
// scores of 16 keys at a time per query row, bf16 dot products in VDPBF16PS where the
// CPU has it; the weighted V rows summed into register tiles of the query rows that
// share a KV head (bf16: weights and V rows as bf16 pairs, VDPBF16PS again). With AVX2
// and FMA but no AVX-512 the same two passes run on 8 lanes in float32 (DecodeAvx2).
// Elsewhere a scalar loop the compiler vectorizes per dot product.
//
// Layouts (the torch backend's): q [T, H, D] (any row and head stride, D contiguous),
// k_cache / v_cache [num_pages, page_size, Hkv, D] contiguous, out [T, H, D]
// contiguous. Decode sequence b has its n_q[b] queries at rows rows[b] ..
// rows[b] + n_q[b] - 1, its pages at kv_indices[page_start[b] : page_start[b] +
// ceil(kv_lens[b] / page_size)]; its last query sees kv_lens[b] keys, each one before
// it one key fewer (causal). Query head h reads KV head h / G (G = H / Hkv), as HF's
// repeat_kv does.
//
// FP8 KV (fp8.h): a work item reads its split's FP8 rows once, at half the bytes of bf16,
// and widens them in registers, each times its scale, into rows of q's dtype in the
// thread's buffer; from there the passes run as over KV of that dtype, so the output is
// bit for bit that of those rows stored in q's dtype.

#include "kernels.h"
#include "kv_rows.h"
#include "vec_math.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

// Context tokens per work item: small enough that one sequence gives both cores
// work, large enough that the merge is noise.
constexpr int64_t kSplit = 256;

// The next work item's K and V rows, fetched towards L2 a few lines at a time while this
// item computes (pump: every 16 keys of the scores and of each value tile), so that
// reading memory and the arithmetic overlap. Fetching a whole split at the start of its
// own item, as the first item of a thread still does, made them add up: with K and V in
// cache an item's arithmetic ran at ~36 ns a key, from memory at ~120 (tiny model, 8
// query heads, bf16, Zen 4); streamed, ~80, and a decode step's KV read went from 16-17 to
// 24-26 GB/s on two cores (the scattered 8 KB pages' own read ceiling there, ~24).
// Towards L2, not L1: PREFETCHT0 there halved the rate (the next split evicts this one's
// rows from L1).
struct AheadStream {
  const char* const* rows = nullptr;
  int64_t lines = 0, row_bytes = 0, at = 0;  // at: lines asked for so far
  int64_t row = 0, offset = 0;               // where the next line is
  void start(const void* const* r, int64_t count, int64_t bytes) {
    rows = reinterpret_cast<const char* const*>(r);
    row_bytes = (bytes + 63) / 64 * 64;
    lines = count * (row_bytes / 64);
    at = row = offset = 0;
  }
  inline void pump(int64_t n) {
    const int64_t end = std::min(at + n, lines);
    for (; at < end; ++at) {
      __builtin_prefetch(rows[row] + offset, 0, kToL2);
      offset += 64;
      if (offset == row_bytes) offset = 0, ++row;
    }
  }
  void finish() { pump(lines); }
};

#ifdef __AVX512F__
// The AVX-512 work item (head dims 64 and 128, float32 / bfloat16 / float16 KV): the
// scores of 16 keys at a time against one query row, each key's dot product left as a
// vector of partial sums (VDPBF16PS on bf16 pairs where the CPU has it, float32 FMAs
// otherwise) and the 16 vectors reduced together (lane_sums16); then the weighted V
// rows summed into register tiles of query rows. The scalar loop above reduced every
// (key, head) dot product on its own and widened every bf16 row through memory first:
// it read bf16 KV at ~11 GB/s, under half the memory's rate.

// Lane i of the result: the sum of v[i]'s 16 lanes. Four rounds of pairing halves
// (within 128-bit lanes, then across them): 15 adds and 30 shuffles for 16 sums.
inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// 16 elements as float32 lanes.
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {  // bf16 is float32's top half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename scalar_t, int64_t kD>
struct DecodeAvx512 {
#ifdef __AVX512BF16__
  static constexpr bool kPairs = std::is_same_v<scalar_t, c10::BFloat16>;
#else
  static constexpr bool kPairs = false;
#endif
  static constexpr int64_t VD = kD / 16;  // vectors in a head's row
  static constexpr int kTile = 24 / VD;   // query rows per value tile (24 accumulators)
  // The query rows as the dot product takes them: bf16 as stored (pairs), else float32.
  using q_t = std::conditional_t<kPairs, scalar_t, float>;

  // A vector whose lane sum is q . k (one KV head's row of one key).
  static inline __m512 dot(const q_t* q, const scalar_t* k) {
    __m512 acc;
    if constexpr (kPairs) {
#ifdef __AVX512BF16__
      acc = _mm512_setzero_ps();
      for (int64_t v = 0; v < kD / 32; ++v)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * v),
                               (__m512bh)_mm512_loadu_si512(k + 32 * v));
#endif
    } else {
      acc = _mm512_mul_ps(_mm512_loadu_ps(q), widen16(k));
      for (int64_t v = 1; v < VD; ++v)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * v), widen16(k + 16 * v), acc);
    }
    return acc;
  }

  // scores[r * kSplit + i] = scale * q_r . k_i for the rows r (reading the KV head at
  // offset kv_of[r] of a token row) and the keys i < n (their rows in krow, padded to a
  // multiple of 16 by repeats). Each 16 keys fetch the next 16 K rows and their own V
  // rows (for the value pass) ahead: a head's slice of a token row is a short strided
  // stream the hardware prefetcher barely follows (on an AMD EPYC Zen 5 this took a
  // step's KV read from memory from 12 to 15 GB/s a core).
  static void scores(const q_t* qbuf, const int64_t* kv_of, int64_t nrows,
                     const scalar_t* const* krow, const scalar_t* const* vrow, int64_t n,
                     int64_t row_bytes, float scale, float* scores, AheadStream& ahead,
                     int64_t pump) {
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 part[16];
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      ahead.pump(pump);
      for (int64_t i = i0 + 16; i < std::min(n, i0 + 32); ++i) prefetch_lines(krow[i], row_bytes);
      for (int64_t i = i0; i < std::min(n, i0 + 16); ++i) prefetch_lines(vrow[i], row_bytes);
      for (int64_t r = 0; r < nrows; ++r) {
        const q_t* q = qbuf + r * kD;
        for (int u = 0; u < 16; ++u) part[u] = dot(q, krow[i0 + u] + kv_of[r]);
        _mm512_storeu_ps(scores + r * kSplit + i0, _mm512_mul_ps(lane_sums16(part), sc));
      }
    }
  }

  // out[r] = sum_i w[r][i] v_i for RT query rows reading the KV head at offset `kv` of a
  // token row, over the keys i < n. Float32 weights against V rows widened once for the
  // whole tile; with bf16 pairs (kPairs) w[r] holds a row's weights rounded to bf16, keys
  // (2j, 2j + 1) in word j (as the prefill kernel and GPU flash attention round them),
  // and each two V rows are interleaved in registers (VPERMT2W) into (v[2j][d],
  // v[2j + 1][d]) pairs: one VDPBF16PS takes two keys of 16 dims. Widening every V row
  // and one FMA per key made this pass the decode kernel's largest cost. For an odd n
  // vrow[n] must be readable (its weight is 0).
  template <int RT>
  static void values(const void* const* w, const scalar_t* const* vrow, int64_t n, int64_t kv,
                     float* const* out, AheadStream& ahead, int64_t pump) {
    __m512 acc[RT][VD];
    for (int r = 0; r < RT; ++r)
      for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_setzero_ps();
    if constexpr (kPairs) {
#ifdef __AVX512BF16__
      const PairInterleave pairs;
      for (int64_t j = 0; 2 * j < n; ++j) {
        if (j % 8 == 0) ahead.pump(pump);
        const scalar_t* a = vrow[2 * j] + kv;
        const scalar_t* b = vrow[2 * j + 1] + kv;
        __m512bh pv[VD];
        for (int64_t c = 0; c < kD / 32; ++c) {
          __m512i out[2];
          pairs(_mm512_loadu_si512(a + 32 * c), _mm512_loadu_si512(b + 32 * c), out);
          pv[2 * c] = (__m512bh)out[0];
          pv[2 * c + 1] = (__m512bh)out[1];
        }
        for (int r = 0; r < RT; ++r) {
          const __m512bh wb =
              (__m512bh)_mm512_set1_epi32(static_cast<const uint32_t*>(w[r])[j]);
          for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wb, pv[v]);
        }
      }
#endif
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (i % 16 == 0) ahead.pump(pump);
        const scalar_t* row = vrow[i] + kv;
        __m512 x[VD];
        for (int64_t v = 0; v < VD; ++v) x[v] = widen16(row + 16 * v);
        for (int r = 0; r < RT; ++r) {
          const __m512 p = _mm512_set1_ps(static_cast<const float*>(w[r])[i]);
          for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_fmadd_ps(p, x[v], acc[r][v]);
        }
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int64_t v = 0; v < VD; ++v) _mm512_storeu_ps(out[r] + 16 * v, acc[r][v]);
  }

  // A row's weights (i < n, zeros from there to the next multiple of 32) as bf16 pairs
  // for values(), in place: word j (keys 2j, 2j + 1) lands before the floats still to read.
  static void weights_to_pairs(float* sh, int64_t n) {
#ifdef __AVX512BF16__
    uint32_t* pairs = reinterpret_cast<uint32_t*>(sh);
    for (int64_t i = 0; i < n; i += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sh + i + 16), _mm512_loadu_ps(sh + i));
      _mm512_storeu_si512(pairs + i / 2, (__m512i)h);
    }
#endif
  }

  // values<RT> for the last `rows` (< kTile) rows of a head.
  template <int RT>
  static void values_tail(int64_t rows, const void* const* w, const scalar_t* const* vrow, int64_t n,
                          int64_t kv, float* const* out, AheadStream& ahead, int64_t pump) {
    if constexpr (RT > 1) {
      if (rows < RT) return values_tail<RT - 1>(rows, w, vrow, n, kv, out, ahead, pump);
    }
    values<RT>(w, vrow, n, kv, out, ahead, pump);
  }
};
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The AVX2 work item (head dims 64 and 128; float32, bfloat16 and float16 KV, widened to
// float32 in registers): DecodeAvx512's two passes on 8 lanes, for CPUs without AVX-512
// (there bf16 runs as float32: no bf16 units). The scalar loop it replaces reduced every
// (key, head) dot product on its own, widened 16-bit rows through memory and summed the
// weighted V rows in memory: ~2x the instructions a key.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::BFloat16* p) {  // bf16 is float32's top half
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lane i of the result: the sum of v[i]'s 8 lanes (pairs of halves, three rounds).
inline __m256 lane_sums8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  // b0: keys 0-3 in the low half's lanes, their other halves in the high; b1: keys 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// bf16 KV: 16 keys' worth of a row from one 256-bit load as two float32 vectors, each
// pair's low half shifted up (the row's even elements) and its high half masked (the odd
// ones): two instructions for 16 elements where widening 8 at a time took four, and
// those compete with the FMAs for the same ports. q is stored in that order (the evens of
// each 16, then the odds) and the value tiles put their lanes back in order as they store.
inline __m256 bf16_evens(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
inline __m256 bf16_odds(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
}
inline __m256i load_pairs(const c10::BFloat16* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// out[0, 16): the elements whose evens and odds are e and o
inline void store_interleaved(float* out, __m256 e, __m256 o) {
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(lo, hi, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

template <typename scalar_t, int64_t kD>
struct DecodeAvx2 {
  static constexpr int64_t VD = kD / 8;  // vectors in a head's row
  // value tiles: kRows query rows by kChunk vectors of a row (16 registers in all)
  static constexpr int kRows = 2, kChunk = 4;
  // bf16 rows are read as evens and odds (bf16_evens): q's float32 rows in that order
  static constexpr bool kSplitPairs = std::is_same_v<scalar_t, c10::BFloat16>;

  // q's float32 row as the scores read it
  static void store_q(float* dst, const float* q) {
    if constexpr (kSplitPairs) {
      for (int64_t g = 0; g < kD; g += 16)
        for (int l = 0; l < 8; ++l) dst[g + l] = q[g + 2 * l], dst[g + 8 + l] = q[g + 2 * l + 1];
    } else {
      std::memcpy(dst, q, kD * sizeof(float));
    }
  }

  // q_r . k over the row's 8-lane partial sums
  static inline __m256 dot(const float* q, const scalar_t* k) {
    if constexpr (kSplitPairs) {
      const __m256i x = load_pairs(k);
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), bf16_evens(x));
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), bf16_odds(x), acc);
      for (int64_t g = 16; g < kD; g += 16) {
        const __m256i y = load_pairs(k + g);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g), bf16_evens(y), acc);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g + 8), bf16_odds(y), acc);
      }
      return acc;
    } else {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), widen8(k));
      for (int64_t v = 1; v < VD; ++v)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), widen8(k + 8 * v), acc);
      return acc;
    }
  }

  // scores[r * kSplit + i] = scale * q_r . k_i, q as float32 rows in qbuf (store_q); keys
  // padded to a multiple of 8 by repeats (see DecodeAvx512::scores).
  static void scores(const float* qbuf, const int64_t* kv_of, int64_t nrows,
                     const scalar_t* const* krow, const scalar_t* const* vrow, int64_t n,
                     int64_t row_bytes, float scale, float* scores, AheadStream& ahead,
                     int64_t pump) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 part[8];
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      if (i0 % 16 == 0) ahead.pump(pump);
      for (int64_t i = i0 + 8; i < std::min(n, i0 + 16); ++i) prefetch_lines(krow[i], row_bytes);
      for (int64_t i = i0; i < std::min(n, i0 + 8); ++i) prefetch_lines(vrow[i], row_bytes);
      for (int64_t r = 0; r < nrows; ++r) {
        const float* q = qbuf + r * kD;
        for (int u = 0; u < 8; ++u) part[u] = dot(q, krow[i0 + u] + kv_of[r]);
        _mm256_storeu_ps(scores + r * kSplit + i0, _mm256_mul_ps(lane_sums8(part), sc));
      }
    }
  }

  // out[r] = sum_i w[r][i] v_i for RT (<= kRows) query rows reading the KV head at offset
  // kv, over the keys i < n: a chunk of kChunk vectors of the row at a time.
  template <int RT>
  static void values(const void* const* w, const scalar_t* const* vrow, int64_t n, int64_t kv,
                     float* const* out, AheadStream& ahead, int64_t pump) {
    for (int64_t c0 = 0; c0 < VD; c0 += kChunk) {
      __m256 acc[RT][kChunk];
      for (int r = 0; r < RT; ++r)
        for (int v = 0; v < kChunk; ++v) acc[r][v] = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        if (i % 16 == 0) ahead.pump(pump);
        const scalar_t* row = vrow[i] + kv + 8 * c0;
        __m256 x[kChunk];
        if constexpr (kSplitPairs) {  // x: evens and odds of 16 elements, then of the next 16
          for (int v = 0; v < kChunk; v += 2) {
            const __m256i pairs = load_pairs(row + 8 * v);
            x[v] = bf16_evens(pairs);
            x[v + 1] = bf16_odds(pairs);
          }
        } else {
          for (int v = 0; v < kChunk; ++v) x[v] = widen8(row + 8 * v);
        }
        for (int r = 0; r < RT; ++r) {
          const __m256 p = _mm256_broadcast_ss(static_cast<const float*>(w[r]) + i);
          for (int v = 0; v < kChunk; ++v) acc[r][v] = _mm256_fmadd_ps(p, x[v], acc[r][v]);
        }
      }
      for (int r = 0; r < RT; ++r) {
        if constexpr (kSplitPairs) {
          for (int v = 0; v < kChunk; v += 2)
            store_interleaved(out[r] + 8 * (c0 + v), acc[r][v], acc[r][v + 1]);
        } else {
          for (int v = 0; v < kChunk; ++v) _mm256_storeu_ps(out[r] + 8 * (c0 + v), acc[r][v]);
        }
      }
    }
  }
};
#endif

// A float buffer whose data starts on a 64-byte line. The softmax's sum is a vectorized
// reduction: were the compiler to peel iterations up to an aligned address, its order
// (and last bit) would depend on where a thread's buffer happened to land, and a
// sequence's output would not be the same bit for bit on every thread. A thread keeps
// its buffers from call to call (fit grows them): fresh ones each layer's call, 150 KB
// of scores a thread, cost page faults and zeroing in every decode step.
class AlignedFloats {
 public:
  void fit(int64_t n) {
    if (static_cast<int64_t>(storage_.size()) < n + 16) storage_.resize(n + 16);
    const auto at = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - at % 64) % 64) / sizeof(float);
  }
  float* data() { return data_; }
  float& operator[](int64_t i) { return data_[i]; }

 private:
  std::vector<float> storage_;
  float* data_ = nullptr;
};

// The largest of x[0, n) (n > 0): exact in any order, so vectorized (the plain loop was
// a chain of scalar maxima, most of a decode call on a short context).
inline float row_max(const float* x, int64_t n) {
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  if (i < n)  // the tail's missing lanes keep m's own values
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, static_cast<__mmask16>((1u << (n - i)) - 1u), x + i));
  return _mm512_reduce_max_ps(m);
#else
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

// A work item: one split of context (kSplit tokens from a multiple of kSplit) read
// once for the query rows of one sequence, or of every sequence of a group whose page
// lists name the same pages for the whole split (a prefix they share through the
// prefix cache: the agents' system prompt). A split is where a sequence alone would
// split, and a row's scores and weighted sums do not depend on the other rows of its
// item, so a sequence's output is the same bit for bit whichever sequences it runs
// beside.
struct Item {
  int64_t first;  // its sequences: members[first, first + count)
  int64_t count;
  int64_t split;
};

// Query rows an item of a group may hold (a sequence alone always fits): 16 sequences
// of 9 heads, 4 of 32. The scores of one split for all of them stay in L2.
constexpr int64_t kGroupRows = 144;

// The work items of a call: the shared splits of each group of sequences, then every
// sequence's other splits. Sequences group when their first pages are the same page
// (the first of them leads); each shares with the leader the leading splits that its
// first query row sees whole and whose pages the two name alike, so a split's item holds
// the leader and every member sharing that far (a fork that shares less leaves the
// others' longer share intact). Two members that share more with each other than with
// the leader read their extra splits apart: a deeper tree of groups was not needed for
// agents on one system prompt.
inline void plan_items(const int64_t* n_q, const int64_t* page_start, const int64_t* kv_lens,
                       const int32_t* kv_indices, int64_t B, int64_t H, int64_t page_size,
                       int64_t QH, std::vector<int64_t>& members, std::vector<Item>& items) {
  std::vector<int64_t> shared(B, 0);  // leading splits of b its group's items compute
  auto whole_splits = [&](int64_t b) { return (kv_lens[b] - (n_q[b] - 1)) / kSplit; };
  auto first_page = [&](int64_t b) { return kv_indices[page_start[b]]; };
  std::vector<int64_t> order;
  for (int64_t b = 0; b < B; ++b)
    if (whole_splits(b) > 0) order.push_back(b);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return first_page(a) < first_page(b); });
  const int64_t max_rows = std::max(QH, kGroupRows);
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && first_page(order[j]) == first_page(order[i])) ++j;
    // order[i, j): one first page; order[i] leads
    const int64_t leader = order[i];
    const int32_t* lead_pages = kv_indices + page_start[leader];
    std::vector<std::pair<int64_t, int64_t>> group;  // (splits shared with the leader, b)
    for (size_t k = i + 1; k < j; ++k) {
      const int64_t b = order[k];
      const int32_t* pages = kv_indices + page_start[b];
      const int64_t most = std::min(whole_splits(b), whole_splits(leader));
      const int64_t limit = (most * kSplit + page_size - 1) / page_size;
      int64_t same = 0;
      while (same < limit && pages[same] == lead_pages[same]) ++same;
      const int64_t splits = std::min(most, same * page_size / kSplit);
      if (splits > 0) group.emplace_back(splits, b);
    }
    i = j;
    if (group.empty()) continue;
    std::stable_sort(group.begin(), group.end(), [](const auto& a, const auto& b) {
      return a.first > b.first;
    });
    // members: the leader, then the others, longest share first: split s's sequences
    // are a prefix of it
    const int64_t start = static_cast<int64_t>(members.size());
    members.push_back(leader);
    for (const auto& [splits, b] : group) {
      members.push_back(b);
      shared[b] = splits;
    }
    shared[leader] = group.front().first;
    for (int64_t s = 0; s < shared[leader]; ++s) {
      int64_t count = 1;  // the leader
      while (count <= static_cast<int64_t>(group.size()) && group[count - 1].first > s) ++count;
      // at most max_rows query rows an item (a sequence alone always fits)
      for (int64_t c0 = 0; c0 < count;) {
        int64_t c1 = c0, rows = 0;
        while (c1 < count && (c1 == c0 || rows + n_q[members[start + c1]] * H <= max_rows))
          rows += n_q[members[start + c1++]] * H;
        items.push_back({start + c0, c1 - c0, s});
        c0 = c1;
      }
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = static_cast<int64_t>(members.size());
    members.push_back(b);
    for (int64_t s = shared[b]; s * kSplit < kv_lens[b]; ++s) items.push_back({first, 1, s});
  }
}

// kD > 0: the head dim fixed at compile time (64 and 128 are the common ones), so the
// per-head loops unroll; 0: any head dim, read from D.
template <typename scalar_t, int64_t kD>
void decode(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,
            const scalar_t* k_cache, const scalar_t* v_cache, Fp8Pages k8, Fp8Pages v8,
            const int64_t* rows,
            const int64_t* n_q, const int64_t* page_start, const int64_t* kv_lens,
            const int32_t* kv_indices, scalar_t* out, int64_t B, int64_t H, int64_t Hkv,
            int64_t head_dim, int64_t page_size, float scale) {
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t G = H / Hkv;
  int64_t max_len = 0, max_q = 1;
  for (int64_t b = 0; b < B; ++b) {
    max_len = std::max(max_len, kv_lens[b]);
    max_q = std::max(max_q, n_q[b]);
  }
  const int64_t S = (max_len + kSplit - 1) / kSplit;
  const int64_t QH = max_q * H;  // a sequence's (query row, head) pairs: qh = j * H + h
  const int64_t slot_stride = Hkv * D;  // one token's K (or V) of every KV head: contiguous
  const int64_t max_rows = std::max(QH, kGroupRows);

  std::vector<int64_t> members;
  std::vector<Item> items;
  plan_items(n_q, page_start, kv_lens, kv_indices, B, H, page_size, QH, members, items);

  // Per (sequence, split, query row and head): running max, sum of exp, and the weighted
  // V. A work item takes every query and head of its sequences over a run of tokens, so
  // it reads whole token rows once and the pages stream through memory in order.
  // (The calling thread keeps them from call to call; the workers reach them through
  // these pointers, not by name, which would be each worker's own thread_local.)
  thread_local std::vector<float> kept_max, kept_sum, kept_acc;
  const int64_t parts = B * S * QH;
  kept_max.assign(parts, -std::numeric_limits<float>::infinity());
  kept_sum.assign(parts, 0.f);
  if (static_cast<int64_t>(kept_acc.size()) < parts * D) kept_acc.resize(parts * D);
  float* const part_max = kept_max.data();
  float* const part_sum = kept_sum.data();
  float* const part_acc = kept_acc.data();  // the value pass stores whole rows

#ifdef __AVX512F__
  constexpr bool kAvx = kD == 64 || kD == 128;
  using Avx = DecodeAvx512<scalar_t, kAvx ? kD : 64>;  // unused for other head dims
#else
  constexpr bool kAvx = false;
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  constexpr bool kAvx2 = kD == 64 || kD == 128;
  using Avx2 = DecodeAvx2<scalar_t, kAvx2 ? kD : 64>;  // unused for other head dims
#else
  constexpr bool kAvx2 = false;
#endif
  // the scalar loop adds into part_acc; the vector passes store whole rows
  if constexpr (!kAvx && !kAvx2) std::fill(part_acc, part_acc + parts * D, 0.f);
  // Merge the splits of sequence b (each query row and head): run by whichever thread
  // finishes the sequence's last split, so a call is one parallel region, not two (on a
  // short context the second region's wake-up cost more than the attention).
  auto merge = [&](int64_t b, std::vector<float>& o) {
    for (int64_t qh = 0; qh < n_q[b] * H; ++qh) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) m = std::max(m, part_max[(b * S + s) * QH + qh]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at = (b * S + s) * QH + qh;
        if (part_sum[at] == 0.f) continue;  // a split past what this row sees
        const float w = std::exp(part_max[at] - m);
        total += part_sum[at] * w;
        const float* acc = part_acc + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
      const int64_t j = qh / H, h = qh % H;
      scalar_t* dst = out + ((rows[b] + j) * H + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[d] / total);
    }
  };
  // bf16 KV with bf16 dot products: the value pass takes the weights as bf16 pairs
#ifdef __AVX512F__
  constexpr bool pairs_of_weights = kAvx && Avx::kPairs;
#else
  constexpr bool pairs_of_weights = false;
#endif
  std::vector<std::atomic<int64_t>> splits_left(B);
  for (int64_t b = 0; b < B; ++b)
    splits_left[b].store((kv_lens[b] + kSplit - 1) / kSplit, std::memory_order_relaxed);

  // Items are taken from a counter: a group's item carries several sequences' rows, so
  // equal shares of the item list are not equal shares of the work.
  std::atomic<int64_t> next_item{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local AlignedFloats qf, scores, row;
    qf.fit(max_rows * D);
    scores.fit(max_rows * kSplit);
    row.fit(slot_stride);
    std::vector<float> o(D);
    std::vector<const scalar_t*> krow(kSplit), vrow(kSplit + 1);
    std::vector<const void*> ahead_rows(2 * kSplit);  // the next item's K rows, then its V rows
    AheadStream ahead;
    std::vector<const void*> wrow(max_rows);
    std::vector<float*> orow(max_rows);
    // a row of the item: its part index (b, split, qh), its KV head's offset in a token
    // row, the keys of the split it sees, where its query is
    std::vector<int64_t> part_at(max_rows), kv_of(max_rows), seen_of(max_rows);
    std::vector<const scalar_t*> q_of(max_rows);
    thread_local std::vector<scalar_t> k_rows, v_rows;  // FP8: a split's rows read back
    if (k8 && static_cast<int64_t>(k_rows.size()) < kSplit * slot_stride) {
      k_rows.resize(kSplit * slot_stride);
      v_rows.resize(kSplit * slot_stride);
    }
    const int64_t row_bytes = slot_stride * static_cast<int64_t>(sizeof(scalar_t));  // a token's K
    // the next item's rows into ahead_rows (K, then V), the stream started over them
    auto start_ahead = [&](const Item* next) {
      if (next == nullptr || k8) {
        ahead.start(ahead_rows.data(), 0, row_bytes);
        return;
      }
      const int64_t lead = members[next->first];
      const int64_t t0 = next->split * kSplit, t1 = std::min(kv_lens[lead], t0 + kSplit);
      const int32_t* pages = kv_indices + page_start[lead];
      for_each_row(k_cache, pages, t0, t1, page_size, slot_stride,
                   [&](int64_t i, const scalar_t* r) { ahead_rows[i] = r; });
      for_each_row(v_cache, pages, t0, t1, page_size, slot_stride,
                   [&](int64_t i, const scalar_t* r) { ahead_rows[(t1 - t0) + i] = r; });
      ahead.start(ahead_rows.data(), 2 * (t1 - t0), row_bytes);
    };
    auto run = [&](const Item& item, bool streamed, const Item* next) {
      const int64_t s = item.split, lead = members[item.first];
      const int64_t t0 = s * kSplit, t1 = std::min(kv_lens[lead], t0 + kSplit);
      const int64_t n = t1 - t0;
      const int32_t* pages = kv_indices + page_start[lead];  // the group's alike here
      int64_t nrows = 0;
      for (int64_t k = 0; k < item.count; ++k) {
        const int64_t b = members[item.first + k];
        for (int64_t j = 0; j < n_q[b]; ++j) {
          // row j sees the keys before kv_lens[b] - (n_q[b] - 1 - j): of this split, `seen`
          const int64_t seen = std::min(n, std::max<int64_t>(0, kv_lens[b] - (n_q[b] - 1 - j) - t0));
          for (int64_t h = 0; h < H; ++h, ++nrows) {
            part_at[nrows] = (b * S + s) * QH + j * H + h;
            kv_of[nrows] = (h / G) * D;
            seen_of[nrows] = seen;
            q_of[nrows] = q + (rows[b] + j) * q_row_stride + h * q_head_stride;
          }
        }
      }
      // the split's K and V rows: in the pages, or (FP8) read back into this thread's rows
      if (k8) {
        for_each_slot(pages, t0, t1, page_size, [&](int64_t, int64_t slot) {
          prefetch_lines<kToL2>(k8.data + slot * slot_stride, slot_stride);
          prefetch_lines<kToL2>(v8.data + slot * slot_stride, slot_stride);
        });
        for_each_slot(pages, t0, t1, page_size, [&](int64_t i, int64_t slot) {
          scalar_t* k = k_rows.data() + i * slot_stride;
          scalar_t* v = v_rows.data() + i * slot_stride;
          dequantize_row(k8, slot, Hkv, D, k);
          dequantize_row(v8, slot, Hkv, D, v);
          krow[i] = k;
          vrow[i] = v;
        });
      } else {
        for_each_row(k_cache, pages, t0, t1, page_size, slot_stride,
                     [&](int64_t i, const scalar_t* r) { krow[i] = r; });
        for_each_row(v_cache, pages, t0, t1, page_size, slot_stride,
                     [&](int64_t i, const scalar_t* r) { vrow[i] = r; });
      }
      // The whole split's K and V rows towards L2 at once (~200 KB for SmolLM2). Its
      // pages are scattered 6 KB runs, which the hardware prefetcher restarts at every
      // 4 KB page, and the next 16 rows fetched into L1 as the scores go keep few misses
      // in flight: asked for all at once, the rows arrive in parallel (a SmolLM2 step's
      // decode attention, 30 layers, 4 x 2,600: 13.8 -> 9.5 ms on its own pages, 8.4 ->
      // 5.8 on a shared 2,000; the KV read at 21 -> 30 GB/s). FP8 rows were fetched so
      // above, and their widened rows are in cache already. An item whose rows the item
      // before it streamed in (AheadStream) skips this.
      for (int64_t i = 0; i < n && !k8 && !streamed; ++i) {
        prefetch_lines<kToL2>(krow[i], row_bytes);
        prefetch_lines<kToL2>(vrow[i], row_bytes);
      }
      // the next item's rows stream in: half its lines during the scores (this many every
      // 16 keys), half during the values
      start_ahead(next);
      const int64_t blocks = (n + 15) / 16;
      const int64_t score_pump = (ahead.lines / 2 + blocks - 1) / blocks;
      if constexpr (kAvx) {
#ifdef __AVX512F__
        // the last row repeated up to a multiple of 16 keys (their scores land past n,
        // where no row looks)
        for (int64_t i = n; i % 16 != 0; ++i) krow[i] = krow[n - 1];
        using q_t = typename Avx::q_t;
        q_t* qbuf = reinterpret_cast<q_t*>(qf.data());  // bf16 pairs use half of it
        for (int64_t r = 0; r < nrows; ++r) {
          if constexpr (std::is_same_v<q_t, scalar_t>)
            std::memcpy(qbuf + r * D, q_of[r], D * sizeof(scalar_t));
          else
            std::memcpy(qbuf + r * D, as_float(q_of[r], row.data(), D), D * sizeof(float));
        }
        Avx::scores(qbuf, kv_of.data(), nrows, krow.data(), vrow.data(), n, row_bytes, scale,
                    scores.data(), ahead, score_pump);
#endif
      } else if constexpr (kAvx2) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        for (int64_t i = n; i % 8 != 0; ++i) krow[i] = krow[n - 1];  // as the AVX-512 path
        for (int64_t r = 0; r < nrows; ++r)
          Avx2::store_q(qf.data() + r * D, as_float(q_of[r], row.data(), D));
        Avx2::scores(qf.data(), kv_of.data(), nrows, krow.data(), vrow.data(), n, row_bytes,
                     scale, scores.data(), ahead, score_pump);
#endif
      } else {
        for (int64_t r = 0; r < nrows; ++r)
          for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(q_of[r][d]) * scale;
        for (int64_t i = 0; i < n; ++i) {
          if (i % 16 == 0) ahead.pump(score_pump);
          const float* kt = as_float(krow[i], row.data(), slot_stride);
          for (int64_t r = 0; r < nrows; ++r) {  // query head h reads KV head h / G
            const float* qv = qf.data() + r * D;
            const float* kp = kt + kv_of[r];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qv[d] * kp[d];
            scores[r * kSplit + i] = dot;
          }
        }
      }
      // the bf16 value pass takes the weights as pairs, 32 at a time
      const int64_t padded = pairs_of_weights ? (n + 31) / 32 * 32 : n;
      for (int64_t r = 0; r < nrows; ++r) {
        const int64_t seen = seen_of[r];
        float* sh = scores.data() + r * kSplit;
        for (int64_t i = seen; i < padded; ++i) sh[i] = 0.f;  // a later key: weight 0
        if (seen == 0) continue;  // nothing this row sees: part_sum stays 0, skipped
        const float m = row_max(sh, seen);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < seen; ++i) {
          sh[i] = exp_nonpositive(sh[i] - m);
          sum += sh[i];
        }
        part_max[part_at[r]] = m;
        part_sum[part_at[r]] = sum;
      }
      if constexpr (pairs_of_weights) {
#ifdef __AVX512F__
        for (int64_t r = 0; r < nrows; ++r) Avx::weights_to_pairs(scores.data() + r * kSplit, n);
        if (n % 2 == 1) vrow[n] = vrow[n - 1];  // the pair's second key: weight 0
#endif
      }
      // Each KV head's query rows in tiles of up to `tile` rows that share each V row:
      // fn(first, rows, kv, pump) for rows wrow / orow[first, first + rows) reading the KV
      // head at offset kv, with the stream's share for every 16 keys of each of the
      // tile's `passes` over its keys.
      auto value_tiles = [&](int64_t tile, int64_t passes, auto&& fn) {
        const int64_t tiles = Hkv * ((nrows / Hkv + tile - 1) / tile);
        const int64_t chunks = tiles * passes * ((n + 15) / 16);
        const int64_t pump = (ahead.lines - ahead.at + chunks - 1) / std::max<int64_t>(chunks, 1);
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          int64_t m = 0;
          for (int64_t r = 0; r < nrows; ++r)
            if (kv_of[r] == hk * D) {
              wrow[m] = scores.data() + r * kSplit;
              orow[m++] = part_acc + part_at[r] * D;
            }
          for (int64_t r = 0; r < m; r += tile) fn(r, std::min(tile, m - r), hk * D, pump);
        }
      };
      if constexpr (kAvx) {
#ifdef __AVX512F__
        value_tiles(Avx::kTile, 1, [&](int64_t r, int64_t rows, int64_t kv, int64_t pump) {
          if (rows == Avx::kTile)
            Avx::template values<Avx::kTile>(wrow.data() + r, vrow.data(), n, kv, orow.data() + r,
                                             ahead, pump);
          else
            Avx::template values_tail<Avx::kTile - 1>(rows, wrow.data() + r, vrow.data(), n, kv,
                                                      orow.data() + r, ahead, pump);
        });
#endif
      } else if constexpr (kAvx2) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        value_tiles(Avx2::kRows, Avx2::VD / Avx2::kChunk,
                    [&](int64_t r, int64_t rows, int64_t kv, int64_t pump) {
                      static_assert(Avx2::kRows == 2, "a tile's tail is one row");
                      if (rows == Avx2::kRows)
                        Avx2::template values<Avx2::kRows>(wrow.data() + r, vrow.data(), n, kv,
                                                           orow.data() + r, ahead, pump);
                      else
                        Avx2::template values<1>(wrow.data() + r, vrow.data(), n, kv,
                                                 orow.data() + r, ahead, pump);
                    });
#endif
      } else {
        const int64_t pump = (ahead.lines - ahead.at + n - 1) / n * 16;
        for (int64_t i = 0; i < n; ++i) {
          if (i % 16 == 0) ahead.pump(pump);
          const float* vt = as_float(vrow[i], row.data(), slot_stride);
          for (int64_t r = 0; r < nrows; ++r) {
            const float p = scores[r * kSplit + i];
            const float* vp = vt + kv_of[r];
            float* ah = part_acc + part_at[r] * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] += p * vp[d];
          }
        }
      }
    };
    // A thread claims its next item before it runs this one, and streams that item's
    // rows in while this one computes; with few items a claim ahead could leave the
    // other threads idle, so then each takes one at a time.
    const bool claim_ahead = !k8 && num_items >= 4 * workers;
    auto claim = [&] { return next_item.fetch_add(1, std::memory_order_relaxed); };
    bool streamed = false;
    for (int64_t i = claim(); i < num_items;) {
      const int64_t j = claim_ahead ? claim() : num_items;
      const Item& item = items[i];
      run(item, streamed, j < num_items ? &items[j] : nullptr);
      ahead.finish();
      streamed = j < num_items;
      i = claim_ahead ? j : claim();
      // acq_rel: the last one here sees every other split's partial results
      for (int64_t k = 0; k < item.count; ++k) {
        const int64_t b = members[item.first + k];
        if (splits_left[b].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(b, o);
      }
    }
  });
}

}  // namespace

std::vector<std::pair<int64_t, std::vector<int64_t>>> paged_decode_items(
    torch::Tensor n_q, torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
    int64_t num_heads, int64_t page_size) {
  TORCH_CHECK(n_q.scalar_type() == at::kLong && page_start.scalar_type() == at::kLong &&
                  kv_lens.scalar_type() == at::kLong && kv_indices.scalar_type() == at::kInt,
              "n_q, page_start, kv_lens: int64; kv_indices: int32");
  const int64_t B = n_q.numel();
  const int64_t* nq = n_q.data_ptr<int64_t>();
  int64_t max_q = 1;
  for (int64_t b = 0; b < B; ++b) max_q = std::max(max_q, nq[b]);
  std::vector<int64_t> members;
  std::vector<Item> items;
  plan_items(nq, page_start.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
             kv_indices.data_ptr<int32_t>(), B, num_heads, page_size, max_q * num_heads, members,
             items);
  std::vector<std::pair<int64_t, std::vector<int64_t>>> result;
  for (const Item& item : items)
    result.emplace_back(item.split, std::vector<int64_t>(members.begin() + item.first,
                                                         members.begin() + item.first + item.count));
  return result;
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor rows, torch::Tensor n_q,
                  torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
                  double scale, std::optional<torch::Tensor> k_scale,
                  std::optional<torch::Tensor> v_scale) {
  const std::pair<Fp8Pages, Fp8Pages> fp8 = check_paged_inputs(
      out, q, k_cache, v_cache, rows, n_q, page_start, kv_lens, kv_indices, k_scale, v_scale);
  const Fp8Pages k8 = fp8.first, v8 = fp8.second;
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  const int64_t B = rows.numel();
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    auto kernel = D == 64 ? decode<scalar_t, 64> : D == 128 ? decode<scalar_t, 128>
                                                            : decode<scalar_t, 0>;
    const scalar_t* k_pages = k8 ? nullptr : k_cache.data_ptr<scalar_t>();
    const scalar_t* v_pages = v8 ? nullptr : v_cache.data_ptr<scalar_t>();
    kernel(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_pages, v_pages, k8, v8,
           rows.data_ptr<int64_t>(), n_q.data_ptr<int64_t>(), page_start.data_ptr<int64_t>(),
           kv_lens.data_ptr<int64_t>(), kv_indices.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
           B, H, Hkv, D, k_cache.size(1), static_cast<float>(scale));
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(0.f); break;
    case at::kBFloat16: run(c10::BFloat16(0.f)); break;
    case at::kHalf: run(c10::Half(0.f)); break;
    default: TORCH_CHECK(false, "paged_decode takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
}
