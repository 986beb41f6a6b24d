"""`deepinfer-run`: start the scheduler, N worker ranks and the HTTP shim; supervise them.

    deepinfer-run [--nproc-per-node N] [--nnodes M --node-rank R --master-addr A
                  --master-port P] [--restart N] serve [--model DIR] [--host 127.0.0.1]
                  [--port 8000] ...

torchrun-style: each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, so a worker may as well be started by torchrun.
Supervision: if any child exits, every other child is stopped within a few
seconds and the launcher exits non-zero, naming the process and its status.
With --restart N (one node), the engine group (the scheduler and the ranks) is
restarted instead, up to N times, while the HTTP shim stays up and answers 503 +
retry-after to new requests; the requests in flight pause and go on from the restarted
group (--resume-timeout, orchestrator/shim/resume.py). The shim exiting still stops
everything.
Ctrl-C (or SIGTERM) stops everything and removes the run directory.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import (
    REPO,
    add_serve_arguments,
    build_config,
    model_name,
    repo_env,
    secret_file_env,
)
from orchestrator.gguf_tokenizer import write_tokenizer_dir
from orchestrator.shim.options import API_KEY_ENV
from orchestrator.shim.resume import DEFAULT_RESUME_TIMEOUT_S
from wire import codec
from wire.config import CONFIG_FILE, ConfigError
from wire.control_server import CONTROL_DIR_ENV, control_address
from wire.log import configure_logging
from wire.security import SECRET_FILE_ENV

STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    name: str  # "scheduler", "shim", "rank 2"
    proc: subprocess.Popen


def build_parser() -> argparse.ArgumentParser:
    """`deepinfer-run`'s flags and its `serve` command's: the one place that knows them
    (tests/orchestrator/test_startup_flags.py starts each of them)."""
    p = argparse.ArgumentParser(prog="deepinfer-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="ranks on this node (torchrun's default, 1); the model's head counts "
                        "must divide by the world size")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0,
                   help="0: pick a free port (one node; several need the same P on each)")
    p.add_argument("--secret-file", default=None,
                   help="a shared secret (mode 0600, the same file on every node) that "
                        "authenticates and encrypts the tcp:// sockets; required with --nnodes > 1")
    p.add_argument("--run-dir", default=None, help="default: a new private dir under /tmp")
    p.add_argument("--external-workers", action="store_true",
                   help="start no ranks here: they are started by torchrun, pointed at the "
                        "scheduler's worker address (logged at start)")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help="when the scheduler or a rank exits, restart them (the engine group) "
                        "up to N times; the HTTP server stays up and answers 503 + "
                        "retry-after meanwhile. One node only")
    p.add_argument("--resume-timeout", type=float, default=DEFAULT_RESUME_TIMEOUT_S,
                   metavar="S",
                   help="with --restart: a request in flight when the engine group dies "
                        "waits up to S seconds for the restarted group and goes on there "
                        "from where its stream stopped (SSE keep-alives meanwhile); past S, "
                        "past its own deadline, or with no restart left, it ends with the "
                        "error it gets without --restart. 0: never continued")
    sub = p.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="serve the model over HTTP"))
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.restart < 0:
        p.error("--restart must be >= 0")
    if not args.resume_timeout >= 0:  # NaN fails too
        p.error("--resume-timeout must be >= 0")
    if args.restart and (args.nnodes > 1 or args.external_workers):
        # the launcher can only restart the processes it started, all of them on this node
        p.error("--restart is not supported with --nnodes > 1 or --external-workers: "
                "restart the whole job from its own supervisor instead")
    return args


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port P such that P .. P+span-1 are free on `host` now, picked below the kernel's
    ephemeral range: a port from bind(0) lies inside it, where any outgoing connection
    (a rank's TCPStore client, say) may take it before our server binds it, and the
    ports after it (P+1, P+2 on the head node) were never checked at all."""
    low = _ephemeral_range()[0]
    rng = random.SystemRandom()
    if low - 1024 >= 1000:  # room below the ephemeral range
        for _ in range(200):
            port = rng.randrange(max(1024, low - 12000), low - span)
            if _unclaimed(host, port, span):
                return _hand_out(port, span)
    for _ in range(200):  # no room: let the kernel pick, and check the ports after it
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + span <= 65536 and _unclaimed(host, port, span):
            return _hand_out(port, span)
    raise RuntimeError(f"no {span} consecutive free ports on {host}")


# Ports this process handed out. A port is free until its server binds it, which may be
# seconds later in a child (a replica's shim after its model loads): a second pick in the
# meantime must not hand out the same port again.
_HANDED_OUT: set[int] = set()


def _unclaimed(host: str, port: int, span: int) -> bool:
    ports = range(port, port + span)
    return not _HANDED_OUT.intersection(ports) and all(_bindable(host, p) for p in ports)


def _hand_out(port: int, span: int) -> int:
    _HANDED_OUT.update(range(port, port + span))
    return port


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):  # not Linux: the IANA range
        return 49152, 65535


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def make_run_dir(requested: str | None) -> Path:
    if requested:
        path = Path(requested)
        path.mkdir(parents=True, exist_ok=True)
    else:
        path = Path(tempfile.mkdtemp(prefix="deepinfer-"))
    os.chmod(path, 0o700)  # the ipc sockets inside are reachable by this user only
    return path


def _die_with_parent() -> None:
    # If the launcher is killed outright, its children get SIGTERM instead of
    # lingering as orphans.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
    proc = subprocess.Popen([sys.executable, "-m", *args], env=repo_env(env), cwd=REPO,
                            start_new_session=True, preexec_fn=_die_with_parent)
    return Child(name, proc)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def stop_all(children: list[Child]) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def stop_in_order(children: list[Child]) -> None:
    """The scheduler first, then the ranks, then the shim. Stopped first, the scheduler
    still sees the ranks as they were: a step in flight ends with the dead rank named
    (not the ones stopped here) and its requests failed; the shim, stopped last, has
    passed those errors on."""
    order = ("scheduler", "rank", "shim")
    for prefix in order:
        stop_all([c for c in children if c.name.startswith(prefix)])
    stop_all([c for c in children if not c.name.startswith(order)])


@dataclass
class Launch:
    """What main() starts: enough to start the engine group again."""

    args: argparse.Namespace
    run_dir: Path
    addresses: dict[str, str]
    world_size: int

    @property
    def head(self) -> bool:
        return self.args.node_rank == 0

    @property
    def local_ranks(self) -> range:
        n = self.args.nproc_per_node
        return range(self.args.node_rank * n, (self.args.node_rank + 1) * n)


def start_group(launch: Launch, master_port: int, group: list[Child]) -> None:
    """Start the engine group into `group`: the scheduler (head node) and this node's
    ranks, each added as soon as it runs, so a failed spawn leaves nothing unstopped."""
    args = launch.args
    if launch.head:
        group.append(spawn("scheduler", ["scheduler.main", "--run-dir", str(launch.run_dir)]))
    for local_rank, rank in enumerate([] if args.external_workers else launch.local_ranks):
        group.append(spawn(f"rank {rank}", [
            "worker.main", "--scheduler", launch.addresses["workers"]], {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(launch.world_size), "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
            "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(master_port),
            CONTROL_DIR_ENV: str(launch.run_dir),  # its control socket, even over tcp://
        }))


def start_shim(launch: Launch, config, serve) -> Child:
    # a request waits for a restarted engine only if there will be one
    resume_s = launch.args.resume_timeout if launch.args.restart else 0.0
    shim_args = ["orchestrator.shim.server", "--run-dir", str(launch.run_dir),
                 "--model", config.tokenizer_dir, "--connect-timeout", "3600",
                 "--resume-timeout", str(resume_s), *serve.shim_args(model_name(config.model))]
    # The key goes in the shim's environment: a command line is visible in `ps`.
    return spawn("shim", shim_args, {API_KEY_ENV: serve.api_key} if serve.api_key else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = configure_logging("launcher")
    os.umask(0o077)  # what the engine writes (run dir, sockets, logs) is this user's only
    world_size = args.nproc_per_node * args.nnodes
    try:  # a flag the config refuses: its reason, not a traceback
        config, serve = build_config(args, world_size, args.nproc_per_node)
    except ConfigError as exc:
        raise SystemExit(f"deepinfer-run serve: {exc}") from None
    multi_node = args.nnodes > 1
    os.environ.update(secret_file_env(args.secret_file, multi_node))  # for every child
    if multi_node and not args.master_port:  # each node would pick a port of its own
        raise SystemExit("--nnodes > 1 needs --master-port P, the same on every node")
    run_dir = make_run_dir(args.run_dir)
    # the head node binds master_port + 1 and + 2 too when there are several nodes
    master_port = args.master_port or free_port(span=3)
    if multi_node:  # tcp only when several nodes are asked for
        workers_addr = f"tcp://{args.master_addr}:{master_port + 1}"
        requests_addr = f"tcp://{args.master_addr}:{master_port + 2}"
    else:
        workers_addr = f"ipc://{run_dir}/workers.sock"
        requests_addr = f"ipc://{run_dir}/requests.sock"
    launch = Launch(args, run_dir, {"workers": workers_addr, "requests": requests_addr}, world_size)
    if launch.head:
        if config.model.endswith(".gguf"):  # its tokenizer, as the shim and scheduler read one
            tokenizer = write_tokenizer_dir(config.model, run_dir / "tokenizer")
            config = dataclasses.replace(config, tokenizer=str(tokenizer))
        codec.write_file(run_dir / CONFIG_FILE, config)
        (run_dir / "addresses.json").write_text(json.dumps(launch.addresses))

    group: list[Child] = []
    shim: list[Child] = []  # started once, kept across restarts of the group
    stop_reason = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stop_reason["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        start_group(launch, master_port, group)
        if launch.head:
            shim.append(start_shim(launch, config, serve))
        _write_engine_file(launch, group + shim, serve)
        if args.external_workers:
            env = f"{SECRET_FILE_ENV}={os.environ[SECRET_FILE_ENV]} " if multi_node else ""
            log.info("waiting_for_external_workers", world_size=world_size,
                     command=f"{env}torchrun --nproc-per-node {args.nproc_per_node} "
                             f"-m worker.main --scheduler {workers_addr}")
        log.info("engine_started", run_dir=str(run_dir), world_size=world_size,
                 url=f"http://{serve.host}:{serve.port}" if launch.head else None,
                 pids={c.name: c.proc.pid for c in group + shim}, max_restarts=args.restart)

        def restart(attempt: int, cause: str) -> None:
            log.warning("engine_restarting", attempt=attempt, max_restarts=args.restart,
                        cause=cause)
            stop_in_order(group)
            group.clear()
            start_group(launch, free_port(), group)  # the old port may linger in TIME_WAIT
            _write_engine_file(launch, group + shim, serve)
            log.info("engine_restarted", attempt=attempt,
                     pids={c.name: c.proc.pid for c in group})

        return _supervise(group, shim, stop_reason, log, args.restart, restart)
    finally:
        stop_in_order(group + shim)
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(group: list[Child], shim: list[Child], stop_reason: dict, log,
               max_restarts: int, restart: Callable[[int, str], None]) -> int:
    """Until a signal or a death that is not restarted: the exit status to return."""
    attempt = 0
    while True:
        if stop_reason["signal"]:
            log.info("engine_stopping", reason=stop_reason["signal"])
            return 0
        exited = [c for c in shim + group if c.proc.poll() is not None]
        # The cause first. A child killed by a signal (kill -9, the OOM killer, a crash)
        # before one that exited with a status: the survivors of a broken collective exit
        # on their own, and two deaths often land in one poll. Then the ranks: a dead rank
        # makes the scheduler exit too.
        exited.sort(key=lambda c: (c.proc.returncode >= 0, not c.name.startswith("rank"),
                                   c.name))
        if exited:
            cause = "; ".join(f"{c.name} (pid {c.proc.pid}) {describe_exit(c.proc.returncode)}"
                              for c in exited)
            if attempt < max_restarts and not any(c in shim for c in exited):
                attempt += 1
                restart(attempt, cause)
                continue
            for c in exited:
                log.error("child_exited", process=c.name, pid=c.proc.pid,
                          status=describe_exit(c.proc.returncode), action="stopping the engine",
                          **({"restarts_used": attempt} if max_restarts else {}))
            code = exited[0].proc.returncode
            return 1 if code == 0 else (code if code > 0 else 128 - code)
        time.sleep(0.2)


def _write_engine_file(launch: Launch, children: list[Child], serve) -> None:
    """A small JSON for the inspect CLI: who runs where, and the control sockets of the
    scheduler and of this node's ranks (ranks started by torchrun use the same paths).
    Rewritten after each restart: the pids change, the addresses do not."""
    run_dir = launch.run_dir
    engine = {
        "launcher_pid": os.getpid(),
        "world_size": launch.world_size,
        "addresses": launch.addresses,
        "http": f"http://{serve.host}:{serve.port}",
        "processes": [{"name": c.name, "pid": c.proc.pid} for c in children],
        "control": {
            "scheduler": control_address(run_dir, "scheduler"),
            "ranks": {str(r): control_address(run_dir, f"rank{r}") for r in launch.local_ranks},
        },
    }
    tmp = run_dir / "engine.json.tmp"  # replaced whole: a reader never sees half a file
    tmp.write_text(json.dumps(engine, indent=2))
    tmp.replace(run_dir / "engine.json")


if __name__ == "__main__":
    sys.exit(main())
