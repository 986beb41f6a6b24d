"""N DeepInfer replicas on one machine behind SMG (SGLang's model gateway, `smg` on PyPI),
the cache-aware router: `make serve-replicas N=2`, the end-to-end test and the routing
benchmark start them the same way.

    python -m tools.replicas --replicas 2 --model models/tiny-llama --port 8200
    # replica i: http://127.0.0.1:(--base-port + i), its KV events on
    #   tcp://127.0.0.1:(--kv-events-base-port + 2 i) (+1: replay); SMG on --port

Each replica lists every --served-model-name; SMG takes one model per worker (the
first /v1/models lists), so the other names become SMG aliases (`--model-alias
NAME=FIRST`): Claude Code's `claude-sonnet-4-5` then reaches a replica instead of
SMG's 404 "No worker available for model". Everything binds loopback.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from orchestrator.config import REPO, TINY_MODEL, repo_env
from orchestrator.launcher import free_port
from tools.harness.served import wait_healthy

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "prefix_hash")


def smg_binary() -> str | None:
    """The `smg` next to this interpreter (the venv's), else one on PATH."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.is_file() else shutil.which("smg")


class Replicas:
    """N `deepinfer-run serve` processes and SMG in front; `url` is SMG's."""

    def __init__(self, num_replicas: int, model: Path = TINY_MODEL, *,
                 served_names: tuple[str, ...] = ("tiny-llama",), policy: str = "cache_aware",
                 port: int | None = None, base_port: int | None = None,
                 kv_events_base_port: int | None = None, extra_args: list[str] | None = None,
                 smg_args: list[str] | None = None, log_dir: Path | None = None,
                 startup_timeout_s: float = 300) -> None:
        smg = smg_binary()
        if smg is None:
            raise RuntimeError("smg is not installed (pip install smg, or `make install`)")
        assert policy in POLICIES, policy
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="deepinfer-replicas-"))
        self.procs: list[subprocess.Popen] = []
        self._logs = []
        self.replica_urls: list[str] = []
        self.kv_event_endpoints: list[str] = []
        try:
            for i in range(num_replicas):
                rport = base_port + i if base_port else free_port()
                args = ["--port", str(rport), "--served-model-name", *served_names]
                if kv_events_base_port:
                    events, replay = kv_events_base_port + 2 * i, kv_events_base_port + 2 * i + 1
                    args += ["--kv-events-endpoint", str(events),
                             "--kv-events-replay-endpoint", str(replay)]
                    self.kv_event_endpoints.append(f"tcp://127.0.0.1:{events}")
                # the launcher's own port is picked here too: picked in each child, it
                # could land on a port this process picked and a replica has not bound yet
                self._start(f"replica-{i}", [
                    sys.executable, "-m", "orchestrator.launcher", "--nproc-per-node", "1",
                    "--master-port", str(free_port(span=3)),
                    "--run-dir", str(self.log_dir / f"run-{i}"),
                    "serve", "--model", str(model), *args, *(extra_args or [])])
                self.replica_urls.append(f"http://127.0.0.1:{rport}")
            for url, proc in zip(self.replica_urls, self.procs, strict=True):
                wait_healthy(url, timeout_s=startup_timeout_s, proc=proc)
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            aliases = [a for name in served_names[1:]
                       for a in ("--model-alias", f"{name}={served_names[0]}")]
            self._start("smg", [
                smg, "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.replica_urls, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                *aliases, *(smg_args or [])])
            self._wait_router(served_names[0], startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115
        self._logs.append(log)
        self.procs.append(subprocess.Popen(argv, cwd=REPO, env=repo_env(), stdout=log,
                                           stderr=subprocess.STDOUT))

    def _wait_router(self, model: str, timeout_s: float) -> None:
        """Until SMG lists the model and has every worker ready: it lists the model as soon
        as one worker is, and would route everything there until the others are."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs[-1].poll() is not None:
                raise RuntimeError(f"smg exited ({self.procs[-1].returncode}); see "
                                   f"{self.log_dir / 'smg.log'}")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2).json()
                workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                ready = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
                if (any(m.get("id") == model for m in models.get("data", []))
                        and len(ready) == len(self.replica_urls)):
                    return
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"smg at {self.url} did not list {model!r} in {timeout_s:g}s")

    def stop(self) -> None:
        """SIGINT to each (the launchers stop their children), SIGKILL after 30 s."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", type=Path, default=TINY_MODEL)
    p.add_argument("--port", type=int, default=8200, help="SMG's port")
    p.add_argument("--base-port", type=int, default=8100, help="replica i: this + i")
    p.add_argument("--kv-events-base-port", type=int, default=5557,
                   help="replica i publishes KV events on this + 2i, replays on + 2i + 1 "
                        "(0: none)")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="default: the model's name, then claude-sonnet-4-5 and "
                        "claude-haiku-4-5 for Claude Code")
    args, extra = p.parse_known_args(argv)
    names = tuple(args.served_model_name or (
        args.model.name.removesuffix(".gguf"), "claude-sonnet-4-5", "claude-haiku-4-5"))
    with Replicas(args.replicas, args.model, served_names=names, policy=args.policy,
                  port=args.port, base_port=args.base_port,
                  kv_events_base_port=args.kv_events_base_port or None,
                  extra_args=extra, log_dir=Path(tempfile.mkdtemp(prefix="deepinfer-"))) as r:
        print(f"SMG ({args.policy}) at {r.url} in front of {' '.join(r.replica_urls)}")
        for ep in r.kv_event_endpoints:
            print(f"KV events: {ep}")
        print(f"logs: {r.log_dir}   (Ctrl-C stops everything)")
        try:
            while all(proc.poll() is None for proc in r.procs):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
