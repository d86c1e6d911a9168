"""`asyncrl up`: start buffer, learner and rollout fleet as supervised local OS processes.

Each role runs in its own session (process group) so the terminal's Ctrl-C reaches only this
supervisor, which then stops the roles in order: SIGTERM to every group, a grace period
(``launcher.stop_timeout_s``; the learner, which saves its checkpoint, gets
``launcher.learner_stop_timeout_s``), SIGKILL to whatever is left; a second Ctrl-C kills what
is still stopping at once. Roles also die with the supervisor
(PR_SET_PDEATHSIG), so even ``kill -9`` of ``asyncrl up`` leaves no orphans behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from asyncrl.config import Config
from asyncrl.config.load import to_toml
from asyncrl.config.schema import DATA_POSITION_DIR, SPILL_NAME
from asyncrl.metrics import val_score_key
from asyncrl.models import INIT_MODEL_DIRNAME
from asyncrl.monitor import make_view
from asyncrl.preflight import check_startup
from asyncrl.supervise import CONFIG_ERROR_EXIT, RestartBudget, RestartPolicy, exit_reason

logger = logging.getLogger(__name__)

ADDRESS_WAIT_S = 60.0


@dataclass
class Role:
    name: str
    proc: subprocess.Popen
    log: IO[bytes]
    args: tuple[str, ...] = ()
    started: float = 0.0
    budget: RestartBudget | None = None  # None: a crash of this role ends the run
    restart_at: float | None = None


class RoleFailed(RuntimeError):
    """A role that may not be restarted (the learner), or is out of restarts, died;
    ``exit_code`` is what `up` exits with (2 when the role stopped on a config error)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    @classmethod
    def config_error(cls, role: str, cause: str) -> RoleFailed:
        """``role`` stopped on a configuration error: the same for both launchers."""
        return cls(f"{role} stopped on a configuration error (not restarted): {cause}",
                   CONFIG_ERROR_EXIT)


def is_resuming(cfg: Config) -> bool:
    """`up` continues a run when the learner will resume one: ``--resume PATH``, or an
    unfinished checkpoint in the run directory with ``checkpoint.resume`` on (a finished run's
    checkpoints are archived and a new run starts).

    Finished means marked so by the learner's end of the run (export, final eval, the run
    marked done), not a checkpoint at ``learner.total_steps``: a learner that died or lost
    its buffer after the last step's checkpoint never exported or evaluated. Resumed, it
    trains no step and does that end; a new run would have archived the steps instead."""
    from learners.checkpoint import read_meta, resume_point

    path = resume_point(cfg.checkpoint, cfg.run_dir)
    if path is None:
        return False
    return bool(cfg.checkpoint.path) or not read_meta(path).counters.get("finished", False)


def run_dir_note(cfg: Config) -> str:
    """Where a stopped run is, and whether `asyncrl up` would resume it (for failure lines)."""
    resumable = " (resumable: run `asyncrl up` again)" if is_resuming(cfg) else ""
    return f"run directory {cfg.run_dir}{resumable}"


def write_run_dir(cfg: Config, resuming: bool = False) -> Path:
    """Create ``runs/<name>/`` with the resolved config that every role is started from.

    A new run keeps an earlier run's metrics, checkpoints, buffer spill file, data positions
    and initial model, renamed, never appended to, resumed from, replayed or reused (its
    groups are the earlier policy's). A resumed run appends to its metrics, its broker
    replays the spill file, and its rollout workers go on from their data positions.

    The data positions and the initial model were not archived: a new run of the same name
    read on from where the last one stopped (a third run of a one-epoch dataset found it
    exhausted and waited for ever), and trained the last run's initial model whatever
    ``model.tiny`` or ``run.seed`` now said."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    archived = ("metrics.jsonl", "eval.json", cfg.checkpoint.dir, SPILL_NAME,
                DATA_POSITION_DIR, INIT_MODEL_DIRNAME)
    for name in () if resuming else archived:
        old = cfg.run_dir / name
        if old.exists():
            kept = old.with_name(f"{old.stem}.{int(old.stat().st_mtime)}{old.suffix}")
            old.rename(kept)
            logger.info("kept the previous run's %s as %s", name, kept.name)
    path = cfg.run_dir / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path


class StoppedEarly(Exception):
    """A signal before the roles were all started: the launcher stops them, nothing failed."""


class LocalLauncher:
    def __init__(self, cfg: Config, out: IO[str] = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.roles: list[Role] = []
        self.stop = threading.Event()
        self.force = threading.Event()  # a second signal: stop without waiting for the roles
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
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        show_final = True  # not for a run a config error stopped: it never trained
        try:
            self.address = self._start_buffer(config_path, address_file)
            if self.resuming:
                reopen_run(self.cfg, self.address)
            self._prepare_model()
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
            logger.error("%s", exc)
            self.out.write(f"run stopped: {exc}\n")
            show_final = exc.exit_code != CONFIG_ERROR_EXIT
            return exc.exit_code
        finally:
            self.shutdown()
            if show_final:
                self._print_final()

    def _start_buffer(self, config_path: Path, address_file: Path) -> str | None:
        """ZMQ: start the broker and learn its address. Redis: the server is the broker; clear
        what an earlier run of the same name left there, since `up` starts a new run."""
        if self.cfg.buffer.type == "redis":
            from buffers.redis_buffer import reset_run

            if self.resuming:
                logger.info("redis %s: resuming run %r, its state is kept",
                            self.cfg.buffer.redis.url, self.cfg.run.name)
                return None
            deleted = reset_run(self.cfg.buffer, self.cfg.run.name)
            logger.info("redis %s: fresh run %r (%d old keys removed)", self.cfg.buffer.redis.url,
                        self.cfg.run.name, deleted)
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
        budget = RestartBudget(self.policy) if restartable else None
        self.roles.append(Role(role, self._spawn(role, log, (str(config_path), *args)), log,
                               (str(config_path), *args), time.monotonic(), budget))
        return self.roles[-1]

    def _spawn(self, role: str, log: IO[bytes], args: tuple[str, ...]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "asyncrl.cli", role, *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
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

    def _prepare_model(self) -> None:
        """Build the init model once here, so the roles don't all build it at the same time."""
        from asyncrl.models import prepare_model_dir

        prepare_model_dir(self.cfg.model, self.cfg.run_dir, self.cfg.run.seed)

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
            raise self._failure(learner)

    def _tend(self) -> None:
        """Restart the roles whose backoff is over; schedule restarts of crashed ones; raise
        :class:`RoleFailed` for a role that may not (or no longer) be restarted."""
        for role in self.roles:
            code = role.proc.poll()
            if role.restart_at is not None:
                if time.monotonic() >= role.restart_at and not self.stop.is_set():
                    role.proc = self._spawn(role.name, role.log, role.args)
                    role.started, role.restart_at = time.monotonic(), None
            elif code == CONFIG_ERROR_EXIT:
                raise self._failure(role)
            elif code not in (None, 0) or (code == 0 and role.name == "buffer"):
                self._schedule_restart(role)

    def _schedule_restart(self, role: Role) -> None:
        ran = time.monotonic() - role.started
        delay = role.budget.next_delay(ran) if role.budget is not None else None
        if delay is None:
            raise self._failure(role)
        logger.warning("%s %s after %.1fs (%s): %s in %.1fs", role.name,
                       exit_reason(role.proc.returncode), ran, _cause(Path(role.log.name)),
                       role.budget.describe(), delay)
        role.restart_at = time.monotonic() + delay

    def _failure(self, role: Role) -> RoleFailed:
        """The cause in one line, then where to look and how to go on."""
        cause = _cause(Path(role.log.name))
        if role.proc.returncode == CONFIG_ERROR_EXIT:
            return RoleFailed.config_error(role.name, f"{cause} [log {role.log.name}]")
        return RoleFailed(f"{role.name} {exit_reason(role.proc.returncode)}: {cause} "
                          f"[log {role.log.name}; {run_dir_note(self.cfg)}]")

    def shutdown(self) -> None:
        """Stop in dependency order: the learner first (it finishes its step, writes the final
        model and marks the run done while engines and buffer still answer), then the rollout
        fleet, then the buffer. Stopping the buffer together with its clients would leave them
        waiting on requests that can no longer be answered."""
        for name in ("learner", "rollout", "buffer"):
            for role in (r for r in self.roles if r.name == name):
                self._stop_role(role)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """The first SIGINT/SIGTERM stops the run; a second one stops it now: the roles still
        stopping are killed (the learner may be saving for ``learner_stop_timeout_s``)."""
        if self.stop.is_set() and not self.force.is_set():
            logger.warning("second %s: killing the roles still stopping",
                           signal.Signals(signum).name)
            self.force.set()
        self.stop.set()

    def _stop_role(self, role: Role) -> None:
        """SIGTERM the role's process group, wait for it (the learner longer: it saves), then
        SIGKILL what is left."""
        _signal_group(role.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.launcher.stop_grace_s(role.name)
        while role.proc.poll() is None and not self.force.is_set():
            if time.monotonic() >= deadline:
                logger.warning("%s did not stop in time: killing it", role.name)
                break
            self.force.wait(0.1)
        _signal_group(role.proc, signal.SIGKILL)  # also reaps children it left behind
        role.proc.wait()
        role.log.close()

    def _print_final(self) -> None:
        print_final(self.cfg, self.out)

    def plan(self) -> list[str]:
        """The commands `up` would run, one line each (``asyncrl up --dry-run``)."""
        config, at = self.cfg.run_dir / "config.toml", " --buffer ADDRESS"
        lines = []
        if self.cfg.buffer.type == "zmq":
            lines.append(f"asyncrl buffer {config} --address-file {self.cfg.run_dir}/buffer.addr")
        else:
            at = ""
        lines.append(f"asyncrl learner {config}{at}")
        lines.append(f"asyncrl rollout {config}{at} --workers {self.cfg.rollout.workers}")
        return lines


def status_client(cfg: Config, address: str | None):
    """The launcher's own buffer client for the progress view. The view must never hold up
    restarts or shutdown: a short timeout and no reconnect retries."""
    from buffers import make_buffer_client

    config = cfg.buffer.with_fields("zmq", reconnect_s=0.0).with_fields(
        request_timeout_s=min(5.0, cfg.buffer.request_timeout_s))
    return make_buffer_client(config, address, run_id=cfg.run.name,
                              groups_per_step=cfg.learner.groups_per_step)


def reopen_run(cfg: Config, address: str | None) -> bool:
    """A resumed run trains again: if its buffer says the run is done, say it is running,
    before any rollout worker asks (a worker that finds the run done exits, and is not
    restarted). The buffer keeps the status across the stop: a ZMQ broker replays it from
    its spill file, Redis keeps it. It reads done after ``--resume`` of a finished run, and
    after any stop of a run by versions before the learner stopped marking stopped runs
    done; without this the resumed learner trained the batches it held, then waited for
    data forever. Returns whether it reopened the run."""
    from buffers.protocol import DONE, RUN_STATUS_KEY, RUNNING

    client = status_client(cfg, address)
    try:
        if client.status().get("run_status") != DONE:
            return False
        client.set_key(RUN_STATUS_KEY, {"status": RUNNING})
    finally:
        client.close()
    logger.info("resuming run %r, which its buffer had marked done: running again",
                cfg.run.name)
    return True


def make_launcher(cfg: Config, out: IO[str] = sys.stdout) -> LocalLauncher:
    """The launcher ``launcher.type`` names (both have ``up()`` and ``plan()``)."""
    if cfg.launcher.type == "ray":
        from asyncrl.ray_launch import RayLauncher

        return RayLauncher(cfg, out)  # type: ignore[return-value]
    return LocalLauncher(cfg, out)


def print_final(cfg: Config, out: IO[str]) -> None:
    """The final held-out eval the learner wrote, if it got that far."""
    path = cfg.run_dir / "eval.json"
    if path.exists():
        final = json.loads(path.read_text())
        task = cfg.task.name
        if f"val/position_score/{task}" in final:  # the digit tasks
            summary = (f"({final[f'val/num_prompts/{task}']} prompts): accuracy "
                       f"{final[val_score_key(task)]:.3f}, position accuracy "
                       f"{final[f'val/position_score/{task}']:.3f}")
        else:  # a workflow's validation: its val/* metrics
            summary = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in final.items() if k.startswith("val/"))
        out.write(f"final held-out greedy eval {summary}\nrun directory: {cfg.run_dir}\n")
        out.flush()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        return


def _die_with_parent() -> None:
    from asyncrl.roles import die_with_parent

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
