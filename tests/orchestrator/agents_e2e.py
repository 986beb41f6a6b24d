"""`make e2e-agents`: real coding agents, unmodified, against the engine.

    python -m tests.orchestrator.agents_e2e [--agent NAME ...] [--turns N]

For each agent (Claude Code, Codex CLI, opencode):

1. installs its npm package into .venv/agents/NAME/ (again when npm names a newer
   version), with a Node.js from npm where the newest version asks for a newer one;
2. holds ONE session of `--turns` turns (three by default) against the engine, each turn
   a separate CLI run that continues the session (`claude -p --continue`, `codex exec
   resume --last`, `opencode run --continue`), with a scratch HOME holding the agent's
   config, and every connection but the engine's sent to a dead proxy;
3. reads the engine's own log (the shim's `request_done` lines) and prints, per request,
   the turn, prompt tokens, cached tokens and the cached share, and any `prefix_break`.

The engine (`deepinfer-run serve`, one rank, a small --max-output-tokens: the model is
random, its text is noise) serves a long-context variant of the tiny model, since the
agents' first requests are 20-40K tokens with the tiny tokenizer.

It fails when a turn's CLI exits non-zero, or when a request after an agent's first one is
less than 95% cached, unless it opens a conversation of its own (a prompt that extends
no earlier prompt of that agent: opencode's title request has its own system prompt).
Not part of `make test`: it needs npm, network for the install, and minutes of CPU prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.e2e_helpers import wait_healthy

AGENTS_DIR = REPO / ".venv" / "agents"
MODEL = REPO / "models" / "tiny-llama-64k"
MODEL_NAME = MODEL.name
CONTEXT = 65536
MAX_OUTPUT_TOKENS = 16
CLI_TIMEOUT_S = 1500
MIN_CACHED_SHARE = 0.95
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there
PROMPTS = [
    "Say hello in one short sentence.",
    "Now say it in French.",
    "Say it once more, shorter.",
    "Thank you, that is all.",
]


@dataclass
class Agent:
    name: str
    package: str  # npm spec
    bin: str  # the command, under node_modules/.bin
    api: str  # the shim's `api` field on its request_done lines
    configure: Callable[[Path, str], dict[str, str]]  # (home, engine url) -> env additions
    command: Callable[[int, str], list[str]]  # (turn from 1, prompt) -> argv after the bin
    version: str = ""
    path: str = field(default_factory=lambda: os.environ.get("PATH", ""))  # node first
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Turn:
    number: int
    returncode: int
    seconds: float
    stdout: str
    stderr: str
    requests: list[dict] = field(default_factory=list)  # the shim's request_done lines
    breaks: list[dict] = field(default_factory=list)  # prefix_break lines


# --- the agents ----------------------------------------------------------------------------

def claude_env(home: Path, url: str) -> dict[str, str]:
    # ANTHROPIC_MODEL names the served model, as one points Claude Code at a local model.
    # Left to its default ("opus[1m]") the first run's system prompt names "Opus 4.8 (1M
    # context)", but the transcript keeps "claude-opus-4-8" without the [1m]: every
    # `--continue` / `--resume` renders the system prompt without " (1M context)" and
    # misses the cache from token ~1.5K once (measured: 5.7% of turn 2 cached).
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy",
            "ANTHROPIC_MODEL": MODEL_NAME,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


def claude_command(turn: int, prompt: str) -> list[str]:
    return ["-p", prompt] if turn == 1 else ["-p", "--continue", prompt]


def codex_env(home: Path, url: str) -> dict[str, str]:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        f'model = "{MODEL_NAME}"\n'
        'model_provider = "local"\n'
        "\n[model_providers.local]\n"
        'name = "deepinfer"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "DEEPINFER_API_KEY"\n'
        "\n[features]\n"
        "plugins = false\n"
        "\n[analytics]\n"  # else each run exports metrics to ab.chatgpt.com
        "enabled = false\n")
    return {"DEEPINFER_API_KEY": "dummy", "CODEX_HOME": str(config.parent)}


def codex_command(turn: int, prompt: str) -> list[str]:
    # The scratch folder is no git repository. `exec` never stops for an approval, and a
    # read-only sandbox keeps whatever the random model might run from changing anything.
    flags = ["--skip-git-repo-check", "--sandbox", "read-only", "--color", "never"]
    return ["exec", *flags, prompt] if turn == 1 else ["exec", "resume", "--last",
                                                        "--skip-git-repo-check", prompt]


def opencode_env(home: Path, url: str) -> dict[str, str]:
    config = home / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    model = {"name": MODEL_NAME, "tool_call": True,
             "limit": {"context": CONTEXT, "output": MAX_OUTPUT_TOKENS}}
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"deepinfer": {
            "npm": "@ai-sdk/openai-compatible", "name": "DeepInfer",
            "options": {"baseURL": f"{url}/v1", "apiKey": "dummy"},
            "models": {MODEL_NAME: model}}},
        "model": f"deepinfer/{MODEL_NAME}",
        "small_model": f"deepinfer/{MODEL_NAME}",
        "autoupdate": False, "share": "disabled"}, indent=2))
    off = ("MODELS_FETCH", "AUTOUPDATE", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "SHARE",
           "CLAUDE_CODE", "EXTERNAL_SKILLS")
    # At start opencode installs @opencode-ai/plugin from npm into its config folder (in the
    # background; a failure is a warning): npm's own offline switch keeps it off the registry.
    return {"npm_config_offline": "true", **{f"OPENCODE_DISABLE_{name}": "1" for name in off}}


def opencode_command(turn: int, prompt: str) -> list[str]:
    flags = ["--pure", "--model", f"deepinfer/{MODEL_NAME}"]
    return ["run", *flags, prompt] if turn == 1 else ["run", *flags, "--continue", prompt]


AGENTS = {
    "claude-code": lambda: Agent("claude-code", "@anthropic-ai/claude-code", "claude",
                                 "anthropic", claude_env, claude_command),
    "codex": lambda: Agent("codex", "@openai/codex@0.171", "codex", "responses",
                           codex_env, codex_command),
    "opencode": lambda: Agent("opencode", "opencode-ai@1.18", "opencode", "chat",
                              opencode_env, opencode_command),
}


# --- running them --------------------------------------------------------------------------

def npm_view(spec: str, field: str) -> str | list[str]:
    """`npm view SPEC FIELD`: one value, or a list where SPEC is a range naming several
    versions (in npm's order, not by version); '' where npm cannot tell."""
    try:
        done = subprocess.run(["npm", "view", spec, field, "--json"], capture_output=True,
                              text=True, timeout=120)
        value = json.loads(done.stdout or '""') if done.returncode == 0 else ""
    except (subprocess.TimeoutExpired, json.JSONDecodeError):
        return ""
    return value if isinstance(value, str | list) else ""


def package_name(spec: str) -> str:
    """The package an npm spec names, less its version: @openai/codex@0.171 -> @openai/codex."""
    return spec.rsplit("@", 1)[0] if "@" in spec[1:] else spec


def newest_release(spec: str) -> tuple[str, str]:
    """The newest version an npm spec names and the Node range that version asks for
    (`engines.node`); ('', '') where npm cannot tell."""
    versions = npm_view(spec, "version")
    newest = max(versions, key=version_tuple) if isinstance(versions, list) else versions
    if not newest:
        return "", ""
    engines = npm_view(f"{package_name(spec)}@{newest}", "engines.node")
    return newest, engines if isinstance(engines, str) else ""


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text)[:3])


def node_major_needed(engines: str, have: tuple[int, ...]) -> int | None:
    """The Node major to fetch where no alternative of an npm `engines.node` range admits
    the node we have, e.g. ">=22.0.0" with node 20 -> 22; None where it does (or names
    no lower bound). Upper bounds are not read: the newest release of the major is taken."""
    bounds = [version_tuple(alt) for alt in engines.split("||") if version_tuple(alt)]
    if not bounds or any(have >= bound for bound in bounds):
        return None
    return min(bound[0] for bound in bounds)


def node_path(agent: Agent, engines: str) -> str:
    """The PATH to install and run the agent with. Where the newest version of its package
    asks for a newer Node than this machine's (Claude Code since 2.1.198: >= 22), npm would
    quietly install the last version this node runs (2.1.197), which is not what users
    get: a Node of the major asked for comes from npm's `node-linux-<arch>` package, once,
    into .venv/agents/node-MAJOR/, and goes first on the PATH."""
    path = os.environ.get("PATH", "")
    have = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout
    major = node_major_needed(engines, version_tuple(have))
    if major is None:
        return path
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    prefix = AGENTS_DIR / f"node-{major}"
    bin_dir = prefix / "node_modules" / f"node-linux-{arch}" / "bin"
    if not (bin_dir / "node").exists():
        prefix.mkdir(parents=True, exist_ok=True)
        print(f"{agent.package} asks for Node {major} (this machine's: {have.strip()}): "
              f"installing node-linux-{arch}@{major} into {prefix}", flush=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        f"node-linux-{arch}@{major}"], check=True)
    return f"{bin_dir}{os.pathsep}{path}"


def installed_version(prefix: Path, package: str) -> str:
    manifest = prefix / "node_modules" / package_name(package) / "package.json"
    return json.loads(manifest.read_text()).get("version", "") if manifest.is_file() else ""


def install(agent: Agent, newest: str) -> list[str]:
    """The command that runs the agent's CLI, its package installed (again, where npm names
    a newer version of its spec than the one installed: the run tests what users get)."""
    prefix = AGENTS_DIR / agent.name
    cli = prefix / "node_modules" / ".bin" / agent.bin
    have = installed_version(prefix, agent.package)
    if not cli.exists() or (newest and newest != have):
        prefix.mkdir(parents=True, exist_ok=True)
        print(f"installing {agent.package} ({newest or 'newest'}; installed: {have or 'none'}) "
              f"into {prefix}", flush=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        agent.package], check=True, env={**os.environ, "PATH": agent.path})
    return [str(cli)]


def make_model() -> Path:
    from tools.tiny_models.make import make_tiny_model

    default = make_tiny_model(REPO / "models" / "tiny-llama", quiet=True)
    return make_tiny_model(MODEL, tokenizer_from=default, max_position_embeddings=CONTEXT)


def log_events(log_path: Path, start: int) -> tuple[list[dict], int]:
    """The JSON events the engine logged from byte `start` on, and the new end."""
    data = log_path.read_bytes()
    events = []
    for line in data[start:].decode(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events, len(data)


def run_session(agent: Agent, cli: list[str], url: str, scratch: Path, log_path: Path,
                turns: int) -> None:
    home = scratch / agent.name
    work = home / "work"
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "OPENCODE_"))}
    env.update(HOME=str(home), NO_COLOR="1", PATH=agent.path, **agent.configure(home, url))
    # Nothing but the engine: whatever else an agent reaches for goes through a proxy on a
    # closed port and fails at once, as it would offline (with the settings above, none of
    # the three reaches for anything: Codex would export metrics, opencode install a package).
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = DEAD_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    _, offset = log_events(log_path, 0)
    for number, prompt in enumerate(PROMPTS[:turns], 1):
        print(f"[{agent.name}] turn {number}: {agent.bin} "
              f"{' '.join(agent.command(number, prompt))!r}", flush=True)
        t0 = time.monotonic()
        try:
            done = subprocess.run([*cli, *agent.command(number, prompt)], env=env, cwd=work,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=CLI_TIMEOUT_S)
            rc, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = 124, str(e.stdout or ""), str(e.stderr or "")
        time.sleep(0.5)  # the shim logs request_done as the stream closes
        events, offset = log_events(log_path, offset)
        turn = Turn(number, rc, time.monotonic() - t0, out, err)
        turn.requests = [e for e in events if e.get("event") == "request_done"
                         and e.get("api") == agent.api]
        turn.breaks = [e for e in events if e.get("event") == "prefix_break"]
        agent.turns.append(turn)
        print(f"[{agent.name}] turn {number}: exit {rc} after {turn.seconds:.0f}s, "
              f"{len(turn.requests)} request(s); stdout {out.strip()[-300:]!r}", flush=True)
        if rc != 0:
            print(f"[{agent.name}] stderr: {err.strip()[-3000:]}", flush=True)
            return


def share(request: dict) -> float:
    return request.get("cached_tokens", 0) / max(1, request.get("prompt_tokens", 0))


NEW_CONVERSATION_TOKENS = 64  # a prompt leaving every earlier one this early is another


def opens_conversation(request: dict, breaks: list[dict]) -> bool:
    """The engine saw this prompt leave every earlier prompt of its session within the first
    few tokens: another system prompt, i.e. a conversation of its own (opencode's title
    request), which nothing could have cached."""
    return any(b.get("request_id") == request.get("request_id")
               and b.get("token_index", NEW_CONVERSATION_TOKENS) < NEW_CONVERSATION_TOKENS
               for b in breaks)


def report(agent: Agent) -> list[str]:
    """Print the agent's table; returns its failures."""
    failures = []
    print(f"\n{agent.name} {agent.version}: {len(agent.turns)} turn(s)")
    print(f"{'turn':>4} {'request':>7} {'prompt':>7} {'cached':>7} {'share':>7}  note")
    first = True
    for turn in agent.turns:
        if turn.returncode != 0:
            failures.append(f"{agent.name} turn {turn.number} exited {turn.returncode}")
        if not turn.requests:
            failures.append(f"{agent.name} turn {turn.number}: no request reached the engine")
        for n, r in enumerate(turn.requests, 1):
            s = share(r)
            held = not first and not opens_conversation(r, turn.breaks)
            note = "" if held else "first of its conversation"
            if held and s < MIN_CACHED_SHARE:
                note = f"below {MIN_CACHED_SHARE:.0%}"
                failures.append(f"{agent.name} turn {turn.number} request {n}: {s:.1%} cached "
                                f"({r.get('cached_tokens')} of {r.get('prompt_tokens')})")
            print(f"{turn.number:>4} {n:>7} {r.get('prompt_tokens', 0):>7} "
                  f"{r.get('cached_tokens', 0):>7} {s:>7.1%}  {note}")
            first = False
        for b in turn.breaks:
            if "token_index" in b:  # the shim's line (the scheduler logs one too)
                print(f"     prefix_break at token {b['token_index']}: "
                      f"...{b.get('before')!r} | was {b.get('previous_after')!r} "
                      f"| now {b.get('new_after')!r}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", action="append", choices=sorted(AGENTS),
                   help="run only this agent (repeatable; default: all)")
    p.add_argument("--turns", type=int, default=3, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--ranks", type=int, default=1)
    args = p.parse_args(argv)

    agents = [AGENTS[name]() for name in (args.agent or AGENTS)]
    failures: list[str] = []
    runnable = []
    for agent in agents:
        try:
            newest, engines = newest_release(agent.package)
            agent.path = node_path(agent, engines)
            cli = install(agent, newest)
        except subprocess.CalledProcessError as e:
            failures.append(f"{agent.name}: npm install {agent.package} failed ({e})")
            continue
        version = subprocess.run([*cli, "--version"], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, "HOME": tempfile.gettempdir(),
                                                   "PATH": agent.path})
        agent.version = (version.stdout.strip() or version.stderr.strip()).splitlines()[-1]
        node = subprocess.run(["node", "--version"], capture_output=True, text=True,
                              env={**os.environ, "PATH": agent.path}).stdout.strip()
        agent.version += f" on Node {node}"
        print(f"{agent.name}: {agent.version}", flush=True)
        runnable.append((agent, cli))
    model = make_model()

    scratch = Path(tempfile.mkdtemp(prefix="deepinfer-agents-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = scratch / "engine.log"
    with open(log_path, "w") as log:
        engine = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node",
             str(args.ranks), "--run-dir", str(scratch / "run"), "serve", "--model",
             str(model), "--port", str(port), "--dtype", "float32",
             "--max-output-tokens", str(MAX_OUTPUT_TOKENS)],
            cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, timeout_s=300)
            print(f"engine at {url} (log {log_path}); the first turn of each agent "
                  "prefills 20-40K tokens on the CPU", flush=True)
            for agent, cli in runnable:
                run_session(agent, cli, url, scratch, log_path, args.turns)
        finally:
            engine.send_signal(signal.SIGINT)
            engine.wait(timeout=60)
    for agent, _ in runnable:
        failures += report(agent)
    print()
    for failure in failures:
        print("FAIL:", failure)
    print("PASS" if not failures else f"FAIL (engine log and homes: {scratch})")
    if not failures:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
