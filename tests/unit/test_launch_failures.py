"""How `asyncrl up` reports a role that stopped: the cause read from its log, and no restarts
of a role that stopped on a configuration error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.exits import CONFIG_ERROR_EXIT
from asyncrl.launch.local import LocalLauncher, Role, _cause
from asyncrl.launch.restart import Restarts, RestartPolicy, RoleFailed


@pytest.mark.parametrize(("tail", "cause"), [
    ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
     "[rank0]: OSError: Repo id must be in the form 'repo_name'\n",
     "OSError: Repo id must be in the form 'repo_name'"),
    ("Traceback (most recent call last):\nasyncrl.config.load.ConfigError: workflow.env: "
     "module 'm' has no attribute 'Env'\n", "workflow.env: module 'm' has no attribute 'Env'"),
    ("asyncrl: data.path: 'nope.jsonl' does not exist\n"
     "2026-01-01 00:00:00,000 rollout ERROR asyncrl.launch.roles: rollout[0] stopped\n",
     "data.path: 'nope.jsonl' does not exist"),
    ("ValueError: bad\n", "ValueError: bad"),
    ("2026-01-01 00:00:00,000 learner INFO x: fine\n", "no error in its log"),
])
def test_the_cause_is_read_from_the_log(tmp_path: Path, tail: str, cause: str) -> None:
    log = tmp_path / "role.log"
    log.write_text("2026-01-01 00:00:00,000 learner INFO x: starting\n" + tail)
    assert _cause(log) == cause


def test_a_role_stopped_by_a_config_error_is_not_restarted(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={str(tmp_path)!r}"])
    launcher = LocalLauncher(cfg)
    log = (tmp_path / "rollout.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write("
                             "'asyncrl: workflow.env: no such env\\n'); sys.exit(2)"],
                            stderr=log)
    proc.wait()
    launcher.roles.append(Role("rollout", proc, log,
                               restarts=Restarts("rollout", launcher.policy)))
    with pytest.raises(RoleFailed) as failed:
        launcher._tend()
    log.close()
    assert failed.value.exit_code == CONFIG_ERROR_EXIT
    assert str(failed.value).startswith("rollout stopped on a configuration error (not "
                                        "restarted): workflow.env: no such env [log ")
    assert not launcher.roles[0].restarts.waiting


def test_a_crash_is_still_restarted(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={str(tmp_path)!r}"])
    launcher = LocalLauncher(cfg)
    log = (tmp_path / "rollout.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    proc.wait()
    launcher.roles.append(Role("rollout", proc, log,
                               restarts=Restarts("rollout", RestartPolicy(3, 60.0, 60.0))))
    launcher._tend()
    log.close()
    assert launcher.roles[0].restarts.waiting


# A role that takes SAVE_S to stop after its SIGTERM (as a learner saving its checkpoint).
SAVING = ("import signal, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *_: (time.sleep({save_s}), sys.exit(0)))\n"
          "print('ready', flush=True)\n"
          "time.sleep(60)\n")


def _saving_role(tmp_path: Path, name: str, save_s: float) -> Role:
    log = (tmp_path / f"{name}.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-c", SAVING.format(save_s=save_s)],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline() == b"ready\n"   # its handler is in place
    return Role(name, proc, log)


@pytest.mark.timeout(60)
def test_the_learner_gets_its_own_grace_to_save_and_the_others_the_common_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The learner saves its checkpoint and export after a stop: `up` gave it
    ``launcher.stop_timeout_s`` (10 s) like any role, and on a loaded machine (or a real
    model) killed it mid-save; it gets ``launcher.learner_stop_timeout_s`` now, and the
    console says so, with how not to wait."""
    cfg = load_config(None, [f"run.output_dir={str(tmp_path)!r}", "launcher.stop_timeout_s=1",
                             "launcher.learner_stop_timeout_s=30"])
    launcher = LocalLauncher(cfg)
    learner, rollout = (_saving_role(tmp_path, name, 3.0) for name in ("learner", "rollout"))
    with caplog.at_level("INFO", logger="asyncrl.launch.signals"):
        launcher._stop_role(learner)
        launcher._stop_role(rollout)
    assert learner.proc.returncode == 0      # saved, and exited on its own
    assert rollout.proc.returncode == -9     # killed after stop_timeout_s
    said = [r.getMessage() for r in caplog.records if "stopping the learner" in r.getMessage()]
    assert len(said) == 1 and "up to 30 s, launcher.learner_stop_timeout_s" in said[0] \
        and "interrupt again" in said[0], said


@pytest.mark.timeout(60)
def test_a_second_signal_kills_what_is_still_stopping(tmp_path: Path) -> None:
    import signal
    import threading
    import time

    cfg = load_config(None, [f"run.output_dir={str(tmp_path)!r}",
                             "launcher.learner_stop_timeout_s=30"])
    launcher = LocalLauncher(cfg)
    learner = _saving_role(tmp_path, "learner", 20.0)
    launcher.signals.on_signal(signal.SIGINT, None)   # the stop
    threading.Timer(1.0, launcher.signals.on_signal, (signal.SIGINT, None)).start()   # impatient
    start = time.monotonic()
    launcher._stop_role(learner)
    assert learner.proc.returncode == -9 and time.monotonic() - start < 10


class _StoppingActors:
    """Just what :meth:`RayLauncher.shutdown` asks of Ray, for actors that take for ever to
    stop (a learner saving a large model): their calls never finish."""

    def __init__(self) -> None:
        self.killed: list[object] = []

    def wait(self, refs, num_returns, timeout):
        return [], list(refs)

    def kill(self, actor, no_restart):
        self.killed.append(actor)


@pytest.mark.timeout(60)
def test_a_second_signal_kills_the_ray_actors_still_stopping(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As with the local launcher: a second Ctrl-C to `up` with ``launcher.type = "ray"``
    kills the actors still stopping instead of waiting out ``learner_stop_timeout_s``, which
    the console named at the first."""
    import signal
    import threading
    import time
    from types import SimpleNamespace

    from asyncrl.launch.ray import RayLauncher, _Placed

    cfg = load_config(None, [f"run.output_dir={str(tmp_path)!r}", "launcher.type='ray'",
                             "launcher.learner_stop_timeout_s=30"])
    launcher, ray = RayLauncher(cfg), _StoppingActors()
    actor = SimpleNamespace(request_stop=SimpleNamespace(remote=lambda: None))
    launcher.learners = [_Placed("learner[0]", actor, object(), None, Restarts("learner[0]"))]
    launcher.signals.on_signal(signal.SIGINT, None)   # the stop
    threading.Timer(1.0, launcher.signals.on_signal, (signal.SIGINT, None)).start()   # impatient
    start = time.monotonic()
    with caplog.at_level("INFO", logger="asyncrl.launch.signals"):
        launcher.shutdown(ray)
    assert ray.killed == [actor] and time.monotonic() - start < 10
    assert any("stopping the learner" in r.getMessage() and "up to 30 s" in r.getMessage()
               for r in caplog.records)
