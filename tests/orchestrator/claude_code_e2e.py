"""`make e2e-claude-code`: the real Claude Code CLI against the engine.

    python -m tests.orchestrator.claude_code_e2e [--prompt TEXT] [--keep-log]

1. installs the `@anthropic-ai/claude-code` npm package into .venv/claude-code/ (once);
2. makes a long-context variant of the tiny model (Claude Code's first request is about
   26K tokens with the tiny tokenizer, more than the default model's 8K context);
3. starts `deepinfer-run serve` (4 ranks) with a small --max-output-tokens (random
   weights: the text is noise, and CPU decoding is slow);
4. runs `claude -p PROMPT` with ANTHROPIC_BASE_URL pointing at it, ANTHROPIC_API_KEY=dummy,
   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 and a scratch HOME.

It passes when the CLI exits 0, prints the model's (random) text, and the engine's log
shows the /v1/messages request served. Not part of `make test` (it needs npm and
several minutes of CPU prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.e2e_helpers import wait_healthy

PACKAGE = "@anthropic-ai/claude-code"
INSTALL_DIR = REPO / ".venv" / "claude-code"
MODEL = REPO / "models" / "tiny-llama-64k"
CONTEXT = 65536
MAX_OUTPUT_TOKENS = 32
CLI_TIMEOUT_S = 1500


def install_cli() -> list[str]:
    """The command that runs the CLI (installing the package if needed)."""
    wrapper = INSTALL_DIR / "node_modules" / PACKAGE / "cli-wrapper.cjs"
    if not wrapper.exists():
        INSTALL_DIR.mkdir(parents=True, exist_ok=True)
        print(f"installing {PACKAGE} into {INSTALL_DIR}", flush=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix",
                        str(INSTALL_DIR), PACKAGE], check=True)
    # npm >= 11 may skip the postinstall that puts the native binary in place of
    # bin/claude.exe; the package's wrapper finds the binary either way.
    return ["node", str(wrapper)]


def make_model() -> Path:
    from tools.tiny_models.make import make_tiny_model

    default = make_tiny_model(REPO / "models" / "tiny-llama", quiet=True)
    return make_tiny_model(MODEL, tokenizer_from=default, max_position_embeddings=CONTEXT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="Say hello in one short sentence.")
    args = p.parse_args(argv)

    cli = install_cli()
    version = subprocess.run([*cli, "--version"], capture_output=True, text=True, timeout=120)
    print(f"claude --version: {version.stdout.strip() or version.stderr.strip()}", flush=True)
    model = make_model()

    scratch = Path(tempfile.mkdtemp(prefix="deepinfer-claude-code-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = scratch / "engine.log"
    with open(log_path, "w") as log:
        engine = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", "4",
             "--run-dir", str(scratch / "run"), "serve", "--model", str(model),
             "--port", str(port), "--dtype", "float32",
             "--max-output-tokens", str(MAX_OUTPUT_TOKENS)],
            cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, timeout_s=300)
            home = scratch / "home"
            home.mkdir()
            env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
            env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="dummy", HOME=str(home),
                       CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
            print(f"engine at {url}; running claude -p {args.prompt!r} (CPU prefill of "
                  "Claude Code's ~26K-token prompt takes minutes)", flush=True)
            t0 = time.monotonic()
            cli_run = subprocess.run([*cli, "-p", args.prompt], env=env, cwd=home,
                                     capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
            elapsed = time.monotonic() - t0
        finally:
            engine.send_signal(signal.SIGINT)
            engine.wait(timeout=60)
    served = [json.loads(line) for line in log_path.read_text().splitlines()
              if '"request_done"' in line and '"api": "anthropic"' in line]
    print(f"claude exit status {cli_run.returncode} after {elapsed:.0f}s")
    print(f"stdout: {cli_run.stdout!r}")
    if cli_run.stderr.strip():
        print(f"stderr: {cli_run.stderr.strip()[-2000:]}")
    for r in served:
        print("served:", {k: r.get(k) for k in ("request_id", "prompt_tokens", "cached_tokens",
                                                "output_tokens", "finish_reason",
                                                "duration_s")})
    ok = cli_run.returncode == 0 and cli_run.stdout.strip() and any(
        r.get("finish_reason") in ("stop", "length") for r in served)
    print("PASS" if ok else f"FAIL (engine log: {log_path})")
    if ok:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
