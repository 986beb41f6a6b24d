// Paged decode attention on CPU: a few query tokens per sequence (one for a decode; up
// to 8 for a speculative verify), read straight from the KV pages (no gather into a
// padded copy), split along the context so that every thread has work even for one
// sequence (flash-decoding), then merged. A sequence's query rows share each read of a
// K or V row: a verify of 1 + K tokens reads the context once, not 1 + K times.
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Context tokens per work item: small enough that one sequence gives both cores
// work, large enough that the merge is noise.
constexpr int64_t kSplit = 256;

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

  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(QH * D), scores(QH * kSplit), row(slot_stride);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / S, s = item % S;
      const int64_t t0 = s * kSplit, t1 = std::min(kv_lens[b], t0 + kSplit);
      if (t0 >= t1) continue;
      const int64_t n = t1 - t0, nq = n_q[b], nqh = nq * H;
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* qh = q + (rows[b] + j) * q_row_stride + h * q_head_stride;
          for (int64_t d = 0; d < D; ++d) qf[(j * H + h) * D + d] = static_cast<float>(qh[d]) * scale;
        }
      const int32_t* pages = kv_indices + page_start[b];
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
      const int64_t base = (b * S + s) * QH;  // then + qh
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
      float* acc = part_acc.data() + base * D;
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
  });

  // Merge the splits of each (sequence, query row and head).
  at::parallel_for(0, B * QH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bq = begin; bq < end; ++bq) {
      const int64_t b = bq / QH, qh = bq % QH;
      if (qh >= n_q[b] * H) continue;  // past this sequence's queries
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
