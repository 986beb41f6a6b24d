// The compiled CPU kernels, bound into one Python module by module.cpp.
#pragma once

#include <torch/extension.h>

// Paged decode attention (paged_decode.cpp).
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor rows, torch::Tensor n_q,
                  torch::Tensor page_start, torch::Tensor kv_lens, torch::Tensor kv_indices,
                  double scale);

// x [M, K] @ w[N, K]^T for a few rows of x, reading w once (small_linear.cpp).
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w);
