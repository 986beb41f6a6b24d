"""The engine's one configuration, built from the command line and sent to every process."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram",)
# --kv-cache-dtype, vLLM's names: the model's dtype, or FP8 (E4M3 for `fp8`) with a scale
# per token and KV head (worker/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# In the run directory: the launcher writes the EngineConfig there and the scheduler reads
# it, a codec frame (wire/codec.py write_file / read_file) like every message between them.
CONFIG_FILE = "config.msgpack"
# A rank's disk-tier records in --disk-cache-dir (worker/disk_store.py writes them; the
# launcher counts them as the tier's own room when it sizes the tier).
DISK_RECORDS_FILE = "rank{rank}.kv"
# ... and a hybrid model's state snapshot records, within the same --disk-cache-size
DISK_STATE_RECORDS_FILE = "rank{rank}.state"


def is_disk_records_file(name: str) -> bool:
    for pattern in (DISK_RECORDS_FILE, DISK_STATE_RECORDS_FILE):
        prefix, _, suffix = pattern.partition("{rank}")
        middle = name.removeprefix(prefix).removesuffix(suffix)
        if name == prefix + middle + suffix and middle.isdigit():
            return True
    return False


# --state-snapshot-interval auto: the ranks choose the interval (worker/budget.py
# auto_snapshot_interval) and report it in EngineLimits.state_snapshot_interval.
SNAPSHOT_INTERVAL_AUTO = 0


def snapshot_interval_from(text: str) -> int:
    """`--state-snapshot-interval`: `auto` (SNAPSHOT_INTERVAL_AUTO) or a count of blocks
    >= 1; anything else is a ValueError that says what is accepted."""
    if text.strip().lower() == "auto":
        return SNAPSHOT_INTERVAL_AUTO
    try:
        blocks = int(text)
    except ValueError:
        blocks = 0
    if blocks < 1:
        raise ValueError(f"{text!r} is not a snapshot interval: give `auto` (sized from the "
                         "bytes of a state snapshot and of a KV block) or a whole number of "
                         "KV blocks >= 1")
    return blocks


# Why FP8 KV is refused on CUDA (here, and by a rank whose `auto` device is a GPU).
FP8_ON_CUDA = ("--kv-cache-dtype {} is served on CPU only: FlashInfer takes FP8 KV with one "
               "scale per tensor, not the scale per token and head this engine stores "
               "(docs/cache.md); use --kv-cache-dtype auto on CUDA")


class ConfigError(ValueError):
    """A setting the engine refuses, with the reason a user can act on (the launcher prints
    it in one line; any other exception while building the config is a bug and keeps its
    traceback)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` JSON names it. Only prompt
    lookup ("ngram"): the scheduler drafts up to `num_speculative_tokens` tokens from the
    longest earlier match (n from `prompt_lookup_max` down to `prompt_lookup_min`) of the
    sequence's last n tokens in its own prompt and output (scheduler/speculation.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method {self.method!r}: only "
                             f"{', '.join(SPECULATIVE_METHODS)} is supported")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ConfigError("num_speculative_tokens must be between 1 and 64")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.prompt_lookup_max > 64:
            raise ConfigError("prompt_lookup_max must be <= 64")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON object; a clear ValueError for anything else."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        if "method" not in raw:
            raise ConfigError('--speculative-config needs "method" (e.g. "ngram")')
        for name, value in raw.items():
            want = str if name == "method" else int
            if type(value) is not want:  # noqa: E721  (bool is not an int here)
                raise ConfigError(f"--speculative-config: {name} must be {want.__name__}")
        return cls(**raw)


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
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: auto stores KV in `dtype`
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
    # a finished agent turn's blocks stay retained this long (0: off), unless the client
    # marks its own (cache_control) or the turn ended without a tool call (TurnEnd)
    session_ttl_s: float = 90.0
    max_model_len: int = 0  # 0: take the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A step admits another waiting request's prefill only while the prefill tokens it
    # already runs are fewer than this (scheduler/admission.py admit_waiting); 0: up to
    # max_num_batched_tokens. The launcher sets 0 on GPUs (--prefill-pack-tokens).
    prefill_pack_tokens: int = 512
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
    # How plans reach the ranks and results come back once they are up: "zmq" (the socket),
    # "shm" (shared memory and FIFO wake-ups, for ranks on the scheduler's host:
    # wire/step_channel.py), or "auto": shm where it can serve, zmq elsewhere (the ranks
    # are sent the one chosen). Connecting, configuration and shutdown are ZeroMQ always.
    step_channel: str = "auto"
    # KV events for a cache-aware router (scheduler/kv_events.py): a ZeroMQ address (or a
    # bare port, on loopback) to publish on; "": off. The replay socket likewise.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    # the name in the events' topic, kv@<host>@<name>: the first served model name
    served_model_name: str = ""
    # Speculative decoding by prompt lookup (--speculative-config); None: off.
    speculative: SpeculativeConfig | None = None
    # A hybrid model (linear-attention layers): the linear layers' state is snapshotted
    # every this many blocks, and at the last block boundary each sequence reached, so a
    # prefix hit can go on from there (cache/state_pool.py); every tier's budget then
    # also holds one snapshot per this many blocks (worker/budget.py). SNAPSHOT_INTERVAL_AUTO
    # (0, the default): the ranks choose it from the bytes of a snapshot and of a KV block
    # (worker/budget.py auto_snapshot_interval) and report it (EngineLimits), and the
    # scheduler takes it from there.
    state_snapshot_interval: int = SNAPSHOT_INTERVAL_AUTO

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def __post_init__(self) -> None:
        # the codec encodes the nested config by its fields: a dict here (a JSON round
        # trip's) would fail only when the config is sent to the ranks
        if not isinstance(self.speculative, SpeculativeConfig | None):
            raise TypeError(f"speculative must be a SpeculativeConfig or None, not "
                            f"{type(self.speculative).__name__}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"unknown dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown KV cache dtype {self.kv_cache_dtype!r} (one of "
                              f"{', '.join(KV_CACHE_DTYPES)})")
        if self.kv_cache_dtype != "auto" and (self.device == "cuda"
                                              or self.attention_backend == "flashinfer"):
            raise ConfigError(FP8_ON_CUDA.format(self.kv_cache_dtype))
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ConfigError(f"unknown attention backend {self.attention_backend!r}")
        if self.step_channel not in ("auto", "zmq", "shm"):
            raise ConfigError(f"unknown step channel {self.step_channel!r}")
        if not 0.0 <= self.max_retained_fraction <= 1.0:
            raise ConfigError("max_retained_fraction must be between 0 and 1")
        if self.session_ttl_s < 0:
            raise ConfigError("session_ttl_s must be >= 0")
        if self.kv_write_policy not in ("write_back", "write_through"):
            raise ConfigError(f"unknown KV write policy {self.kv_write_policy!r}")
        if (self.disk_cache_size > 0) != bool(self.disk_cache_dir):
            raise ConfigError("--disk-cache-dir and --disk-cache-size go together")
        if self.disk_cache_size and not self.host_cache_memory:
            raise ConfigError("the disk tier is fed from the host tier: set --host-cache-memory")
        if self.disk_cache_size < 0 or self.disk_max_queued_writes < 1:
            raise ConfigError("disk_cache_size must be >= 0 and disk_max_queued_writes >= 1")
        if self.world_size < 1:
            raise ConfigError("world_size must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a power of two")
        if self.max_queued_requests < 1 or self.max_queued_tokens < 0:
            raise ConfigError("max_queued_requests must be >= 1 and max_queued_tokens >= 0")
        if self.step_timeout_s <= 0:
            raise ConfigError("step_timeout_s must be > 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.prefill_pack_tokens < 0:
            raise ConfigError("prefill_pack_tokens must be >= 0 (0: up to the step's budget)")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("a KV-event replay endpoint needs --kv-events-endpoint")
        if self.state_snapshot_interval < 0:
            raise ConfigError("state_snapshot_interval must be >= 1 (blocks), or "
                              f"{SNAPSHOT_INTERVAL_AUTO} for auto")
        if self.null_model_forward_ms is not None and not self.null_model_forward_ms >= 0:
            raise ConfigError("null_model_forward_ms must be >= 0")
