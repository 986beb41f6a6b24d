"""FlashInfer paged attention (CUDA). Imported only when chosen: `import flashinfer`
has crashed on machines without CUDA."""

from __future__ import annotations

import torch

from worker.attention.base import AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        import flashinfer

        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        # The decode kernel's GQA group sizes are limited; tensor cores cover the rest.
        group = num_qo_heads // num_kv_heads
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=group not in (1, 2, 4, 8)
        )
        self._wrapper = self._prefill

    def plan(self, meta: AttentionMetadata) -> None:
        # Host tensors, as plan() wants them: it reads the indptrs on the host to split
        # the work and copies them to the GPU itself (device ones would be copied back,
        # a sync each). int32 throughout.
        kv_indptr = meta.kv_indptr.to(torch.int32)
        kv_indices = meta.kv_indices.to(torch.int32)
        last = meta.kv_last_page_len.to(torch.int32)
        if meta.is_decode:
            self._decode.plan(
                kv_indptr, kv_indices, last, self.num_qo_heads, self.num_kv_heads,
                self.head_dim, self.page_size, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
            self._wrapper = self._decode
        else:
            # plan() defaults to causal=False and float16: both passed explicitly.
            self._prefill.plan(
                meta.qo_indptr.to(torch.int32), kv_indptr, kv_indices, last,
                self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
            self._wrapper = self._prefill

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # FP8 KV is refused on CUDA at start-up (worker/budget.py resolve_kv_dtype)
        assert k_scale is None and v_scale is None, "FlashInfer here takes 16-bit KV only"
        # q may be a view of the joint q|k rotary output (worker/model.py): rows strided
        return self._wrapper.run(q.contiguous(), (k_cache, v_cache))
