"""`asyncrl up`: start buffer, learner and rollout fleet as supervised local OS processes.

Each role runs in its own session (process group) so the terminal's Ctrl-C reaches only this
supervisor, which then stops the roles in order: SIGTERM to every group, a grace period
(``launcher.stop_timeout_s``), SIGKILL to whatever is left. Roles also die with the supervisor
(PR_SET_PDEATHSIG), so even ``kill -9`` of ``asyncrl up`` leaves no orphans behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from asyncrl.config import Config
from asyncrl.config.load import to_toml
from asyncrl.monitor import progress_line

logger = logging.getLogger(__name__)

ADDRESS_WAIT_S = 60.0


@dataclass
class Role:
    name: str
    proc: subprocess.Popen
    log: IO[bytes]


def is_resuming(cfg: Config) -> bool:
    """`up` continues a run when the learner will resume one: ``--resume PATH``, or an
    unfinished checkpoint in the run directory with ``checkpoint.resume`` on (a finished run's
    checkpoints are archived and a new run starts)."""
    from learners.checkpoint import read_meta, resume_point

    path = resume_point(cfg.checkpoint, cfg.run_dir)
    if path is None:
        return False
    meta = read_meta(path)
    finished = meta.counters.get("finished", False) or meta.version >= cfg.learner.total_steps
    return bool(cfg.checkpoint.path) or not finished


def write_run_dir(cfg: Config, resuming: bool = False) -> Path:
    """Create ``runs/<name>/`` with the resolved config that every role is started from.

    A new run keeps an earlier run's metrics and checkpoints, renamed, never appended to or
    resumed from. A resumed run appends to its metrics."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    for name in () if resuming else ("metrics.jsonl", "eval.json", cfg.checkpoint.dir):
        old = cfg.run_dir / name
        if old.exists():
            kept = old.with_name(f"{old.stem}.{int(old.stat().st_mtime)}{old.suffix}")
            old.rename(kept)
            logger.info("kept the previous run's %s as %s", name, kept.name)
    path = cfg.run_dir / "config.toml"
    path.write_text(to_toml(cfg))
    return path


class LocalLauncher:
    def __init__(self, cfg: Config, out: IO[str] = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.roles: list[Role] = []
        self.stop = threading.Event()
        self.resuming = False

    def up(self) -> int:
        """Run to completion (or until a signal); returns the learner's exit code."""
        self.resuming = is_resuming(self.cfg)
        config_path = write_run_dir(self.cfg, self.resuming)
        (self.cfg.run_dir / "logs").mkdir(exist_ok=True)
        address_file = self.cfg.run_dir / "buffer.addr"
        address_file.unlink(missing_ok=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self.stop.set())
        try:
            address = self._start_buffer(config_path, address_file)
            self._prepare_model()
            at = ["--buffer", address] if address else []
            learner = self._start("learner", config_path, *at)
            self._start("rollout", config_path, *at, "--workers", str(self.cfg.rollout.workers))
            self._supervise(learner, address)
            return learner.proc.returncode if learner.proc.returncode is not None else 130
        finally:
            self.shutdown()
            self._print_final()

    def _start_buffer(self, config_path: Path, address_file: Path) -> str | None:
        """ZMQ: start the broker and learn its address. Redis: the server is the broker; clear
        what an earlier run of the same name left there, since `up` starts a new run."""
        if self.cfg.buffer.type == "redis":
            from buffers.redis_buffer import reset_run

            if self.resuming:
                logger.info("redis %s: resuming run %r, its state is kept", self.cfg.buffer.url,
                            self.cfg.run.name)
                return None
            deleted = reset_run(self.cfg.buffer, self.cfg.run.name)
            logger.info("redis %s: fresh run %r (%d old keys removed)", self.cfg.buffer.url,
                        self.cfg.run.name, deleted)
            return None
        self._start("buffer", config_path, "--address-file", str(address_file))
        return self._wait_for_address(address_file)

    def _start(self, role: str, config_path: Path, *args: str) -> Role:
        log = (self.cfg.run_dir / "logs" / f"{role}.log").open("ab")
        cmd = [sys.executable, "-m", "asyncrl.cli", role, str(config_path), *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
        logger.info("started %s (pid %d), log %s", role, proc.pid, log.name)
        self.roles.append(Role(role, proc, log))
        return self.roles[-1]

    def _wait_for_address(self, address_file: Path) -> str:
        deadline = time.monotonic() + ADDRESS_WAIT_S
        while not address_file.exists():
            self._check_alive()
            if time.monotonic() > deadline or self.stop.wait(0.05):
                raise RuntimeError(f"buffer did not announce its address in {address_file}")
        return address_file.read_text().strip()

    def _prepare_model(self) -> None:
        """Build the init model once here, so the roles don't all build it at the same time."""
        from asyncrl.models import prepare_model_dir

        prepare_model_dir(self.cfg.model, self.cfg.run_dir, self.cfg.run.seed)

    def _supervise(self, learner: Role, address: str | None) -> None:
        from buffers import connect_buffer

        client = connect_buffer(self.cfg, address)
        try:
            while learner.proc.poll() is None and not self.stop.is_set():
                self._check_alive()
                try:
                    self.out.write(progress_line(client.status()) + "\n")
                    self.out.flush()
                except TimeoutError as exc:
                    logger.warning("status: %s", exc)
                self.stop.wait(self.cfg.launcher.refresh_s)
        finally:
            client.close()

    def _check_alive(self) -> None:
        for role in self.roles:
            code = role.proc.poll()
            if code not in (None, 0) or (code == 0 and role.name == "buffer"):
                raise RuntimeError(f"{role.name} exited with code {code}; see {role.log.name}:\n"
                                   + _tail(Path(role.log.name)))

    def shutdown(self) -> None:
        """Stop in dependency order: the learner first (it finishes its step, writes the final
        model and marks the run done while engines and buffer still answer), then the rollout
        fleet, then the buffer. Stopping the buffer together with its clients would leave them
        waiting on requests that can no longer be answered."""
        for name in ("learner", "rollout", "buffer"):
            for role in (r for r in self.roles if r.name == name):
                self._stop_role(role)

    def _stop_role(self, role: Role) -> None:
        """SIGTERM the role's process group, wait for it, then SIGKILL what is left."""
        _signal_group(role.proc, signal.SIGTERM)
        try:
            role.proc.wait(timeout=self.cfg.launcher.stop_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time: killing it", role.name)
        _signal_group(role.proc, signal.SIGKILL)  # also reaps children it left behind
        role.proc.wait()
        role.log.close()

    def _print_final(self) -> None:
        path = self.cfg.run_dir / "eval.json"
        if path.exists():
            final = json.loads(path.read_text())
            self.out.write(f"final held-out greedy eval ({final['eval/n']} prompts): "
                           f"accuracy {final['eval/accuracy']:.3f}, position accuracy "
                           f"{final['eval/position_accuracy']:.3f}\nrun directory: "
                           f"{self.cfg.run_dir}\n")
            self.out.flush()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        return


def _die_with_parent() -> None:
    from asyncrl.roles import die_with_parent

    die_with_parent()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
