"""The code sandbox contains hostile programs: each scores 0, is counted with its reason and
logged with the sample id, and the scoring process (the rollout worker) carries on.

Real subprocesses, real namespaces and rlimits; where this machine cannot create a namespace
the matching containment test is skipped with the launcher's own report as the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from rollouters.rewards import RewardScorer
from rollouters.rewards.code import CodeReward, unenforced
from rollouters.rewards.sandbox import SandboxLimits, run_python
from rollouters.tasks.sample import Sample

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=256, max_processes=8)
PASSING = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(2, 3) == 5\n"


@pytest.fixture(scope="module")
def enforced() -> dict:
    return asyncio.run(run_python("pass", LIMITS)).enforced


def _score(response: str, sample_id: str, limits: SandboxLimits = LIMITS
           ) -> tuple[float, RewardScorer]:
    scorer = RewardScorer(CodeReward(limits), timeout_s=30.0, name="code")
    value = asyncio.run(scorer.score(response, Sample(sample_id, "q", TESTS)))
    return value, scorer


def _still_working() -> None:
    """The scoring process is alive and the sandbox still runs good programs."""
    assert _score(PASSING, "after")[0] == 1.0


def test_passing_and_failing_programs() -> None:
    assert _score(PASSING, "ok")[0] == 1.0
    value, scorer = _score("```python\ndef add(a, b):\n    return a - b\n```", "wrong")
    assert value == 0.0 and scorer.counts["failed"] == 0  # a failing test is not a violation


def _contained(program: str, reason: str, caplog: pytest.LogCaptureFixture,
               within_s: float = 10.0, limits: SandboxLimits = LIMITS) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rollouters.rewards.base"):
        value, scorer = _score(f"```python\n{program}\n```", f"hostile-{reason}", limits)
    assert value == 0.0
    assert scorer.counts[reason] == 1, scorer.counts
    assert f"sample hostile-{reason}" in caplog.text and reason in caplog.text
    assert time.monotonic() - start < within_s
    _still_working()


def test_infinite_loop_is_stopped_by_the_cpu_limit(caplog: pytest.LogCaptureFixture) -> None:
    # a wall limit far beyond the CPU limit: a loaded machine gives the loop less than a core
    _contained("while True:\n    pass", "cpu_limit", caplog, within_s=25.0,
               limits=SandboxLimits(wall_s=20.0, cpu_s=1, memory_mb=256, max_processes=8))


def test_sleeping_forever_is_stopped_by_the_wall_clock(caplog: pytest.LogCaptureFixture) -> None:
    _contained("import time\ntime.sleep(60)", "wall_timeout", caplog)


def test_fork_bomb_is_bounded_and_leaves_no_process(caplog: pytest.LogCaptureFixture,
                                                    enforced: dict) -> None:
    """Forks fail with EAGAIN past ``max_processes``, so the bomb ends in a fraction of a second
    (before, as root, nothing bounded it: a hundred processes until the 3 s wall clock, a load
    spike that slowed every test beside it in CI). Where the launcher reports no process
    limit, the wall clock stops it."""
    if not enforced.get("pidns"):
        pytest.skip(f"no PID namespace here: {enforced}")
    reason = "process_limit" if enforced.get("processes") else "wall_timeout"
    _contained("import os\nwhile True:\n    os.fork()", reason, caplog)
    # forked children keep the launcher's command line: none of them may survive the kill
    deadline = time.monotonic() + 5.0
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandbox_processes() == []


def test_as_root_a_pids_cgroup_bounds_processes_and_is_removed_after_the_run(
        enforced: dict) -> None:
    """The kernel exempts uid 0 from RLIMIT_NPROC; as root the launcher bounds the program's
    processes with a pids cgroup of its own, which holds ``max_processes`` of them and is
    removed once the run ends."""
    if enforced.get("processes") != "cgroup":
        pytest.skip(f"no pids cgroup here (not root, or a read-only cgroupfs): {enforced}")
    children = ("import subprocess, sys\n"
                "procs = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1)'])"
                " for _ in range({})]\n"
                "assert all(p.wait() == 0 for p in procs)\n")
    within = asyncio.run(run_python(children.format(LIMITS.max_processes - 1), LIMITS))
    assert within.passed, within.stderr
    beyond = asyncio.run(run_python(children.format(LIMITS.max_processes), LIMITS))
    assert not beyond.passed and "BlockingIOError" in beyond.stderr, beyond.stderr
    for result in (within, beyond):
        assert not Path(result.enforced["pids_cgroup"]).exists()


def test_what_the_sandbox_could_not_enforce_is_named() -> None:
    full = {"netns": True, "pidns": True, "fs_readonly": True, "caps_dropped": True,
            "processes": "cgroup"}
    assert unenforced(full) == []
    missing = unenforced({**full, "processes": False, "netns": False})
    assert len(missing) == 2 and "fork bomb" in missing[1] and "network" in missing[0]


def test_memory_hog_gets_memory_error(caplog: pytest.LogCaptureFixture) -> None:
    _contained("x = bytearray(4 << 30)", "memory_limit", caplog)


def test_network_connect_is_refused(caplog: pytest.LogCaptureFixture, enforced: dict) -> None:
    if not enforced.get("netns"):
        pytest.skip(f"no network namespace here: {enforced}")
    _contained("import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=2)",
               "network_blocked", caplog)


def test_write_outside_the_temp_dir_is_refused(caplog: pytest.LogCaptureFixture,
                                               enforced: dict, tmp_path: Path) -> None:
    if not enforced.get("fs_readonly"):
        pytest.skip(f"no read-only mount namespace here: {enforced}")
    target = tmp_path / "escaped.txt"
    _contained(f"open({str(target)!r}, 'w').write('x')", "write_blocked", caplog)
    assert not target.exists()
    for relative in ("../escaped.txt", "../../escaped.txt", "/tmp/asyncrl-escaped.txt"):
        result = asyncio.run(run_python(f"open({relative!r}, 'w').write('x')", LIMITS))
        assert not result.passed and "Read-only file system" in result.stderr
    assert not Path("/tmp/asyncrl-escaped.txt").exists()


def test_private_working_directory_is_writable_and_removed() -> None:
    result = asyncio.run(run_python(
        "import os, tempfile\nopen('a.txt', 'w').write('hi')\n"
        "print(os.getcwd(), tempfile.gettempdir() == os.getcwd(), open('a.txt').read())",
        LIMITS))
    assert result.passed, result.stderr
    cwd, same, text = result.stdout.split()
    assert same == "True" and text == "hi" and not Path(cwd).exists()


def _sandbox_processes() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and b"_launcher.py" in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found
