"""The engine's one configuration, built from the command line and sent to every process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """The one frozen configuration built from the command line.

    Handed to every process as plain data (msgpack), so it holds only
    primitives. Derived values are properties.
    """

    model: str  # a Hugging Face checkpoint directory, or a .gguf file
    # the directory holding tokenizer.json (and tokenizer_config.json); "": the model's.
    # For a GGUF the launcher writes one from the file's metadata (orchestrator/gguf_tokenizer.py)
    tokenizer: str = ""
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    world_size: int = 1
    block_size: int = 16
    kv_cache_memory: int = 0  # bytes per rank for the device tier; 0: sized from the model
    gpu_memory_utilization: float = 0.0  # CUDA only; > 0 sizes the device tier by profiling
    host_cache_memory: int = 0  # bytes per rank for the host tier; 0 disables it
    kv_write_policy: str = "write_back"  # host copy on device eviction, or "write_through"
    # The disk tier (worker/disk_store.py): a directory (created 0700) and bytes per rank;
    # "" / 0 disables it. Written through from the host tier, so the host tier must be on.
    disk_cache_dir: str = ""
    disk_cache_size: int = 0
    disk_max_queued_writes: int = 256  # per rank; past it a write is dropped, not waited on
    disk_write_bytes_per_s: float = 0.0  # per rank; 0: no limit
    enable_prefix_caching: bool = True
    max_retained_fraction: float = 0.5  # of each tier, for retention hints (cache_control)
    max_model_len: int = 0  # 0: take the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 256
    max_queued_tokens: int = 0  # prompt tokens waiting, all requests together; 0: no limit
    step_timeout_s: float = 300.0  # a rank that answers no step within this is hung
    full_cache_check_every: int = 0  # debug: the O(capacity) cache check every N steps
    attention_backend: str = "auto"  # auto | torch | flashinfer
    torch_threads: int = 0  # 0: cores / local ranks
    seed: int = 0
    # Benchmarks and tests: the ranks run a null model (worker/null_model.py) whose forward
    # waits this many milliseconds (0 included) and samples deterministic tokens, with no
    # weights; the scheduler, cache, protocol, digests and sockets stay real. None: off.
    null_model_forward_ms: float | None = None
    # Overlap scheduling: plan and send step k+1 while the ranks run step k; a decode names
    # the token sampled at step k as PENDING_TOKEN and the ranks resolve it (scheduler/
    # engine.py). False: every step waits for the one before (--no-async-scheduling).
    async_scheduling: bool = True

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if not 0.0 <= self.max_retained_fraction <= 1.0:
            raise ValueError("max_retained_fraction must be between 0 and 1")
        if self.kv_write_policy not in ("write_back", "write_through"):
            raise ValueError(f"unknown KV write policy {self.kv_write_policy!r}")
        if (self.disk_cache_size > 0) != bool(self.disk_cache_dir):
            raise ValueError("--disk-cache-dir and --disk-cache-size go together")
        if self.disk_cache_size and not self.host_cache_memory:
            raise ValueError("the disk tier is fed from the host tier: set --host-cache-memory")
        if self.disk_cache_size < 0 or self.disk_max_queued_writes < 1:
            raise ValueError("disk_cache_size must be >= 0 and disk_max_queued_writes >= 1")
        if self.world_size < 1:
            raise ValueError("world_size must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_queued_requests < 1 or self.max_queued_tokens < 0:
            raise ValueError("max_queued_requests must be >= 1 and max_queued_tokens >= 0")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.null_model_forward_ms is not None and not self.null_model_forward_ms >= 0:
            raise ValueError("null_model_forward_ms must be >= 0")
