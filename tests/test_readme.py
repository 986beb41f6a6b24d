"""README.md's example commands, run as written.

The convention the README follows, so that what it shows is what works:

- Only fenced blocks tagged ```bash are run. Blocks tagged ```text or ```console, or not
  tagged, are not (what needs a GPU, npm and Claude Code, several nodes or machines).
- In a bash block each line is a command; a trailing backslash continues it on the next
  line; blank lines and comment lines are skipped.
- A command starting with `make serve` or `deepinfer-run` starts a server: in the
  background, its output captured, waited for until `GET /health` answers on the port it
  names (`--port N`; 8000 if it names none). If that port is already taken on this
  machine, the test fails, saying so.
- Each `curl ...` command after it in the same block is then run with bash: it must exit
  0 and print something that is no API error.
- Then the server is stopped as Ctrl-C stops it (SIGINT to its process group), and must
  stop cleanly.
- `make test` is not run (it is this suite) but counted.
- Any other command in a bash block fails the test as not runnable as written, so the
  README cannot drift into commands nobody runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tools.harness.served import wait_healthy

README = REPO / "README.md"
FENCE = re.compile(r"^\s*```(\S*)\s*$")
DEFAULT_PORT = 8000
START_TIMEOUT_S = 300  # `make serve` checks the install first, then loads the GGUF
CURL_TIMEOUT_S = 300


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in the README
    text: str  # as bash gets it, continuation lines joined
    kind: str  # "server", "curl", "make test", or "" (not runnable as written)

    @property
    def port(self) -> int:
        words = shlex.split(self.text, comments=True)
        return int(words[words.index("--port") + 1]) if "--port" in words else DEFAULT_PORT


@dataclass(frozen=True)
class Block:
    line: int  # of its opening fence
    tag: str
    commands: list[Command]


def kind_of(text: str) -> str:
    words = shlex.split(text, comments=True)
    if words[:2] == ["make", "serve"] or words[:1] == ["deepinfer-run"]:
        return "server"
    if words[:2] == ["make", "test"]:
        return "make test"
    if words[:1] == ["curl"]:
        return "curl"
    return ""


def commands_of(lines: list[str], first_line: int) -> list[Command]:
    commands: list[Command] = []
    pending: list[str] = []
    start = first_line
    for number, line in enumerate(lines, first_line):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        text = " ".join([*pending, stripped])
        pending = []
        commands.append(Command(start, text, kind_of(text)))
    if pending:
        raise ValueError(f"README.md:{start}: a continued line ends its block")
    return commands


def blocks_of(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
        tag = opening.group(1)
        body = lines[i + 1:end]
        blocks.append(Block(i + 1, tag, commands_of(body, i + 2) if tag == "bash" else []))
        i = end + 1
    return blocks


def problems_of(blocks: list[Block]) -> list[str]:
    """What in the bash blocks cannot be run as written."""
    problems = []
    for block in blocks:
        started = False
        for c in block.commands:
            if not c.kind:
                problems.append(f"README.md:{c.line}: not runnable as written: {c.text}")
            elif c.kind == "curl" and not started:
                problems.append(f"README.md:{c.line}: a curl with no server started before it "
                                f"in its block: {c.text}")
            started |= c.kind == "server"
    return problems


def bash_blocks() -> list[Block]:
    return [b for b in blocks_of(README.read_text()) if b.tag == "bash"]


SAMPLE = '''Text.

```bash
make test    # the suite
             # (a comment line)
make serve   # serves
# a comment
curl -s 127.0.0.1:8000/health \\
  -H 'a: b'
```

```text
anything at all
```

```bash
pip install something
curl -s 127.0.0.1:9000/x
```

```
untagged
```
'''


def test_the_convention_reads_a_readme() -> None:
    blocks = blocks_of(SAMPLE)
    assert [(b.line, b.tag) for b in blocks] == [(3, "bash"), (12, "text"), (16, "bash"),
                                                  (21, "")]
    first = blocks[0].commands
    assert [(c.line, c.kind) for c in first] == [(4, "make test"), (6, "server"), (8, "curl")]
    assert first[2].text == "curl -s 127.0.0.1:8000/health  -H 'a: b'"
    assert first[1].port == DEFAULT_PORT
    assert Command(1, "deepinfer-run serve --port 8123", "server").port == 8123
    assert problems_of(blocks) == [
        "README.md:17: not runnable as written: pip install something",
        "README.md:18: a curl with no server started before it in its block: "
        "curl -s 127.0.0.1:9000/x"]
    assert kind_of("make serve-replicas N=2") == ""
    assert kind_of(".venv/bin/deepinfer-run serve") == ""


def test_every_bash_command_is_runnable_as_written() -> None:
    blocks = bash_blocks()
    assert not problems_of(blocks), "\n".join(problems_of(blocks))
    kinds = [c.kind for b in blocks for c in b.commands]
    # the front door: how to test, how to serve, and a request to what is served
    assert kinds.count("make test") >= 1 and kinds.count("server") >= 1
    assert kinds.count("curl") >= 1


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def readme_env() -> dict[str, str]:
    """This checkout's environment, with the venv's commands (deepinfer-run) on PATH, as in
    a shell where the venv is active."""
    env = subprocess_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


class Server:
    """A README command that starts a server, in the background, in its own process group
    (a terminal's foreground job: Ctrl-C reaches every process in it)."""

    def __init__(self, command: Command, log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        if command.text.startswith("make"):
            dry = subprocess.run(["make", "-n", *shlex.split(command.text, comments=True)[1:]],
                                 cwd=REPO, env=readme_env(), capture_output=True, text=True)
            assert " pip " not in dry.stdout, (
                f"README.md:{command.line}: `{command.text}` would install first (pip): run "
                f"`make install`, then this test again")
        assert port_is_free(command.port), (
            f"README.md:{command.line}: port {command.port} is taken on this machine, and "
            f"`{command.text}` serves on it: free it to run the README's commands")
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(["bash", "-c", command.text], cwd=REPO,
                                         env=readme_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{command.port}", timeout_s=START_TIMEOUT_S,
                         proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise AssertionError(f"README.md:{command.line}: `{command.text}`: {exc}\n"
                                 f"{self.log()[-4000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        """Ctrl-C: the launcher stops its children and exits; make, if it ran it, too."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"`{self.command.text}` did not stop within 60 s of Ctrl-C"
                                 f"\n{self.log()[-4000:]}") from None

    def stopped_cleanly(self) -> bool:
        """The launcher logged its stop on the signal, and no child's exit before it."""
        events = []
        for line in self.log().splitlines():
            try:
                events.append(json.loads(line).get("event"))
            except (ValueError, AttributeError):
                pass  # make's own lines, a progress bar
        return "engine_stopping" in events and "child_exited" not in events


def run_curl(command: Command) -> None:
    done = subprocess.run(["bash", "-c", command.text], cwd=REPO, env=readme_env(),
                          capture_output=True, text=True, timeout=CURL_TIMEOUT_S)
    where = f"README.md:{command.line}: `{command.text}`"
    assert done.returncode == 0, f"{where}: exit {done.returncode}\n{done.stderr}"
    out = done.stdout.strip()
    assert out, f"{where}: printed nothing"
    try:
        body = json.loads(out)
    except ValueError:
        return  # not JSON (an SSE stream, say): what it printed is its answer
    is_error = isinstance(body, dict) and ("error" in body or body.get("type") == "error")
    assert not is_error, f"{where}: answered with an error: {out[:2000]}"


def blocks_with_a_server() -> list[Block]:
    return [b for b in bash_blocks() if any(c.kind == "server" for c in b.commands)]


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_with_a_server(), ids=lambda b: f"README.md:{b.line}")
def test_the_readme_commands_run(block: Block, tmp_path: Path) -> None:
    assert not problems_of([block]), problems_of([block])
    server: Server | None = None
    try:
        for command in block.commands:
            if command.kind == "server":
                if server is not None:
                    server.stop()
                server = Server(command, tmp_path / f"server-{command.line}.log")
            elif command.kind == "curl":
                run_curl(command)
    finally:
        if server is not None:
            server.stop()
    assert server is not None and server.stopped_cleanly(), server.log()[-4000:]
