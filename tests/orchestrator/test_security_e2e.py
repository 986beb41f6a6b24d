"""`deepinfer-run serve --api-key-file` as a user would start it (2 ranks): the key is in
no process's command line and no log, every endpoint but /health wants it, the shim
listens on loopback only, the run directory and its sockets are private, and a request
with oversized headers is refused by the HTTP server. Then two "nodes" on this machine
(`--nnodes 2`), whose tcp:// sockets only a holder of --secret-file can use."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zmq

from tests.conftest import REPO, free_port, subprocess_env
from tests.orchestrator.e2e_helpers import Served, complete, wait_healthy
from wire import codec
from wire.lifecycle import ClientHello

pytestmark = pytest.mark.slow
KEY = "e2e-key-7d1f0c2a9b"


@pytest.fixture(scope="module")
def served(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("security")
    key_file = home / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    eng = Served(default_model, home / "run", nproc=2,
                 extra_args=["--api-key-file", str(key_file), "--max-header-bytes", "8192"])
    yield eng
    assert eng.stop() == 0, eng.log_path.read_text()[-3000:]
    assert KEY not in eng.log_path.read_text()


def test_the_key_is_on_no_command_line(served: Served) -> None:
    pids = {"launcher": served.proc.pid, **served.pids()}
    assert set(pids) >= {"launcher", "scheduler", "shim", "rank 0", "rank 1"}
    for name, pid in pids.items():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert KEY not in argv, name
    assert "--api-key" not in Path(f"/proc/{pids['shim']}/cmdline").read_bytes().decode()


def test_every_endpoint_but_health_wants_the_key(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        for method, path in [("GET", "/"), ("HEAD", "/"), ("GET", "/metrics"),
                             ("GET", "/v1/models"), ("GET", "/v1/models/tiny-llama"),
                             ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/messages"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]:
            r = c.request(method, path, json=body if method == "POST" else None)
            assert r.status_code == 401, (method, path)
            r = c.request(method, path, json=body if method == "POST" else None,
                          headers={"x-api-key": KEY})
            assert r.status_code != 401, (method, path)
        ok = c.post("/v1/messages/count_tokens", json=body,
                    headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["input_tokens"] > 0


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp, tcp6)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                out.append(addr)
    return out


def test_the_shim_listens_on_loopback_only(served: Served) -> None:
    assert listening_addresses(served.port) == ["0100007F"]  # 127.0.0.1, little-endian


def test_run_dir_and_sockets_are_private(served: Served) -> None:
    run_dir = served.run_dir
    assert run_dir.stat().st_mode & 0o777 == 0o700
    entries = list(run_dir.iterdir())
    sockets = [p for p in entries if p.is_socket()]
    assert {p.name for p in sockets} >= {"workers.sock", "requests.sock",
                                         "control-scheduler.sock", "control-rank0.sock"}
    for p in entries:
        assert p.stat().st_mode & 0o077 == 0, f"{p.name}: {oct(p.stat().st_mode)}"


def raw_status(port: int, padding: int) -> int:
    """The status of a GET whose head carries `padding` extra bytes, sent at once."""
    request = (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
               f"x-padding: {'a' * padding}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        status_line = s.recv(4096).split(b"\r\n", 1)[0].decode()
    return int(status_line.split()[1])


def test_oversized_headers_are_refused(served: Served) -> None:
    """--max-header-bytes (8 KiB here): a head that arrives whole is refused by the app
    (431), one that outgrows a read by h11 itself (400 or 431)."""
    assert raw_status(served.port, 16 * 1024) == 431
    assert raw_status(served.port, 1024 * 1024) in (400, 431)
    r = httpx.post(f"{served.url}/v1/messages", json={},
                   headers={"x-api-key": KEY, "x-padding": "a" * 9000})
    assert r.status_code == 431 and r.json()["type"] == "error"
    r = httpx.get(f"{served.url}/v1/models", headers={"x-api-key": KEY, "x-small": "a" * 4000})
    assert r.status_code == 200


def launcher(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.launcher", *args], cwd=REPO,
                            env=subprocess_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_two_nodes_talk_over_curve_and_nobody_else_does(default_model: Path,
                                                        tmp_path: Path) -> None:
    serve = ["serve", "--model", str(default_model), "--dtype", "float32"]
    refused = subprocess.run([sys.executable, "-m", "orchestrator.launcher", "--nnodes", "2",
                              *serve], cwd=REPO, env=subprocess_env(), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "needs --secret-file" in refused.stderr

    secret = tmp_path / "secret"
    secret.write_bytes(base64.b64encode(os.urandom(32)))
    secret.chmod(0o600)
    refused = subprocess.run([sys.executable, "-m", "orchestrator.launcher", "--nnodes", "2",
                              "--secret-file", str(secret), *serve], cwd=REPO,
                             env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "needs --master-port" in refused.stderr
    master_port, port = free_port(span=3), free_port()  # the head binds master_port + 1, + 2
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(master_port), "--secret-file", str(secret)]
    nodes = [launcher(*common, "--node-rank", str(r), "--run-dir", str(tmp_path / f"run{r}"),
                      *serve, "--port", str(port), log=tmp_path / f"node{r}.log")
             for r in (0, 1)]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=120)
        out = complete(f"http://127.0.0.1:{port}", prompt="Hello", max_tokens=3, temperature=0)
        assert len(out["choices"][0]["token_ids"]) == 3
        # No secret, no answer: the scheduler's client socket ignores a plain ZeroMQ peer.
        ctx = zmq.Context()
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(f"tcp://127.0.0.1:{master_port + 2}")
        try:  # without a handshake there may be no pipe to queue on: send never blocks
            intruder.send(codec.encode(ClientHello(pid=os.getpid())), zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert not intruder.poll(1500)
        ctx.destroy(linger=0)
    finally:
        for node in nodes:
            node.send_signal(signal.SIGINT)
        codes = [node.wait(timeout=60) for node in nodes]
    logs = "".join((tmp_path / f"node{r}.log").read_text() for r in (0, 1))
    assert codes == [0, 0], logs[-3000:]
