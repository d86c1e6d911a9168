"""Run untrusted Python (model-written code) in a contained subprocess.

What is enforced is measured, not assumed: the launcher (:mod:`._launcher`) reports which
isolation measures took effect, and :class:`SandboxResult.enforced` carries that report. On a
Linux machine where the worker runs as root, or where unprivileged user namespaces are allowed,
all of these hold:

==================  =====================================================================
wall time           the parent kills the whole process group (SIGKILL) after ``wall_s``
CPU time            ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL one second later)
memory              ``RLIMIT_AS`` on every process (allocations fail with MemoryError)
processes           ``RLIMIT_NPROC`` (fork bombs get EAGAIN), as root a pids cgroup of its own
                    instead (the kernel exempts uid 0 from ``RLIMIT_NPROC``), and a PID
                    namespace whose PID 1 is the program: when it dies, every descendant dies
network             a new network namespace with no interface up (not even loopback)
filesystem          a mount namespace with every mount read-only except the private
                    working directory (the cwd, also ``TMPDIR``); capabilities dropped so
                    root inside cannot remount; ``RLIMIT_FSIZE`` bounds file sizes
==================  =====================================================================

Where a namespace cannot be created, the report says so (``netns: false`` ...) and only the
rlimits, the process-group kill and a Python-level socket guard remain; as root where no pids
cgroup can be made (a read-only cgroupfs, as in most containers), ``processes: false``: nothing
but the wall clock bounds a fork bomb. The working directory is
deleted afterwards. Nothing here uses seccomp.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_LAUNCHER = Path(__file__).with_name("_launcher.py")
_OUTPUT_LIMIT = 64 << 10


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits; defaults suit short test programs."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 16
    max_processes: int = 16


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    enforced: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def signal(self) -> int | None:
        """The signal that ended the program (the launcher exits 128 + signal)."""
        return self.returncode - 128 if self.returncode > 128 else None


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh private directory under the sandbox."""
    base = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))  # 0700: '..' leads nowhere
    workdir = base / "work"
    workdir.mkdir()
    (workdir / "main.py").write_text(code)
    report_r, report_w = os.pipe()
    start = time.monotonic()
    enforced: dict = {}
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(_LAUNCHER), str(workdir), json.dumps(limits.__dict__),
            str(report_w), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, pass_fds=(report_w,), start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"})
        os.close(report_w)
        report_w = -1
        timed_out = False
        reads = asyncio.gather(_read_capped(proc.stdout), _read_capped(proc.stderr), proc.wait())
        try:
            stdout, stderr, _ = await asyncio.wait_for(asyncio.shield(reads), limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
            _kill_group(proc.pid)
            stdout, stderr, _ = await reads
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            raise
        enforced = _read_report(report_r)
        return SandboxResult(returncode=proc.returncode, stdout=stdout, stderr=stderr,
                             timed_out=timed_out, duration_s=time.monotonic() - start,
                             enforced=enforced)
    finally:
        if report_w >= 0:
            os.close(report_w)
        cgroup = (enforced or _read_report(report_r)).get("pids_cgroup")
        os.close(report_r)
        shutil.rmtree(base, ignore_errors=True)
        if cgroup:
            await _remove_cgroup(cgroup)


async def _remove_cgroup(path: str, within_s: float = 5.0) -> None:
    """Remove the run's pids cgroup once its last process is gone: the launcher's exit does not
    wait for the processes its PID namespace still holds (a wall-clock kill), and a cgroup with
    a process in it cannot be removed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                logger.warning("sandbox: could not remove the pids cgroup %s: %s", path, exc)
                return
        await asyncio.sleep(0.02)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _read_capped(stream: asyncio.StreamReader | None) -> str:
    """Read to EOF keeping the first 64 KiB: a program printing forever cannot grow our memory."""
    kept = bytearray()
    while stream is not None:
        chunk = await stream.read(1 << 16)
        if not chunk:
            break
        if len(kept) < _OUTPUT_LIMIT:
            kept += chunk[:_OUTPUT_LIMIT - len(kept)]
    return kept.decode("utf-8", "replace")


def _read_report(fd: int) -> dict:
    os.set_blocking(fd, False)
    try:
        raw = os.read(fd, 1 << 16)
    except BlockingIOError:
        return {}
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}
