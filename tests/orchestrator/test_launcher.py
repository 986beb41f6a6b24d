"""The launcher's supervision without an engine: children are `sleep` processes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import structlog
from structlog.testing import capture_logs

from orchestrator import launcher
from orchestrator.config import repo_env
from orchestrator.launcher import (
    Child,
    _bindable,
    _ephemeral_range,
    _supervise,
    free_port,
    parse_args,
    stop_in_order,
)
from wire.config import ConfigError


def test_restart_is_refused_where_it_cannot_work(capsys) -> None:
    for flags in (["--nnodes", "2"], ["--external-workers"]):
        with pytest.raises(SystemExit):
            parse_args([*flags, "--restart", "1", "serve"])
        assert "--restart is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--restart", "-1", "serve"])
    assert parse_args(["serve"]).restart == 0
    assert parse_args(["--restart", "2", "serve"]).restart == 2


def test_a_flag_the_config_refuses_stops_the_launch_with_its_reason(default_model,
                                                                    tmp_path) -> None:
    """Not a traceback: the reason, before any process starts."""
    (tmp_path / "file").write_text("x")
    for flags, reason in ((["--disk-cache-size", "5000"], "go together"),
                          (["--disk-cache-dir", str(tmp_path / "file" / "kv")],
                           "cannot create it")):
        r = subprocess.run([sys.executable, "-m", "orchestrator.launcher", "--run-dir",
                            str(tmp_path / "run"), "serve", "--model", str(default_model),
                            *flags], capture_output=True, text=True, env=repo_env(),
                           timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("deepinfer-run serve: ")
        assert reason in r.stderr
        assert not (tmp_path / "run").exists()


def test_only_a_refused_setting_loses_its_traceback(monkeypatch, tmp_path) -> None:
    """A ConfigError is the user's to fix: one line. Any other exception while building
    the config is a bug in it and keeps its traceback."""
    def refuse(*_args):
        raise ConfigError("--flag: refused")

    monkeypatch.setattr(launcher, "build_config", refuse)
    with pytest.raises(SystemExit, match="^deepinfer-run serve: --flag: refused$"):
        launcher.main(["--run-dir", str(tmp_path / "run"), "serve"])

    def bug(*_args):
        raise ValueError("a bug")

    monkeypatch.setattr(launcher, "build_config", bug)
    with pytest.raises(ValueError, match="a bug"):
        launcher.main(["--run-dir", str(tmp_path / "run"), "serve"])


def sleeper(name: str, seconds: str = "60") -> Child:
    return Child(name, subprocess.Popen(["sleep", seconds]))


def test_the_group_is_restarted_up_to_n_times_and_the_shim_kept() -> None:
    group = [sleeper("scheduler"), sleeper("rank 0"), sleeper("rank 1", "0")]
    shim = [sleeper("shim")]
    restarts: list[tuple[int, str]] = []

    def restart(attempt: int, cause: str) -> None:
        restarts.append((attempt, cause))
        stop_in_order(group)
        # the second group loses its scheduler at once: the restarts are used up
        group[:] = [sleeper("scheduler", "0"), sleeper("rank 0"), sleeper("rank 1")]

    try:
        with capture_logs() as logs:
            code = _supervise(group, shim, {"signal": None}, structlog.get_logger(), 1, restart)
        assert code == 1  # "scheduler" exited 0: unexpected all the same
        assert len(restarts) == 1 and restarts[0][0] == 1
        assert "rank 1 (pid" in restarts[0][1] and "exit status 0" in restarts[0][1]
        assert shim[0].proc.poll() is None  # the shim stays up across restarts
        exits = [e for e in logs if e["event"] == "child_exited"]
        assert [e["process"] for e in exits] == ["scheduler"]
        assert exits[0]["restarts_used"] == 1
    finally:
        stop_in_order(group + shim)


def test_the_shim_exiting_stops_everything_even_with_restarts_left() -> None:
    group = [sleeper("scheduler"), sleeper("rank 0")]
    shim = [sleeper("shim", "0")]
    try:
        code = _supervise(group, shim, {"signal": None}, structlog.get_logger(), 3,
                          lambda *_: pytest.fail("restarted for a dead shim"))
        assert code == 1
    finally:
        stop_in_order(group + shim)


def test_a_child_killed_by_a_signal_is_named_before_the_ones_that_exited_after_it() -> None:
    """kill -9 of rank 1: rank 0 leaves its broken collective with a status of its own, and
    both are often reaped in one poll. The killed rank is the cause, whatever its name."""
    group = [sleeper("scheduler"), sleeper("rank 0", "0"), sleeper("rank 1")]
    group[2].proc.kill()
    for child in group[1:]:
        child.proc.wait()
    try:
        with capture_logs() as logs:
            code = _supervise(group, [], {"signal": None}, structlog.get_logger(), 0,
                              lambda *_: pytest.fail("restarted without restarts"))
        exits = [e for e in logs if e["event"] == "child_exited"]
        assert [e["process"] for e in exits] == ["rank 1", "rank 0"]
        assert "SIGKILL" in exits[0]["status"] and code == 128 + 9
    finally:
        stop_in_order(group)


def test_a_picked_port_and_the_ones_after_it_are_free_and_outside_the_ephemeral_range(
        monkeypatch) -> None:
    # bind(0) hands out ports inside the ephemeral range, where an outgoing connection
    # may take one before the server binds it; and the head node binds master_port + 1, + 2
    low, _ = _ephemeral_range()
    for _ in range(20):
        port = free_port(span=3)
        assert port + 2 < low and all(_bindable("127.0.0.1", p) for p in (port, port + 1, port + 2))

    def draws(*ports: int) -> None:  # the candidates free_port draws, in order
        class Draws:
            def __init__(self) -> None:
                self.ports = iter(ports)

            def randrange(self, _start: int, _stop: int) -> int:
                return next(self.ports)
        monkeypatch.setattr(launcher.random, "SystemRandom", Draws)

    base = port + 100
    monkeypatch.setattr(launcher, "_HANDED_OUT", set())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))  # the first candidate's second port is in use
        draws(base, base + 5)
        assert free_port(span=3) == base + 5
    # Handed out, unbound yet (a child binds it later): not handed out again, not even
    # as the tail of a wider pick
    draws(base + 5, base + 3, base + 20)
    assert free_port(span=3) == base + 20
