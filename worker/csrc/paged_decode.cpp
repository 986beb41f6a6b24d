// Paged decode attention on CPU: a few query tokens per sequence (one for a decode; up
// to 16 for a speculative verify), read straight from the KV pages (no gather into a
// padded copy), split along the context so that every thread has work even for one
// sequence (flash-decoding), then merged. A sequence's query rows share each read of a
// K or V row: a verify of 1 + K tokens reads the context once, not 1 + K times.
//
// With AVX-512 and head dim 64 or 128 a split runs as vector passes (DecodeAvx512): the
// scores of 16 keys at a time per query row, bf16 dot products in VDPBF16PS where the
// CPU has it; the weighted V rows summed into register tiles of the query rows that
// share a KV head. Elsewhere a scalar loop the compiler vectorizes per dot product.
//
// Layouts (the torch backend's): q [T, H, D] (any row and head stride, D contiguous),
// k_cache / v_cache [num_pages, page_size, Hkv, D] contiguous, out [T, H, D]
// contiguous. Decode sequence b has its n_q[b] queries at rows rows[b] ..
// rows[b] + n_q[b] - 1, its pages at kv_indices[page_start[b] : page_start[b] +
// ceil(kv_lens[b] / page_size)]; its last query sees kv_lens[b] keys, each one before
// it one key fewer (causal). Query head h reads KV head h / G (G = H / Hkv), as HF's
// repeat_kv does.

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

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Context tokens per work item: small enough that one sequence gives both cores
// work, large enough that the merge is noise.
constexpr int64_t kSplit = 256;

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
  // multiple of 16 by repeats). (Fetching the next rows ahead by hand, at several
  // distances, into L1 or L2, moved the read rate from memory by under 5%: not done.)
  static void scores(const q_t* qbuf, const int64_t* kv_of, int64_t nrows,
                     const scalar_t* const* krow, int64_t n, float scale, float* scores) {
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 part[16];
    for (int64_t i0 = 0; i0 < n; i0 += 16)
      for (int64_t r = 0; r < nrows; ++r) {
        const q_t* q = qbuf + r * kD;
        for (int u = 0; u < 16; ++u) part[u] = dot(q, krow[i0 + u] + kv_of[r]);
        _mm512_storeu_ps(scores + r * kSplit + i0, _mm512_mul_ps(lane_sums16(part), sc));
      }
  }

  // out[r] = sum_i w[r][i] v_i for RT query rows reading the KV head at offset `kv` of a
  // token row, over the keys i < n: V rows widened once for the whole tile.
  template <int RT>
  static void values(const float* const* w, const scalar_t* const* vrow, int64_t n, int64_t kv,
                     float* const* out) {
    __m512 acc[RT][VD];
    for (int r = 0; r < RT; ++r)
      for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* row = vrow[i] + kv;
      __m512 x[VD];
      for (int64_t v = 0; v < VD; ++v) x[v] = widen16(row + 16 * v);
      for (int r = 0; r < RT; ++r) {
        const __m512 p = _mm512_set1_ps(w[r][i]);
        for (int64_t v = 0; v < VD; ++v) acc[r][v] = _mm512_fmadd_ps(p, x[v], acc[r][v]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int64_t v = 0; v < VD; ++v) _mm512_storeu_ps(out[r] + 16 * v, acc[r][v]);
  }

  // values<RT> for the last `rows` (< kTile) rows of a head.
  template <int RT>
  static void values_tail(int64_t rows, const float* const* w, const scalar_t* const* vrow, int64_t n,
                          int64_t kv, float* const* out) {
    if constexpr (RT > 1) {
      if (rows < RT) return values_tail<RT - 1>(rows, w, vrow, n, kv, out);
    }
    values<RT>(w, vrow, n, kv, out);
  }
};
#endif

// kD > 0: the head dim fixed at compile time (64 and 128 are the common ones), so the
// per-head loops unroll; 0: any head dim, read from D.
template <typename scalar_t, int64_t kD>
void decode(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,
            const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* rows,
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
  // where the KV head that (query row, head) qh reads sits in a token row: a table, so no
  // division per token and pair (a verify's 5 x 9 pairs paid an integer modulo each)
  std::vector<int64_t> kv_offset(QH);
  for (int64_t qh = 0; qh < QH; ++qh) kv_offset[qh] = ((qh % H) / G) * D;

  // Per (sequence, split, query row and head): running max, sum of exp, and the weighted
  // V. A work item takes every query and head of a run of tokens, so it reads whole token
  // rows once and the pages stream through memory in order.
  std::vector<float> part_max(B * S * QH, -std::numeric_limits<float>::infinity());
  std::vector<float> part_sum(B * S * QH, 0.f);
  std::vector<float> part_acc(B * S * QH * D, 0.f);

#ifdef __AVX512F__
  constexpr bool kAvx = kD == 64 || kD == 128;
  using Avx = DecodeAvx512<scalar_t, kAvx ? kD : 64>;  // unused for other head dims
#else
  constexpr bool kAvx = false;
#endif
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
        const float* acc = part_acc.data() + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
      const int64_t j = qh / H, h = qh % H;
      scalar_t* dst = out + ((rows[b] + j) * H + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[d] / total);
    }
  };
  std::vector<std::atomic<int64_t>> splits_left(B);
  for (auto& left : splits_left) left.store(S, std::memory_order_relaxed);

  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(QH * D), scores(QH * kSplit), row(slot_stride), o(D);
    std::vector<const scalar_t*> krow(kSplit), vrow(kSplit);
    std::vector<const float*> wrow(QH);
    std::vector<float*> orow(QH);
    // one split of one sequence: its part_max, part_sum and part_acc
    auto split = [&](int64_t b, int64_t s) {
      const int64_t t0 = s * kSplit, t1 = std::min(kv_lens[b], t0 + kSplit);
      if (t0 >= t1) return;
      const int64_t n = t1 - t0, nq = n_q[b], nqh = nq * H;
      const int32_t* pages = kv_indices + page_start[b];
      const int64_t base = (b * S + s) * QH;  // then + qh
      float* acc = part_acc.data() + base * D;
      if constexpr (kAvx) {
#ifdef __AVX512F__
        // the split's K and V rows, the last repeated up to a multiple of 16 keys (their
        // scores land past n, where no row looks)
        for_each_row(k_cache, pages, t0, t1, page_size, slot_stride,
                     [&](int64_t i, const scalar_t* r) { krow[i] = r; });
        for_each_row(v_cache, pages, t0, t1, page_size, slot_stride,
                     [&](int64_t i, const scalar_t* r) { vrow[i] = r; });
        for (int64_t i = n; i % 16 != 0; ++i) krow[i] = krow[n - 1];
        using q_t = typename Avx::q_t;
        q_t* qbuf = reinterpret_cast<q_t*>(qf.data());  // bf16 pairs use half of it
        for (int64_t qh = 0; qh < nqh; ++qh) {
          const scalar_t* src = q + (rows[b] + qh / H) * q_row_stride + (qh % H) * q_head_stride;
          if constexpr (std::is_same_v<q_t, scalar_t>)
            std::memcpy(qbuf + qh * D, src, D * sizeof(scalar_t));
          else
            std::memcpy(qbuf + qh * D, as_float(src, row.data(), D), D * sizeof(float));
        }
        Avx::scores(qbuf, kv_offset.data(), nqh, krow.data(), n, scale, scores.data());
#endif
      } else {
        for (int64_t j = 0; j < nq; ++j)
          for (int64_t h = 0; h < H; ++h) {
            const scalar_t* qh = q + (rows[b] + j) * q_row_stride + h * q_head_stride;
            for (int64_t d = 0; d < D; ++d) qf[(j * H + h) * D + d] = static_cast<float>(qh[d]) * scale;
          }
        for_each_row(k_cache, pages, t0, t1, page_size, slot_stride, [&](int64_t i, const scalar_t* r) {
          const float* kt = as_float(r, row.data(), slot_stride);
          for (int64_t qh = 0; qh < nqh; ++qh) {  // query head h reads KV head h / G
            const float* qv = qf.data() + qh * D;
            const float* kp = kt + kv_offset[qh];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qv[d] * kp[d];
            scores[qh * kSplit + i] = dot;
          }
        });
      }
      for (int64_t qh = 0; qh < nqh; ++qh) {
        // row j sees the keys before kv_lens[b] - (nq - 1 - j): of this split, `seen`
        const int64_t j = qh / H;
        const int64_t seen = std::min(n, std::max<int64_t>(0, kv_lens[b] - (nq - 1 - j) - t0));
        float* sh = scores.data() + qh * kSplit;
        for (int64_t i = seen; i < n; ++i) sh[i] = 0.f;  // a later key: weight 0
        if (seen == 0) continue;  // nothing this row sees: part_sum stays 0, skipped
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < seen; ++i) m = std::max(m, sh[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < seen; ++i) {
          sh[i] = exp_nonpositive(sh[i] - m);
          sum += sh[i];
        }
        part_max[base + qh] = m;
        part_sum[base + qh] = sum;
      }
      if constexpr (kAvx) {
#ifdef __AVX512F__
        // a KV head's query rows (j * H + hk * G + g) in tiles that share each V row
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          int64_t m = 0;
          for (int64_t j = 0; j < nq; ++j)
            for (int64_t g = 0; g < G; ++g, ++m) {
              const int64_t qh = j * H + hk * G + g;
              wrow[m] = scores.data() + qh * kSplit;
              orow[m] = acc + qh * D;
            }
          int64_t r = 0;
          for (; r + Avx::kTile <= m; r += Avx::kTile)
            Avx::template values<Avx::kTile>(wrow.data() + r, vrow.data(), n, hk * D, orow.data() + r);
          if (r < m)
            Avx::template values_tail<Avx::kTile - 1>(m - r, wrow.data() + r, vrow.data(), n,
                                                      hk * D, orow.data() + r);
        }
#endif
      } else {
        for_each_row(v_cache, pages, t0, t1, page_size, slot_stride, [&](int64_t i, const scalar_t* r) {
          const float* vt = as_float(r, row.data(), slot_stride);
          for (int64_t qh = 0; qh < nqh; ++qh) {
            const float p = scores[qh * kSplit + i];
            const float* vp = vt + kv_offset[qh];
            float* ah = acc + qh * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] += p * vp[d];
          }
        });
      }
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / S;
      split(b, item % S);
      // acq_rel: the last one here sees every other split's partial results
      if (splits_left[b].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(b, o);
    }
  });
}

}  // namespace

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor rows, torch::Tensor n_q,
                  torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
                  double scale) {
  check_paged_inputs(out, q, k_cache, v_cache, rows, n_q, page_start, kv_lens, kv_indices);
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  const int64_t B = rows.numel();
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    auto kernel = D == 64 ? decode<scalar_t, 64> : D == 128 ? decode<scalar_t, 128>
                                                            : decode<scalar_t, 0>;
    kernel(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(),
           v_cache.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(), n_q.data_ptr<int64_t>(),
           page_start.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
           kv_indices.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), B, H, Hkv, D,
           k_cache.size(1), static_cast<float>(scale));
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(0.f); break;
    case at::kBFloat16: run(c10::BFloat16(0.f)); break;
    case at::kHalf: run(c10::Half(0.f)); break;
    default: TORCH_CHECK(false, "paged_decode takes float32, bfloat16 or float16, not ", q.scalar_type());
  }
}
