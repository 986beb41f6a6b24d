// The compiled CPU kernels, bound into one Python module by module.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>

// Paged decode attention (paged_decode.cpp). FP8 pages come with their scales
// (k_scale, v_scale: fp8.h), else the pages are q's dtype.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor rows, torch::Tensor n_q,
                  torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
                  double scale, std::optional<torch::Tensor> k_scale,
                  std::optional<torch::Tensor> v_scale);

// paged_decode's work items for these sequences: (split, the sequences reading it
// together), for tests and benchmarks.
std::vector<std::pair<int64_t, std::vector<int64_t>>> paged_decode_items(
    torch::Tensor n_q, torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
    int64_t num_heads, int64_t page_size);

// Paged prefill attention, flash-style over the pages in place (paged_prefill.cpp); the
// same inputs as paged_decode, any number of queries per sequence, head_dim 32, 64 or 128.
void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                   torch::Tensor v_cache, torch::Tensor rows, torch::Tensor n_q,
                   torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
                   double scale, std::optional<torch::Tensor> k_scale,
                   std::optional<torch::Tensor> v_scale);

// x [M, K] @ w[N, K]^T for a few rows of x, reading w once (small_linear.cpp).
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w);

// Fused elementwise passes of a decoder layer (elementwise.cpp).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// residual += delta in place, then rms_norm(residual)
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                           double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
// Rotary of q and k out of fused qkv rows, k and v stored at their slots of one layer's
// pages (FP8 pages: quantized, their scales stored beside them); returns q [rows,
// num_heads, head_dim].
torch::Tensor rope_store_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                            int64_t num_heads, std::optional<torch::Tensor> k_scale,
                            std::optional<torch::Tensor> v_scale);
