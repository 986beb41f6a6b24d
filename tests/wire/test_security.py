"""Transport security: CURVE over tcp:// lets only holders of the shared secret talk
(a ROUTER/DEALER pair as the scheduler and a rank use it), ipc:// socket files are
private, and secret files must be private too."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.conftest import free_port
from wire import security as ts

SECRET = b"correct horse battery staple, 32b"
TIMEOUT_MS = 1500


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    ts.stop_authenticator(context)
    context.destroy(linger=0)


@pytest.fixture
def server(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    ts.secure_bind(sock, address, SECRET)
    return sock, address


def dealer(ctx: zmq.Context, address: str, secret: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is None:
        sock.connect(address)  # no CURVE at all
    else:
        ts.secure_connect(sock, address, secret)
    return sock


def test_keys_are_derived_deterministically_and_per_role() -> None:
    pub, sec = ts.derive_keypair(SECRET, "server")
    assert (pub, sec) == ts.derive_keypair(SECRET, "server")
    assert len(pub) == len(sec) == 40 and zmq.curve_public(sec) == pub
    assert ts.derive_keypair(SECRET, "client") != (pub, sec)
    assert ts.derive_keypair(SECRET + b"x", "server") != (pub, sec)


def test_the_right_secret_talks_both_ways(ctx, server) -> None:
    sock, address = server
    client = dealer(ctx, address, SECRET)
    client.send(b"hello")
    assert sock.poll(TIMEOUT_MS * 4), "the server got nothing from a client with the secret"
    identity, frame = sock.recv_multipart()
    assert frame == b"hello"
    sock.send_multipart([identity, b"plan"])
    assert client.poll(TIMEOUT_MS * 4) and client.recv() == b"plan"


@pytest.mark.parametrize("who", ["wrong secret", "no curve", "right server key only"])
def test_a_peer_without_the_secret_gets_nothing_and_injects_nothing(ctx, server, who) -> None:
    sock, address = server
    if who == "right server key only":
        # Knows the server's public key but not the client key pair: ZAP refuses it.
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        intruder.curve_serverkey = ts.derive_keypair(SECRET, "server")[0]
        intruder.curve_publickey, intruder.curve_secretkey = public, secret
        intruder.connect(address)
    else:
        intruder = dealer(ctx, address, b"not the secret, but just as long" if
                          who == "wrong secret" else None)
    intruder.send(b"step plan from nowhere")
    assert not sock.poll(TIMEOUT_MS), "the server accepted a frame from a peer without the secret"
    # A legitimate client still gets through afterwards.
    client = dealer(ctx, address, SECRET)
    client.send(b"hello")
    assert sock.poll(TIMEOUT_MS * 4)
    identity, frame = sock.recv_multipart()
    assert frame == b"hello"
    sock.send_multipart([identity, b"secret plan"])
    assert client.poll(TIMEOUT_MS * 4)
    assert not intruder.poll(200), "a peer without the secret read a reply"


def test_tcp_without_a_secret_is_refused(ctx, monkeypatch) -> None:
    monkeypatch.delenv(ts.SECRET_FILE_ENV, raising=False)
    sock = ctx.socket(zmq.ROUTER)
    with pytest.raises(ts.InsecureFileError, match="--secret-file"):
        ts.secure_bind(sock, f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ts.InsecureFileError, match="--secret-file"):
        ts.secure_connect(ctx.socket(zmq.DEALER), "tcp://127.0.0.1:1")


def test_the_secret_comes_from_the_env_file(ctx, tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    monkeypatch.setenv(ts.SECRET_FILE_ENV, str(path))
    address = f"tcp://127.0.0.1:{free_port()}"
    sock = ctx.socket(zmq.ROUTER)
    ts.secure_bind(sock, address)  # the file's secret, stripped: the explicit one matches it
    client = dealer(ctx, address, SECRET)
    client.send(b"hi")
    assert sock.poll(TIMEOUT_MS * 4)


def test_ipc_socket_files_are_private_whatever_the_umask(ctx, tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        sock = ctx.socket(zmq.ROUTER)
        ts.secure_bind(sock, f"ipc://{tmp_path}/workers.sock")
    finally:
        os.umask(old)
    mode = (tmp_path / "workers.sock").stat().st_mode
    assert mode & 0o077 == 0, oct(mode)
    client = dealer(ctx, f"ipc://{tmp_path}/workers.sock", None)
    client.send(b"same user")
    assert sock.poll(TIMEOUT_MS * 4)


def test_private_files(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("  s3cret-key-of-some-length \n")
    path.chmod(0o644)
    with pytest.raises(ts.InsecureFileError, match="chmod 600"):
        ts.read_private_file(path, "--api-key-file")
    path.chmod(0o600)
    assert ts.read_private_file(path, "--api-key-file") == "s3cret-key-of-some-length"
    path.chmod(0o640)
    with pytest.raises(ts.InsecureFileError, match="mode 0640"):
        ts.read_private_file(path, "--api-key-file")
    path.write_text("\n")
    path.chmod(0o600)
    with pytest.raises(ts.InsecureFileError, match="empty"):
        ts.read_private_file(path, "--api-key-file")
    path.write_text("short")
    with pytest.raises(ts.InsecureFileError, match="at least"):
        ts.read_secret(path)
    with pytest.raises(ts.InsecureFileError, match="cannot read"):
        ts.read_private_file(tmp_path / "missing", "--secret-file")
