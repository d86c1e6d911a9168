"""Restart policy shared by every launcher: bounded retries with exponential backoff.

Rollout workers may die and rejoin at any time (DESIGN.md, fault model), so a crashed one is
restarted rather than ending the run; but a worker that crashes on start (a bad model path, an
engine that cannot load) would otherwise loop forever, so restarts are bounded: after
``launcher.max_restarts`` consecutive crashes the run stops with the reason. A process that ran
``launcher.healthy_after_s`` before crashing was healthy: its count starts again.

A process that stops on a configuration error exits :data:`CONFIG_ERROR_EXIT` and is never
restarted: the same config fails the same way every time, and retrying only hides the message.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import IO

from asyncrl.config.load import ConfigError
from asyncrl.config.schema import LauncherConfig

CONFIG_ERROR_EXIT = 2
"""Exit status of a process stopped by a :class:`ConfigError` (as argparse's usage errors):
every supervisor (`asyncrl up`, a role's children) takes it as "do not restart"."""
NO_ANSWER_EXIT = 3
"""Exit status of a process stopped by a :class:`TimeoutError`: something it needed (the
buffer, mostly) did not answer. Reported in one line, as the CLI and a role's children do:
the cause was logged where it happened, and a traceback per process (a learner's ranks all
stop together) only buried it."""
GROUP_LEFT_EXIT = 4
"""Exit status of a learner rank whose process group broke because another rank left it
(killed, crashed, its node gone): a consequence, not a cause. Reported in one line; a
supervisor that ran the rank that left names that one as the cause."""


class GroupLeft(RuntimeError):
    """A collective failed because another rank of the process group left it. What failed
    says nothing about this rank, so no traceback: its message names the rank and the
    transport's error."""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    backoff_s: float
    healthy_after_s: float

    @classmethod
    def from_config(cls, launcher: LauncherConfig) -> RestartPolicy:
        return cls(launcher.max_restarts, launcher.restart_backoff_s, launcher.healthy_after_s)


class RestartBudget:
    """The crash history of one supervised process (a worker index, the broker)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0  # consecutive: since the last healthy run

    def next_delay(self, ran_s: float) -> float | None:
        """After a crash of a process that ran ``ran_s``: seconds to wait before restarting
        it, or None when its restarts are used up."""
        if ran_s >= self.policy.healthy_after_s:
            self.restarts = 0
        if self.restarts >= self.policy.max_restarts:
            return None
        delay = self.policy.backoff_s * 2 ** self.restarts
        self.restarts += 1
        return delay

    def describe(self) -> str:
        return f"restart {self.restarts}/{self.policy.max_restarts}"


def exit_reason(code: int | None) -> str:
    """``-9`` → "killed by SIGKILL", ``1`` → "exit code 1" (as subprocess and mp report)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == GROUP_LEFT_EXIT:
        return "left: another rank of its process group left"
    return f"exit code {code}"


def report_config_error(exc: ConfigError, stream: IO[str] | None = None) -> int:
    """Write a config error as the one line users read (``asyncrl: workflow.env: ...``, no
    traceback: the message names the key) and return :data:`CONFIG_ERROR_EXIT`."""
    stream = stream or sys.stderr
    stream.write(f"asyncrl: {exc}\n")
    stream.flush()
    return CONFIG_ERROR_EXIT
