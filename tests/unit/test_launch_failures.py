"""How `asyncrl up` reports a role that stopped: the cause read from its log, and no restarts
of a role that stopped on a configuration error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch import LocalLauncher, Role, RoleFailed, _cause
from asyncrl.supervise import CONFIG_ERROR_EXIT, RestartBudget, RestartPolicy


@pytest.mark.parametrize(("tail", "cause"), [
    ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
     "[rank0]: OSError: Repo id must be in the form 'repo_name'\n",
     "OSError: Repo id must be in the form 'repo_name'"),
    ("Traceback (most recent call last):\nasyncrl.config.load.ConfigError: workflow.env: "
     "module 'm' has no attribute 'Env'\n", "workflow.env: module 'm' has no attribute 'Env'"),
    ("asyncrl: data.path: 'nope.jsonl' does not exist\n"
     "2026-01-01 00:00:00,000 rollout ERROR asyncrl.roles: rollout[0] stopped\n",
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
    launcher.roles.append(Role("rollout", proc, log, budget=RestartBudget(launcher.policy)))
    with pytest.raises(RoleFailed) as failed:
        launcher._tend()
    log.close()
    assert failed.value.exit_code == CONFIG_ERROR_EXIT
    assert str(failed.value).startswith("rollout stopped on a configuration error (not "
                                        "restarted): workflow.env: no such env [log ")
    assert launcher.roles[0].restart_at is None


def test_a_crash_is_still_restarted(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={str(tmp_path)!r}"])
    launcher = LocalLauncher(cfg)
    log = (tmp_path / "rollout.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    proc.wait()
    launcher.roles.append(Role("rollout", proc, log,
                               budget=RestartBudget(RestartPolicy(3, 60.0, 60.0))))
    launcher._tend()
    log.close()
    assert launcher.roles[0].restart_at is not None
