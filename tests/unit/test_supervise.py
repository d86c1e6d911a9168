"""Restart policy arithmetic, the lines saying why and when a process restarts or why it will
not, and a real spawned child that crashes being restarted."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.exits import CONFIG_ERROR_EXIT, exit_reason
from asyncrl.launch.restart import Refusal, RestartBudget, Restarts, RestartPolicy
from asyncrl.launch.roles import _run_children


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """_run_children installs SIGINT/SIGTERM handlers (it is a role's main loop): undo them."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_backoff_doubles_and_restarts_are_bounded():
    budget = RestartBudget(RestartPolicy(max_restarts=3, backoff_s=0.5, healthy_after_s=60))
    assert [budget.next_delay(1.0) for _ in range(4)] == [0.5, 1.0, 2.0, None]
    assert budget.describe() == "restart 3/3"


def test_a_healthy_run_forgives_earlier_crashes():
    budget = RestartBudget(RestartPolicy(max_restarts=2, backoff_s=1.0, healthy_after_s=10))
    assert budget.next_delay(1.0) == 1.0 and budget.next_delay(1.0) == 2.0
    assert budget.next_delay(30.0) == 1.0  # ran 30 s: a fresh count


def test_no_restarts_at_all():
    assert RestartBudget(RestartPolicy(0, 1.0, 60)).next_delay(100.0) is None


def test_exit_reasons_name_the_signal():
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(3) == "exit code 3"


def crash_until_third_start(marker: str, stop: threading.Event) -> None:
    """Child target: the first two starts crash, the third runs until the marker says stop."""
    starts = Path(marker)
    n = len(starts.read_text()) if starts.exists() else 0
    starts.write_text("x" * (n + 1))
    if n < 2:
        os._exit(7)
    while not stop.is_set() and not Path(marker + ".done").exists():
        time.sleep(0.05)


def test_run_children_restarts_a_crashed_child_with_backoff(tmp_path, caplog):
    marker = str(tmp_path / "starts")
    policy = RestartPolicy(max_restarts=2, backoff_s=0.1, healthy_after_s=60)
    caplog.set_level("WARNING")
    # _run_children installs signal handlers, which only the main thread may: a helper thread
    # ends the child once it has been started three times.
    watcher = threading.Thread(target=_finish_when_started, args=(marker, 3))
    watcher.start()
    code = _run_children(crash_until_third_start, [(marker,)], "worker", 5.0, policy)
    watcher.join()
    assert code == 0
    assert Path(marker).read_text() == "xxx"
    warnings = [r.getMessage() for r in caplog.records if "exit code 7" in r.getMessage()]
    assert len(warnings) == 2 and "restart 1/2 in 0.1s" in warnings[0], warnings
    assert "restart 2/2 in 0.2s" in warnings[1]


def test_run_children_gives_up_after_max_restarts(tmp_path, caplog):
    marker = str(tmp_path / "starts")
    policy = RestartPolicy(max_restarts=1, backoff_s=0.05, healthy_after_s=60)
    caplog.set_level("WARNING")
    assert _run_children(crash_until_third_start, [(marker,)], "worker", 5.0, policy) == 1
    assert Path(marker).read_text() == "xx"
    assert any("exit code 7" in r.getMessage() and "stopping the others" in r.getMessage()
               for r in caplog.records)


def _finish_when_started(marker: str, starts: int, words: bool = False) -> None:
    """Write ``marker.done`` (the child's cue to end) once the marker holds ``starts`` marks:
    characters, or with ``words`` whitespace-separated words (pids)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        path = Path(marker)
        text = path.read_text() if path.exists() else ""
        if len(text.split() if words else text) >= starts:
            break
        time.sleep(0.05)
    Path(marker + ".done").write_text("")


def config_error_on_start(marker: str, stop: threading.Event) -> None:
    """Child target: counts its starts, then stops on a config error."""
    from asyncrl.config import ConfigError

    starts = Path(marker)
    starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
    raise ConfigError("data.path: 'nope.jsonl' does not exist")


def test_a_config_error_is_not_restarted(tmp_path):
    """Run as a role runs, in a process of its own: its children, forked by the fork server,
    write where the role's stderr pointed when the server started (a log file for a real role),
    which in this pytest process would be an earlier test's capture."""
    marker = str(tmp_path / "starts")
    script = ("import logging, sys\n"
              "from asyncrl.launch.restart import RestartPolicy\n"
              "from asyncrl.launch.roles import _run_children\n"
              "from tests.unit.test_supervise import config_error_on_start\n"
              "logging.basicConfig(level='WARNING')\n"
              "policy = RestartPolicy(max_restarts=3, backoff_s=0.05, healthy_after_s=60)\n"
              f"sys.exit(_run_children(config_error_on_start, [({marker!r},)], 'worker', 5.0, "
              "policy))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == CONFIG_ERROR_EXIT, done.stderr
    assert Path(marker).read_text() == "x"  # one start, no restart
    assert "configuration error" in done.stderr
    assert "asyncrl: data.path: 'nope.jsonl' does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_worker_threads_raise_a_threads_config_error_as_it_is(monkeypatch):
    """The sim engine's workers run as threads of one process (``run_worker_threads``): a
    config error in one (a fleet whose model refuses the learner's weights) stops the others
    and is raised as it is, so the process exits 2 and is not restarted, as a worker process
    would; any other failure stays a RuntimeError naming the workers."""
    from asyncrl.config import ConfigError
    from rollouters import worker

    def fake_worker(cfg, index, address, stop):  # the threads' supervision is under test
        if index == 1:
            raise ConfigError("model: refused")
        assert stop.wait(30), "the failure stops the other threads"

    monkeypatch.setattr(worker, "run_rollout_worker", fake_worker)
    with pytest.raises(ConfigError, match="model: refused"):
        worker.run_worker_threads(None, [0, 1], None, threading.Event())

    def crashing_worker(cfg, index, address, stop):
        raise OSError("disk full")

    monkeypatch.setattr(worker, "run_rollout_worker", crashing_worker)
    with pytest.raises(RuntimeError, match=r"rollout workers \[0, 1\] failed"):
        worker.run_worker_threads(None, [0, 1], None, threading.Event())


def crash_once_then_wait(marker: str, stop: threading.Event) -> None:
    """Child target: notes its pid; the first start is SIGKILLed, the second waits."""
    pids = Path(marker)
    seen = pids.read_text().split() if pids.exists() else []
    pids.write_text(" ".join([*seen, str(os.getpid())]))
    if not seen:
        os.kill(os.getpid(), signal.SIGKILL)
    while not stop.is_set() and not Path(marker + ".done").exists():
        time.sleep(0.05)


def test_a_crash_is_reported_with_the_childs_index_and_pid(tmp_path):
    """The rollout role reports a dead worker by these (its control-plane name is
    ``rollout-<index>-<pid>``, see ``rollouters.worker.report_crashed``)."""
    marker = str(tmp_path / "pids")
    reported: list[tuple[int, int, str]] = []
    watcher = threading.Thread(target=_finish_when_started, args=(marker, 2, True))
    watcher.start()
    code = _run_children(crash_once_then_wait, [(marker,)], "worker", 5.0,
                         RestartPolicy(max_restarts=1, backoff_s=0.05, healthy_after_s=60),
                         first_index=4, on_crash=lambda *args: reported.append(args))
    watcher.join()
    assert code == 0
    first_pid = int(Path(marker).read_text().split()[0])
    assert reported == [(4, first_pid, "killed by SIGKILL")]



def test_a_restart_is_logged_with_why_and_when(caplog):
    restarts = Restarts("rollout[0]", RestartPolicy(max_restarts=2, backoff_s=60,
                                                    healthy_after_s=60))
    caplog.set_level("WARNING")
    assert restarts.crashed("exit code 1", "ValueError: bad") is None
    assert restarts.waiting and not restarts.due()  # 60 s of backoff
    assert re.fullmatch(r"rollout\[0\] exit code 1 after \d+\.\ds \(ValueError: bad\): "
                        r"restart 1/2 in 60\.0s", caplog.records[-1].getMessage())
    restarts.started()
    assert not restarts.waiting


def test_a_restart_is_due_once_its_backoff_is_over():
    restarts = Restarts("buffer", RestartPolicy(max_restarts=1, backoff_s=0.0,
                                                healthy_after_s=60))
    assert not restarts.due()  # nothing crashed
    assert restarts.crashed_with_exit(-signal.SIGKILL) is None and restarts.due()


def test_a_config_error_is_refused_whatever_the_budget():
    restarts = Restarts("rollout[1]", RestartPolicy(max_restarts=3, backoff_s=0.1,
                                                    healthy_after_s=60))
    refusal = restarts.crashed("failed", "data.path: no rows", config_error=True)
    assert refusal == Refusal("rollout[1] stopped on a configuration error (not restarted): "
                              "data.path: no rows", config_error=True)
    assert not restarts.waiting and restarts.budget.restarts == 0
    assert restarts.crashed_with_exit(CONFIG_ERROR_EXIT).config_error


def test_refusals_name_the_process_and_how_it_ended():
    learner = Restarts("learner")  # no policy: never restarted
    assert re.fullmatch(r"learner killed by SIGKILL after \d+\.\ds \(no error in its log\)",
                        learner.crashed_with_exit(-signal.SIGKILL, "no error in its log").text)
    spent = Restarts("worker[0]", RestartPolicy(max_restarts=0, backoff_s=0.1,
                                                healthy_after_s=60))
    refusal = spent.crashed_with_exit(7)
    assert refusal.text.endswith(", out of restarts") and "worker[0] exit code 7" in refusal.text
    assert not refusal.config_error and not spent.waiting


def note_pid_and_wait_for_stop(folder: str, stop: threading.Event) -> None:
    """Child target: writes its pid, waits for the stop (a signal), then says it stopped."""
    pid = os.getpid()
    (Path(folder) / f"{pid}.tmp").write_text("")
    (Path(folder) / f"{pid}.tmp").rename(Path(folder) / f"{pid}.started")
    stop.wait()
    (Path(folder) / f"{pid}.stopped").write_text("")


def test_children_stop_when_their_role_is_killed(tmp_path):
    """A role SIGKILLed (the OOM killer) leaves no orphans: its children, forked by the fork
    server and so not children of the role, still get the SIGTERM they got as the role's
    children (the stop a signal asks for: their loop ends, not a kill)."""
    script = ("import sys\n"
              "from asyncrl.launch.roles import _run_children\n"
              "from tests.unit.test_supervise import note_pid_and_wait_for_stop\n"
              f"_run_children(note_pid_and_wait_for_stop, [({str(tmp_path)!r},)] * 2, "
              "'worker', 5.0)\n")
    role = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.started"))) < 2:
            assert role.poll() is None and time.monotonic() < deadline, "children not started"
            time.sleep(0.05)
        children = [int(p.name.split(".")[0]) for p in tmp_path.glob("*.started")]
        watches = [os.pidfd_open(pid) for pid in children]
        role.kill()
        role.wait()
        for pidfd in watches:  # each child's exit, as an event
            ready, _, _ = select.select([pidfd], [], [], 30)
            assert ready, "a child outlived its killed role"
            os.close(pidfd)
        assert sorted(int(p.name.split(".")[0]) for p in tmp_path.glob("*.stopped")) == \
            sorted(children)
    finally:
        role.kill()
        role.wait()
