"""Who may talk to the engine's ZeroMQ sockets: every bind and connect goes through here.

    secure_bind(sock, address)      # servers: the scheduler's ROUTERs, the control REPs
    secure_connect(sock, address)   # clients: the ranks' and the shim's DEALERs

ipc:// (one node): the socket file is made 0600 after the bind, on top of the run
directory's 0700, so another local user can neither connect nor inject.

tcp:// (several nodes, `deepinfer-run --nnodes N --secret-file FILE`): CURVE
authenticates and encrypts every connection. Both key pairs derive from the shared
secret (the file named by $DEEPINFER_SECRET_FILE, mode 0600 on every node):

    server secret key = z85(blake2b(secret, person="deepinfer-server"))
    client secret key = z85(blake2b(secret, person="deepinfer-client"))
    public keys       = zmq.curve_public(secret key)

A peer without the secret cannot derive the server's public key, so it cannot even
complete a handshake; a ZAP authenticator on the server side also refuses any client
key but the derived one. tcp:// without a secret is refused: an unauthenticated
socket would let anyone on the network send step plans or read prompts.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import stat
from pathlib import Path

import zmq
import zmq.auth.thread
from zmq.utils import z85

SECRET_FILE_ENV = "DEEPINFER_SECRET_FILE"
MIN_SECRET_BYTES = 16
_SERVER, _CLIENT = b"deepinfer-server", b"deepinfer-client"  # blake2b person: <= 16 bytes

# One ZAP handler per context (it serves every CURVE socket of that context), kept for
# the process and stopped at exit. Each holds its context, so an id is never reused here.
_authenticators: dict[int, zmq.auth.thread.ThreadAuthenticator] = {}


class InsecureFileError(ValueError):
    """A secret file that other users could read, or one too short to be a secret."""


def read_private_file(path: str | Path, what: str) -> str:
    """The stripped text of a file only its owner may read (as ssh insists for keys)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise InsecureFileError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InsecureFileError(
            f"{what} {path} is accessible by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"it must be private: chmod 600 {path}")
    if not text:
        raise InsecureFileError(f"{what} {path} is empty")
    return text


def read_secret(path: str | Path) -> bytes:
    secret = read_private_file(path, "--secret-file").encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise InsecureFileError(
            f"--secret-file {path} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES}, "
            "e.g. `head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE`")
    return secret


def derive_keypair(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of `role` ("server" or "client"), the same on every
    node that holds `secret`."""
    person = {"server": _SERVER, "client": _CLIENT}[role]
    seed = hashlib.blake2b(secret, digest_size=32, person=person).digest()
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


def _secret_from_env(address: str) -> bytes:
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        raise InsecureFileError(
            f"{address}: tcp:// sockets need a shared secret (deepinfer-run --secret-file "
            f"FILE, or ${SECRET_FILE_ENV}=FILE for ranks started by torchrun)")
    return read_secret(path)


def _start_authenticator(ctx: zmq.Context, client_public: bytes) -> None:
    """ZAP on `ctx`: only the derived client key is let in. Must run before the bind,
    since libzmq lets every client in while no ZAP handler exists."""
    if id(ctx) in _authenticators:
        return

    class OnlyOurClients:
        def callback(self, domain: str, key: bytes) -> bool:
            return key == client_public

    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=OnlyOurClients())
    _authenticators[id(ctx)] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop `ctx`'s ZAP handler (before `ctx.term()`, which would wait for its sockets)."""
    auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


@atexit.register
def _stop_authenticators() -> None:
    for auth in list(_authenticators.values()):
        stop_authenticator(auth.context)


def secure_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` a CURVE server that admits only clients holding `secret`."""
    _, server_secret = derive_keypair(secret, "server")
    client_public, _ = derive_keypair(secret, "client")
    _start_authenticator(sock.context, client_public)
    sock.curve_secretkey = server_secret
    sock.curve_server = True


def secure_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` a CURVE client of a server that holds `secret`."""
    server_public, _ = derive_keypair(secret, "server")
    client_public, client_secret = derive_keypair(secret, "client")
    sock.curve_serverkey = server_public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_secret


def _ipc_path(address: str) -> Path | None:
    path = address[len("ipc://"):]
    return None if path.startswith("@") else Path(path)  # "@": abstract, no file


def secure_bind(sock: zmq.Socket, address: str, secret: bytes | None = None) -> None:
    """Bind `sock` so that only this user (ipc://) or holders of the secret (tcp://)
    reach it. `secret`: default, the file named by $DEEPINFER_SECRET_FILE."""
    if address.startswith("tcp://"):
        secure_server(sock, secret if secret is not None else _secret_from_env(address))
    sock.bind(address)
    if address.startswith("ipc://") and (path := _ipc_path(address)) is not None:
        os.chmod(path, 0o600)  # connecting to a unix socket needs write access to it


def secure_connect(sock: zmq.Socket, address: str, secret: bytes | None = None) -> None:
    """Connect `sock`, as a CURVE client over tcp:// (see `secure_bind`)."""
    if address.startswith("tcp://"):
        secure_client(sock, secret if secret is not None else _secret_from_env(address))
    sock.connect(address)
