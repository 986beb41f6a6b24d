// Paged decode attention on CPU: one query token per sequence, read straight from
// the KV pages (no gather into a padded copy), split along the context so that every
// thread has work even for one sequence (flash-decoding), then merged.
//
// Layouts (the torch backend's): q [T, H, D] (any row and head stride, D contiguous),
// k_cache / v_cache [num_pages, page_size, Hkv, D] contiguous, out [T, H, D]
// contiguous. Decode sequence b has its query at row rows[b], its pages at
// kv_indices[page_start[b] : page_start[b] + ceil(kv_lens[b] / page_size)].
// Query head h reads KV head h / G (G = H / Hkv), as HF's repeat_kv does.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Context tokens per work item: small enough that one sequence gives both cores
// work, large enough that the merge is noise.
constexpr int64_t kSplit = 256;

template <typename scalar_t>
void decode(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,
            const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* rows,
            const int64_t* page_start, const int64_t* kv_lens, const int32_t* kv_indices,
            scalar_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
            float scale) {
  const int64_t G = H / Hkv;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, kv_lens[b]);
  const int64_t S = (max_len + kSplit - 1) / kSplit;
  const int64_t slot_stride = Hkv * D;  // one token's K (or V) of every KV head: contiguous
  const int64_t page_stride = page_size * slot_stride;

  // Per (sequence, split, query head): running max, sum of exp, and the weighted V.
  // A work item takes every head of a run of tokens, so it reads whole token rows
  // and the pages stream through memory in order.
  std::vector<float> part_max(B * S * H, -std::numeric_limits<float>::infinity());
  std::vector<float> part_sum(B * S * H, 0.f);
  std::vector<float> part_acc(B * S * H * D, 0.f);

  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), scores(H * kSplit);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / S, s = item % S;
      const int64_t t0 = s * kSplit, t1 = std::min(kv_lens[b], t0 + kSplit);
      if (t0 >= t1) continue;
      const int64_t n = t1 - t0;
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* qh = q + rows[b] * q_row_stride + h * q_head_stride;
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(qh[d]) * scale;
      }
      const int32_t* pages = kv_indices + page_start[b];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        const scalar_t* kt = k_cache + pages[t / page_size] * page_stride + (t % page_size) * slot_stride;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qf.data() + h * D;
          const scalar_t* kp = kt + (h / G) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * static_cast<float>(kp[d]);
          scores[h * kSplit + i] = dot;
        }
      }
      const int64_t base = (b * S + s) * H;  // then + h
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * kSplit;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sh[i] = std::exp(sh[i] - m);
          sum += sh[i];
        }
        part_max[base + h] = m;
        part_sum[base + h] = sum;
      }
      float* acc = part_acc.data() + base * D;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        const scalar_t* vt = v_cache + pages[t / page_size] * page_stride + (t % page_size) * slot_stride;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * kSplit + i];
          const scalar_t* vp = vt + (h / G) * D;
          float* ah = acc + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * static_cast<float>(vp[d]);
        }
      }
    }
  });

  // Merge the splits of each (sequence, query head).
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) m = std::max(m, part_max[(b * S + s) * H + h]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at = (b * S + s) * H + h;
        if (part_sum[at] == 0.f) continue;  // a split past this sequence's end
        const float w = std::exp(part_max[at] - m);
        total += part_sum[at] * w;
        const float* acc = part_acc.data() + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
      scalar_t* dst = out + (rows[b] * H + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[d] / total);
    }
  });
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor rows, torch::Tensor page_start,
                  torch::Tensor kv_lens, torch::Tensor kv_indices, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with D contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV pages must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v: [N, page, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, KV and out must share a dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && page_start.scalar_type() == at::kLong &&
                  kv_lens.scalar_type() == at::kLong && kv_indices.scalar_type() == at::kInt,
              "rows, page_start, kv_lens: int64; kv_indices: int32");
  TORCH_CHECK(rows.is_contiguous() && page_start.is_contiguous() && kv_lens.is_contiguous() &&
                  kv_indices.is_contiguous(), "index tensors must be contiguous");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head_dim or head counts do not match");
  const int64_t B = rows.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
                     k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     rows.data_ptr<int64_t>(), page_start.data_ptr<int64_t>(),
                     kv_lens.data_ptr<int64_t>(), kv_indices.data_ptr<int32_t>(),
                     out.data_ptr<scalar_t>(), B, H, Hkv, D, k_cache.size(1),
                     static_cast<float>(scale));
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "paged decode attention, one query per sequence, read in place from the KV pages");
}
