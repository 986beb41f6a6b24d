"""The shim's own options: one frozen dataclass and the command-line flags that make it,
shared by `deepinfer-run serve` (which hands them on, orchestrator/config.py) and the
shim's command line (orchestrator/shim/server.py)."""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, field, fields
from pathlib import Path

from orchestrator.shim.reasoning import REASONING_PARSERS
from orchestrator.shim.tool_parsers import TOOL_CALL_PARSERS
from wire.security import InsecureFileError, read_private_file

API_KEY_ENV = "DEEPINFER_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # Anthropic's own limit for /v1/messages
DEFAULT_MAX_TOOLS = 512
DEFAULT_MAX_MESSAGES = 100_000  # agent sessions run to thousands of turns
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
ON_IMAGE = ("placeholder", "reject")  # what an image, document, audio or file part becomes
BILLING_HEADER = ("drop", "keep")  # Claude Code's per-session billing header


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
    on_image: str = "placeholder"
    billing_header: str = "drop"
    cache_salt_per_api_key: str = ""  # the tenants' keys file (tenants.py); "": none

    def __post_init__(self) -> None:
        for f in fields(self):  # counts, sizes and seconds: 0 at least (0: no cap, none)
            value = getattr(self, f.name)
            if not isinstance(value, str) and value < 0:
                raise ValueError(f"{_flag(f)} must be >= 0, got {value}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown --reasoning-parser {self.reasoning_parser!r}")
        if self.billing_header not in BILLING_HEADER:
            raise ValueError(f"--billing-header must be one of {', '.join(BILLING_HEADER)}, "
                             f"got {self.billing_header!r}")
        if self.on_image not in ON_IMAGE:
            raise ValueError(f"--on-image must be one of {', '.join(ON_IMAGE)}, got "
                             f"{self.on_image!r}")

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
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names /v1/models lists (the first is the one replies carry). "
                        "The engine answers any name, but a router sends a request only to "
                        "a replica that lists its model: e.g. `tiny-llama claude-sonnet-4-5` "
                        "for Claude Code behind SMG")
    p.add_argument("--max-output-tokens", type=int, default=ShimOptions.max_output_tokens,
                   help="cap on any request's output tokens, on top of its max_tokens "
                        "(0: only the context limits it)")
    p.add_argument("--tool-call-parser", default=ShimOptions.tool_call_parser,
                   choices=TOOL_CALL_PARSERS,
                   help="how the shim reads tool calls back from the model's output: "
                        "'hermes' (<tool_call>{JSON}</tool_call>: Hermes, Qwen 2.5 / 3), "
                        "'qwen3_coder' (<tool_call><function=NAME><parameter=P>...: "
                        "Qwen3-Coder), 'llama3_json' (Llama 3.1+), 'none'")
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
    p.add_argument("--on-image", default=ShimOptions.on_image, choices=ON_IMAGE,
                   help="an image, document, audio or file in a chat request: 'placeholder' "
                        "replaces it with a short stable text naming its type, media type, "
                        "size and digest (a session with a screenshot in its history keeps "
                        "working, and hitting the cache); 'reject' answers 400")
    p.add_argument("--billing-header", default=ShimOptions.billing_header,
                   choices=BILLING_HEADER,
                   help="Claude Code's first system block, 'x-anthropic-billing-header: ...', "
                        "differs in every session: 'drop' (the default) takes it out of the "
                        "prompt, so that new sessions share the system prompt's cache (each "
                        "drop logged, prompt_normalised, and counted); 'keep' renders it")
    p.add_argument("--cache-salt-per-api-key", metavar="KEYS_FILE", type=_absolute,
                   default=ShimOptions.cache_salt_per_api_key,
                   help="accept the keys of this file (mode 0600; one 'TENANT KEY' a line, # "
                        "comments) and salt each request's cache with its key's tenant, so "
                        "tenants never share cached blocks (nor learn from their latency "
                        "what another has sent); --api-key, if given, stays valid too")


def _absolute(path: str) -> str:
    """A path as the shim reads it: the launcher starts it in another directory."""
    return str(Path(path).resolve()) if path else ""


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
