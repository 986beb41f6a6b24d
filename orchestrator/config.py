"""Command line -> the one frozen EngineConfig (plus the shim's own serving options)."""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, dataclass, field, fields
from pathlib import Path

from orchestrator.shim.reasoning import REASONING_PARSERS
from orchestrator.shim.tool_parsers import TOOL_CALL_PARSERS
from wire.config import EngineConfig
from wire.security import (
    SECRET_FILE_ENV,
    InsecureFileError,
    read_private_file,
    read_secret,
)

REPO = Path(__file__).resolve().parent.parent


def repo_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for a child process, with this checkout first on PYTHONPATH: the
    children import this checkout's packages, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env
DEFAULT_MODEL = REPO / "models" / "tiny-llama"
# How the launcher hands the API key to the shim: never on a command line, which any
# local user can read with `ps`; a process's environment is readable by its owner only.
API_KEY_ENV = "DEEPINFER_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # Anthropic's own limit for /v1/messages
DEFAULT_MAX_TOOLS = 512
DEFAULT_MAX_MESSAGES = 100_000  # agent sessions run to thousands of turns
DEFAULT_MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class ShimOptions:
    """How the shim answers requests: the flags of `add_shim_arguments` beyond the
    address, the key and the self-check. One dataclass from the command line
    (`from_args`) to the shim's state, and back to a command line (`args`) when the
    launcher starts the shim. A field's flag is its name with dashes, unless it says."""

    max_output_tokens: int = 0  # cap on any request's output tokens; 0: none
    tool_call_parser: str = "hermes"
    reasoning_parser: str = "none"
    max_thinking_tokens: int = 0  # cap on any request's thinking span; 0: its own budget
    request_timeout_s: float = field(default=0.0, metadata={"flag": "--request-timeout"})
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        for f in fields(self):  # counts, sizes and seconds: 0 at least (0: no cap, none)
            value = getattr(self, f.name)
            if not isinstance(value, str) and value < 0:
                raise ValueError(f"{_flag(f)} must be >= 0, got {value}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown --reasoning-parser {self.reasoning_parser!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ShimOptions:
        try:
            return cls(**{f.name: getattr(args, _dest(f)) for f in fields(cls)})
        except ValueError as exc:  # a clear line, not a traceback, for a bad flag
            raise SystemExit(str(exc)) from None

    def args(self) -> list[str]:
        return [arg for f in fields(self) for arg in (_flag(f), str(getattr(self, f.name)))]


def _flag(f: Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _dest(f: Field) -> str:
    return _flag(f)[2:].replace("-", "_")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never logged
    served_model_name: str | None = None
    self_check_tokens: int = 0  # > 0: run the prefix-cache gate at start-up, this long
    shim: ShimOptions = field(default_factory=ShimOptions)

    def shim_args(self) -> list[str]:
        """These options as the shim's command line takes them (the key excepted: it
        travels in the shim's environment, see API_KEY_ENV)."""
        args = ["--host", self.host, "--port", str(self.port), *self.shim.args()]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if self.self_check_tokens:
            args += ["--self-check", "--self-check-tokens", str(self.self_check_tokens)]
        return args


def add_shim_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP serving options, shared by `deepinfer-run serve` and the shim's own
    command line (`ServeOptions.shim_args` hands them from one to the other)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require this key, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(visible in `ps`: prefer --api-key-file)")
    p.add_argument("--api-key-file", default=None,
                   help="require the key in this file (mode 0600, one line)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-output-tokens", type=int, default=ShimOptions.max_output_tokens,
                   help="cap on any request's output tokens, on top of its max_tokens "
                        "(0: only the context limits it)")
    p.add_argument("--tool-call-parser", default=ShimOptions.tool_call_parser,
                   choices=TOOL_CALL_PARSERS,
                   help="how the shim reads tool calls back from the model's output")
    p.add_argument("--reasoning-parser", default=ShimOptions.reasoning_parser,
                   choices=REASONING_PARSERS,
                   help="'think' (also 'qwen3', 'deepseek_r1'): the <think>...</think> span "
                        "the model writes goes to the client as reasoning (Anthropic thinking "
                        "blocks, OpenAI reasoning_content)")
    p.add_argument("--max-thinking-tokens", type=int, default=ShimOptions.max_thinking_tokens,
                   help="cap on any request's <think> span (with --reasoning-parser), on top "
                        "of its own budget (Anthropic thinking.budget_tokens, OpenAI "
                        "thinking_token_budget); 0: only the request's budget caps it")
    p.add_argument("--request-timeout", type=float, default=ShimOptions.request_timeout_s,
                   help="default deadline of every request, in seconds (0: none); a request "
                        "may set its own with the x-request-timeout header")
    p.add_argument("--self-check", action="store_true",
                   help="before accepting traffic, run the prefix-cache gate (deepinfer-verify) "
                        "against this engine; refuse to start if it fails (the shim exits 3)")
    p.add_argument("--self-check-tokens", type=int, default=1024,
                   help="the self-check's document length, in tokens")
    p.add_argument("--max-request-bytes", type=int, default=ShimOptions.max_request_bytes,
                   help="larger request bodies get a 413")
    p.add_argument("--max-tools", type=int, default=ShimOptions.max_tools,
                   help="requests with more tools get a 400")
    p.add_argument("--max-messages", type=int, default=ShimOptions.max_messages,
                   help="chat requests with more messages get a 400")
    p.add_argument("--max-header-bytes", type=int, default=ShimOptions.max_header_bytes,
                   help="requests whose headers are larger are refused by the HTTP server")


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key-file (a private file, like an ssh key) or --api-key."""
    if args.api_key_file is None:
        return args.api_key
    if args.api_key is not None:
        raise SystemExit("give --api-key or --api-key-file, not both")
    try:
        return read_private_file(args.api_key_file, "--api-key-file")
    except InsecureFileError as exc:
        raise SystemExit(str(exc)) from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig(model="")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="Hugging Face checkpoint dir (default: the generated tiny model)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    add_shim_arguments(p)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                   help="bytes per rank for the device KV tier")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: size the device tier to this share of GPU memory, measured by "
                        "a profiling pass (overrides --kv-cache-memory)")
    p.add_argument("--host-cache-memory", type=int, default=d.host_cache_memory,
                   help="bytes per rank for the host KV tier (0 disables it)")
    p.add_argument("--kv-write-policy", default=d.kv_write_policy,
                   choices=["write_back", "write_through"],
                   help="when device blocks are copied to the host tier: on eviction "
                        "(write_back) or as soon as they are registered (write_through)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="disable prefix caching (for comparisons)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting beyond this are refused: 529 overloaded_error "
                        "(Anthropic) / 429 (OpenAI), with retry-after")
    p.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                   help="the same bound on the waiting requests' prompt tokens (0: none)")
    p.add_argument("--full-cache-check-every", type=int, default=d.full_cache_check_every,
                   help="debugging: also run the full O(capacity) cache check every N steps "
                        "(0: never; the cheap accounting check runs every step regardless)")
    p.add_argument("--step-timeout", type=float, default=d.step_timeout_s,
                   help="seconds a step may take before a rank that has not answered is "
                        "declared hung and the engine stops")
    p.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "torch", "flashinfer"])
    p.add_argument("--torch-threads", type=int, default=d.torch_threads)
    p.add_argument("--seed", type=int, default=d.seed)


def build_config(args: argparse.Namespace, world_size: int) -> tuple[EngineConfig, ServeOptions]:
    model = Path(args.model).resolve()
    if not (model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (run `make install` "
                         "for the default model)")
    config = EngineConfig(
        model=str(model),
        dtype=args.dtype,
        device=args.device,
        world_size=world_size,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        host_cache_memory=args.host_cache_memory,
        kv_write_policy=args.kv_write_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        step_timeout_s=args.step_timeout,
        full_cache_check_every=args.full_cache_check_every,
        attention_backend=args.attention_backend,
        torch_threads=args.torch_threads,
        seed=args.seed,
    )
    serve = ServeOptions(
        host=args.host, port=args.port, api_key=api_key_from(args),
        served_model_name=args.served_model_name,
        self_check_tokens=args.self_check_tokens if args.self_check else 0,
        shim=ShimOptions.from_args(args))
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
