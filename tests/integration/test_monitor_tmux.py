"""The live monitor in a real terminal: `asyncrl up` and `asyncrl monitor` run in tmux panes
against a real run, and what the panes show is read back with capture-pane. The roles' /metrics
endpoints are scraped during the same run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.dashboard import SPARK_CHARS
from tests.integration.conftest import QUICKSTART, role_env, wait_for
from tests.unit.test_prometheus import free_port_block, scrape

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


class Tmux:
    """A private tmux server (its own socket): the test starts it and kills only it."""

    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name, "-f", "/dev/null"]
        self.socket = Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / name

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True,
                              text=True, timeout=30).stdout

    def start(self, window: str, argv: list[str], first: bool = False) -> None:
        env = role_env()
        keep = ("PATH", "HOME", "PYTHONPATH", "HF_HUB_OFFLINE", "OMP_NUM_THREADS",
                "ASYNCRL_LOG_LEVEL")
        # env -i: the tmux server inherits this process' environment, COLUMNS included,
        # which would override the pane's real width.
        command = shlex.join(["env", "-i", *(f"{k}={env[k]}" for k in keep if k in env),
                              "TERM=xterm-256color", *argv])
        if first:
            self("new-session", "-d", "-s", "t", "-n", window, "-x", "150", "-y", "60", command)
            self("set-option", "-g", "remain-on-exit", "on")
        else:
            self("new-window", "-t", "t", "-n", window, command)

    def screen(self, window: str) -> str:
        return self("capture-pane", "-p", "-t", f"t:{window}")

    def dead(self, window: str) -> str | None:
        """The exit status of the window's process (``signal N`` if a signal killed it), or
        None while it runs. tmux may mark the pane dead (its pty closed) a moment before it
        has reaped the process and knows the status: that still reads as running."""
        dead, status, signal_, pid = (self(
            "display-message", "-p", "-t", f"t:{window}",
            "#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_pid}").strip().split("|"))
        if status or signal_:
            return status or f"signal {signal_}"
        return _zombie_status(int(pid)) if dead == "1" else None

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)
        self.socket.unlink(missing_ok=True)  # tmux leaves it behind


def _zombie_status(pid: int) -> str | None:
    """The exit status of a process that exited but was not reaped, from the ``exit_code``
    field of ``/proc/PID/stat`` (a ``waitpid`` status). tmux 3.3 on a busy machine can leave a
    dead pane's process unreaped for good, and then never learns its status."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z":
        return None
    code = int(fields[-1])  # field 52, exit_code
    return f"signal {code & 0x7F}" if code & 0x7F else str(code >> 8)


@pytest.fixture
def tmux() -> Tmux:
    server = Tmux(f"asyncrl-test-{os.getpid()}")
    try:
        yield server
    finally:
        server.kill()


def test_up_and_monitor_in_tmux(tmp_path: Path, tmux: Tmux) -> None:
    port = free_port_block(4)
    sets = [f"run.output_dir={tmp_path}", "run.name=tui", "learner.total_steps=300",
            "eval.every_steps=5", "launcher.refresh_s=1", f"monitor.prometheus_port={port}"]
    cli = [sys.executable, "-m", "asyncrl.cli"]
    tmux.start("up", [*cli, "up", str(QUICKSTART), *(a for s in sets for a in ("--set", s))],
               first=True)
    # `up` on a terminal shows the dashboard (not progress lines), redrawn in place.
    wait_for(lambda: re.search(r"learner v([1-9]\d*)", tmux.screen("up")), 240,
             "the dashboard of `asyncrl up` at version 1")
    up_screen = tmux.screen("up")
    assert "engines ·" in up_screen and up_screen.count("learner step") == 1, up_screen

    _check_role_endpoints(port)

    config = tmp_path / "tui" / "config.toml"
    tmux.start("monitor", [*cli, "monitor", str(config)])

    def steps_drawn() -> int:
        found = re.search(r"curves · steps 1–(\d+)", tmux.screen("monitor"))
        return int(found.group(1)) if found else 0

    wait_for(lambda: steps_drawn() >= 8, 300, "the monitor's curves over 8 steps")
    text = tmux.screen("monitor")
    assert text.count("asyncrl run tui") == 1, text  # redrawn in place, not scrolled
    version = int(re.search(r"learner v(\d+)", text).group(1))
    for index in (0, 1):
        cells = next(line for line in text.splitlines()
                     if f"rollout-{index}-" in line).strip("│ ").split()
        # An engine may lag the learner by more than s for a moment: it acks a version on
        # receipt and adopts it after its current call, and the learner publishes the next
        # versions meanwhile. The bound that holds is on the groups consumed (below).
        assert cells[1] == "yes" and 0 <= version - int(cells[2]), text  # version, lag
        assert int(cells[3]) == version - int(cells[2])
        assert re.fullmatch(r"\d+%", cells[-1]), cells  # engine idle ratio
    assert re.search(r"^│ 0 █+ +[\d,]+", text, re.M), text  # staleness histogram, bar of s=0
    assert not re.search(r"^│ [3-9] ", text, re.M), text  # no consumed group beyond s = 2
    # The reward curve may share its line with another panel (the time bars, also drawn in
    # block characters): read the sparkline that follows the label.
    reward = next(line for line in text.splitlines() if "│ reward" in line)
    drawn = int(re.search(r"curves · steps 1–(\d+)", text).group(1))
    spark = re.search(f"│ reward +([{SPARK_CHARS}]+)", reward)
    assert spark and len(spark.group(1)) == min(drawn, 32), reward
    assert re.search(r"idle: learner \d+% · engines \d+%", text), text
    assert re.search(r"waiting for data +█* +\d\.\d{3}s", text), text

    tmux("send-keys", "-t", "t:monitor", "C-c")
    wait_for(lambda: tmux.dead("monitor") is not None, 30, "the monitor to exit on Ctrl-C")
    assert tmux.dead("monitor") == "0", tmux.screen("monitor")
    tmux("send-keys", "-t", "t:up", "C-c")
    wait_for(lambda: tmux.dead("up") is not None, 120, "`asyncrl up` to stop on Ctrl-C")


def _check_role_endpoints(port: int) -> None:
    """Every role's /metrics answers during the run, at base + role offset (each role
    starts serving once it is up: under load a worker may come up after the learner's
    first step)."""
    def serving(at: int, name: str) -> dict:
        try:
            served = scrape(at)
        except OSError:
            return {}
        return served if any(n == name for n, _ in served) else {}

    for at, name in ((port, "asyncrl_buffer_version"), (port + 1, "asyncrl_critic_score_mean"),
                     (port + 2, "asyncrl_rollout_engine_version"),
                     (port + 3, "asyncrl_rollout_engine_version")):
        wait_for(lambda: serving(at, name), 120, f"{name} on port {at}")
    for worker in (0, 1):
        served = serving(port + 2 + worker, "asyncrl_rollout_engine_version")
        labels = dict(next(labels for name, labels in served
                           if name == "asyncrl_rollout_engine_version"))
        assert labels["role"] == "rollout" and labels["member"].startswith(f"rollout-{worker}-")
        assert ("asyncrl_rollout_tokens", tuple(sorted(labels.items()))) in served
