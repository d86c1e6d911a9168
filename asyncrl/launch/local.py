"""`asyncrl up`: start buffer, learner and rollout fleet as supervised local OS processes.

Each role runs in its own session (process group) so the terminal's Ctrl-C reaches only this
supervisor, which then stops the roles in order: SIGTERM to every group, a grace period
(``launcher.stop_timeout_s``; the learner, which saves its checkpoint, gets
``launcher.learner_stop_timeout_s``), SIGKILL to whatever is left; a second Ctrl-C kills what
is still stopping at once. Roles also die with the supervisor
(PR_SET_PDEATHSIG), so even ``kill -9`` of ``asyncrl up`` leaves no orphans behind.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from asyncrl.config import Config
from asyncrl.launch.preflight import check_startup
from asyncrl.launch.restart import Restarts, RestartPolicy, RoleFailed
from asyncrl.launch.run_dir import (is_resuming, print_final, reopen_run, run_dir_note,
                                    status_client, write_run_dir)
from asyncrl.launch.signals import LauncherSignals, say_learner_stops
from asyncrl.monitor import make_view
from buffers.backends import buffer_backend
from buffers.run_token import TOKEN_ENV, ensure_token

logger = logging.getLogger(__name__)

ADDRESS_WAIT_S = 60.0


@dataclass
class Role:
    """A role's process, its log, the arguments it is restarted with and when it restarts."""

    name: str
    proc: subprocess.Popen
    log: IO[bytes]
    args: tuple[str, ...] = ()
    restarts: Restarts | None = None  # None: never restarted (a crash of it ends the run)

    def __post_init__(self) -> None:
        self.restarts = self.restarts or Restarts(self.name)


class StoppedEarly(Exception):
    """A signal before the roles were all started: the launcher stops them, nothing failed."""


class LocalLauncher:
    def __init__(self, cfg: Config, out: IO[str] = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.roles: list[Role] = []
        self.signals = LauncherSignals()
        self.stop = self.signals.stop
        self.resuming = False
        self.policy = RestartPolicy.from_config(cfg.launcher)
        self.address: str | None = None

    def up(self) -> int:
        """Run to completion (or until a signal); returns the learner's exit code, or 1 when
        a role failed for good (the cause in one line, the run directory resumable), 2 when it
        stopped on a config error. Raises :class:`ConfigError` before starting anything for
        the paths, imports and Redis URL that :func:`check_startup` can check from here."""
        check_startup(self.cfg)
        self.resuming = is_resuming(self.cfg)
        config_path = write_run_dir(self.cfg, self.resuming)
        (self.cfg.run_dir / "logs").mkdir(exist_ok=True)
        address_file = self.cfg.run_dir / "buffer.addr"
        address_file.unlink(missing_ok=True)
        self.signals.install()
        show_final = True  # not for a run a config error stopped: it never trained
        try:
            self.address = self._start_buffer(config_path, address_file)
            if self.resuming:
                reopen_run(self.cfg, self.address)
            at = ["--buffer", self.address] if self.address else []
            learner = self._start("learner", config_path, *at)
            self._start("rollout", config_path, *at, "--workers", str(self.cfg.rollout.workers),
                        restartable=True)
            self._supervise(learner)
            return learner.proc.returncode if learner.proc.returncode is not None else 130
        except StoppedEarly as exc:  # Ctrl-C while the broker started: was a traceback
            self.out.write(f"{exc}\n")
            show_final = False
            return 130
        except RoleFailed as exc:
            show_final = not exc.config_error
            return exc.report(self.out)
        finally:
            self.shutdown()
            if show_final:
                self._print_final()

    def _start_buffer(self, config_path: Path, address_file: Path) -> str | None:
        """Start the run on the buffer (Redis: a new run clears what an earlier run of its
        name left there), then its broker process if it has one (ZMQ), and learn its address;
        None without one (Redis: the server is the broker)."""
        backend = buffer_backend(self.cfg.buffer)
        backend.start_run(self.cfg.run.name, self.resuming)
        if not backend.broker:
            return None
        buffer = self._start("buffer", config_path, "--address-file", str(address_file),
                             restartable=True)
        address = self._wait_for_address(address_file)
        # A restarted broker must come back where the clients dial (port 0 picked a free one).
        buffer.args += ("--set", f"buffer.zmq.port={address.rsplit(':', 1)[1]}")
        if not self.cfg.buffer.zmq.spill_path:
            logger.info("buffer.zmq.spill_path is empty: a broker restart would lose the groups "
                        "it holds (the default, 'auto', keeps them in the run directory)")
        return address

    def _start(self, role: str, config_path: Path, *args: str,
               restartable: bool = False) -> Role:
        log = (self.cfg.run_dir / "logs" / f"{role}.log").open("ab")
        restarts = Restarts(role, self.policy if restartable else None)
        self.roles.append(Role(role, self._spawn(role, log, (str(config_path), *args)), log,
                               (str(config_path), *args), restarts))
        return self.roles[-1]

    def _spawn(self, role: str, log: IO[bytes], args: tuple[str, ...]) -> subprocess.Popen:
        """Start a role with the run's token in its environment (:mod:`buffers.run_token`)."""
        cmd = [sys.executable, "-m", "asyncrl.cli", role, *args]
        env = {**os.environ, TOKEN_ENV: ensure_token(self.cfg.run_dir)}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent, env=env)
        logger.info("started %s (pid %d), log %s", role, proc.pid, log.name)
        return proc

    def _wait_for_address(self, address_file: Path) -> str:
        deadline = time.monotonic() + ADDRESS_WAIT_S
        while not address_file.exists():
            self._tend()
            if self.stop.wait(0.05):
                raise StoppedEarly("stopped before the buffer started: no run was started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"buffer did not announce its address in {address_file}")
        return address_file.read_text().strip()

    def _supervise(self, learner: Role) -> None:
        client = status_client(self.cfg, self.address)
        view = make_view(self.cfg.monitor, self.out, self.cfg.run_dir, lines=True)
        try:
            while learner.proc.poll() is None and not self.stop.is_set():
                self._tend()
                try:
                    view.show(client.status())
                except TimeoutError as exc:
                    logger.warning("status: %s", exc)
                self._tend()
                self.stop.wait(self.cfg.launcher.refresh_s)
        finally:
            view.close()
            client.close()
        if learner.proc.returncode not in (None, 0):
            self._crashed(learner)

    def _tend(self) -> None:
        """Restart the roles whose backoff is over; schedule restarts of crashed ones; raise
        :class:`RoleFailed` for a role that may not (or no longer) be restarted."""
        for role in self.roles:
            if role.restarts.waiting:
                if role.restarts.due() and not self.stop.is_set():
                    role.proc = self._spawn(role.name, role.log, role.args)
                    role.restarts.started()
            elif role.proc.poll() not in (None, 0) or (
                    role.proc.returncode == 0 and role.name == "buffer"):  # a broker must run
                self._crashed(role)

    def _crashed(self, role: Role) -> None:
        """Schedule the restart of a role that ended, or raise :class:`RoleFailed`: the cause
        read from its log, then where to look and how to go on."""
        refusal = role.restarts.crashed_with_exit(role.proc.returncode,
                                                  _cause(Path(role.log.name)))
        if refusal is not None:
            resume = "" if refusal.config_error else f"; {run_dir_note(self.cfg)}"
            raise RoleFailed.refused(refusal, f"log {role.log.name}{resume}")

    def shutdown(self) -> None:
        """Stop in dependency order: the learner first (it finishes its step, writes the final
        model and marks the run done while engines and buffer still answer), then the rollout
        fleet, then the buffer. Stopping the buffer together with its clients would leave them
        waiting on requests that can no longer be answered."""
        for name in ("learner", "rollout", "buffer"):
            for role in (r for r in self.roles if r.name == name):
                self._stop_role(role)

    def _stop_role(self, role: Role) -> None:
        """SIGTERM the role's process group, wait for it (the learner longer: it saves), then
        SIGKILL what is left. A learner still running is told what it does meanwhile, which
        with a real model's eval set takes minutes, and how not to wait for it."""
        grace_s = self.cfg.launcher.stop_grace_s(role.name)
        if role.name == "learner" and role.proc.poll() is None:
            say_learner_stops(grace_s)
        _signal_group(role.proc, signal.SIGTERM)
        if self.signals.overran(lambda: role.proc.poll() is not None, grace_s):
            logger.warning("%s did not stop in time: killing it", role.name)
        _signal_group(role.proc, signal.SIGKILL)  # also reaps children it left behind
        role.proc.wait()
        role.log.close()

    def _print_final(self) -> None:
        print_final(self.cfg, self.out)

    def plan(self) -> list[str]:
        """The commands `up` would run, one line each (``asyncrl up --dry-run``)."""
        config, at = self.cfg.run_dir / "config.toml", " --buffer ADDRESS"
        lines = []
        if buffer_backend(self.cfg.buffer).broker:
            lines.append(f"asyncrl buffer {config} --address-file {self.cfg.run_dir}/buffer.addr")
        else:
            at = ""
        lines.append(f"asyncrl learner {config}{at}")
        lines.append(f"asyncrl rollout {config}{at} --workers {self.cfg.rollout.workers}")
        return lines


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        return


def _die_with_parent() -> None:
    from asyncrl.launch.roles import die_with_parent

    die_with_parent()


def _cause(log: Path) -> str:
    """The last error line of a role's log: an exception (``ValueError: ...``, also behind
    torch.distributed's ``[rank0]: ``), or the ``asyncrl: ...`` line of a config error, shown
    as its message alone (it names the key). A process killed by a signal usually has none."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines[-200:]):
        match = _ERROR_LINE.match(line)
        if match:
            return (match["config"] or match["error"])[:300]
    return "no error in its log"


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:asyncrl: |(?:[\w.]*\.)?ConfigError: )"
                         r"(?P<config>.+)|^(?:\[rank\d+\]:\s*)?"
                         r"(?P<error>[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b.*)")
