"""An inference server a rollout worker starts for itself and owns (vLLM's api_server, SGLang's
launcher): one subprocess with its output in a log file, ready once a health URL answers,
stopped with SIGTERM and then SIGKILL.

The vLLM fleet and the SGLang engine each kept a copy of this loop; one copy means one place
where a server that dies while loading says why (its last log lines in the error) and a server
that never gets ready fails after its timeout with the config key that sets it. The server
stays in the worker's process group, so whoever kills the worker's group kills it too.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollouters.engines.http import request_json

logger = logging.getLogger(__name__)

POLL_S = 0.5  # between health probes of a starting server (a subprocess, not a thread)
PROBE_S = 5.0  # one health probe's own timeout
TAIL_LINES = 20  # of the server's log, in the error when it exits before it is ready
TAIL_BYTES = 16384


class _NotReady(Exception):
    """A health probe that got no good answer (yet): the server may still be loading."""


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now, for a server to bind. Another process may
    take it first; the server then exits, which :meth:`ManagedServer.wait_ready` reports."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class ManagedServer:
    """One server subprocess and its URL. The constructor starts it; :meth:`wait_ready`
    returns once it answers (and stops it if it never does); :meth:`stop` ends it.

    ``name`` (e.g. "vLLM server") starts every message about it; ``stop_timeout_s`` is the
    grace between SIGTERM and SIGKILL (the launchers end their own children on SIGTERM)."""

    def __init__(self, name: str, argv: Sequence[str], url: str, log_path: Path, *,
                 env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 stop_timeout_s: float = 10.0) -> None:
        self.name = name
        self.url = url
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:  # a restarted worker appends to the same log
            self._log_start = log.tell()
            self._proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                          env=None if env is None else dict(env), cwd=cwd)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """None while it runs; negative: the signal that ended it."""
        return self._proc.poll()

    def wait_ready(self, timeout_s: float, timeout_key: str,
                   error: type[Exception] = RuntimeError,
                   timeout: type[Exception] = TimeoutError,
                   health_path: str = "/health") -> None:
        """Return once ``GET url + health_path`` answers. Raise ``error`` as soon as the
        process exits (with its last log lines), ``timeout`` after ``timeout_s`` (naming
        ``timeout_key``, the config key that sets it); the server is stopped either way."""
        try:
            self._poll_health(timeout_s, timeout_key, error, timeout, health_path)
        except BaseException:
            self.stop()
            raise
        logger.info("%s %s started (pid %d)", self.name, self.url, self._proc.pid)

    def _poll_health(self, timeout_s: float, timeout_key: str, error: type[Exception],
                     timeout: type[Exception], health_path: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise error(f"{self.name} exited with {self._proc.returncode} before it was "
                            f"ready; log: {self.log_path}; its last lines:\n{self.log_tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise timeout(f"{self.name} {self.url} not ready within {timeout_s:.0f}s "
                              f"({timeout_key}); log: {self.log_path}; its last lines:\n"
                              f"{self.log_tail()}")
            try:
                request_json("GET", self.url, health_path, None, min(PROBE_S, max(left, 0.1)),
                             _NotReady, _NotReady)
                return
            except _NotReady:
                time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines this run of the server wrote to its log."""
        try:
            with self.log_path.open("rb") as log:
                size = log.seek(0, 2)
                log.seek(max(self._log_start, size - TAIL_BYTES))
                text = log.read().decode(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(log empty)"

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout_s`` (default ``stop_timeout_s``);
        idempotent: a server that already ended is left alone."""
        grace = self.stop_timeout_s if timeout_s is None else timeout_s
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._proc.poll() is not None:
                return
            self._proc.send_signal(sig)
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s pid %d ignored %s", self.name, self._proc.pid, sig.name)
