"""Helpers for end-to-end tests: start asyncrl roles as real OS processes through the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def role_env() -> dict[str, str]:
    env = dict(os.environ)
    # The vLLM tests' session environment (tests/engines/conftest.py) stays in this pytest
    # worker for the later tests: TORCH_COMPILE_DISABLE must not reach their roles (a
    # learner.compile run would be refused). A vLLM worker sets it itself on a CPU.
    env.pop("TORCH_COMPILE_DISABLE", None)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", ASYNCRL_LOG_LEVEL="INFO",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


class Processes:
    """Starts CLI processes, each in its own session; kills only what it started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=role_env(), cwd=ROOT,
                                start_new_session=True)
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def start_buffer(self, *args: str) -> tuple[subprocess.Popen, str]:
        """``asyncrl buffer ARGS`` (config and ``--set``s), once it listens: the process and
        the address it wrote to its ``--address-file``."""
        address_file = self.log_dir / "buffer.addr"
        proc = self.start("buffer", "buffer", *args, "--address-file", str(address_file))
        wait_for(address_file.exists, 30, "the buffer address")
        return proc, address_file.read_text().strip()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait(self, proc: subprocess.Popen, timeout_s: float) -> int:
        """``proc``'s exit status once it exits. Past ``timeout_s`` (a bound on a hang, never a
        measure), the test fails with the process's log: a bare TimeoutExpired says nothing of
        where it hung."""
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            name = self.names[proc.pid]
            pytest.fail(f"{name} still running after {timeout_s:.0f}s; its log:\n"
                        f"{self.log(name)}")

    def cleanup(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.cleanup()


def children_by_parent() -> dict[int, list[int]]:
    """ppid → the pids of its live children, read off ``/proc`` once."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    return parents


def role_children(role_pid: int) -> list[int]:
    """A role's children (learner ranks, rollout workers), in start order: the processes the
    role's fork server forked (``asyncrl.launch.roles._fork_server``), not multiprocessing's
    helpers nor what the children themselves start."""
    parents = children_by_parent()
    servers = []
    for pid in parents.get(role_pid, []):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            servers.append(pid)
    return sorted(child for server in servers for child in parents.get(server, []))


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def step_records(metrics: Path) -> list[dict]:
    """The learner's per-step records in a run's metrics.jsonl (none before it exists)."""
    from asyncrl.metrics import read_jsonl

    if not metrics.exists():
        return []
    return [r for r in read_jsonl(metrics) if isinstance(r.get("step"), int)]


def interrupted_run(output_dir: Path, name: str, total_steps: int) -> tuple[list[str], Path]:
    """``--set`` arguments of a quickstart run that will be interrupted and resumed: a
    checkpoint every 5 steps, no evaluation; and its run directory."""
    sets = ["--set", f"run.output_dir={output_dir}", "--set", f"run.name={name}",
            "--set", f"learner.total_steps={total_steps}", "--set", "eval.every_steps=0",
            "--set", "checkpoint.every_steps=5"]
    return sets, output_dir / name
