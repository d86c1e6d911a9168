"""The one restart policy of every supervisor: `asyncrl up` (local processes or Ray actors) and
a role's children (`asyncrl rollout`'s workers, `asyncrl learner`'s ranks).

Rollout workers may die and rejoin at any time (docs/fault-tolerance.md), so a crashed one is
restarted rather than ending the run; but a worker that crashes on start (a bad model path, an
engine that cannot load) would otherwise loop forever, so restarts are bounded: after
``launcher.max_restarts`` consecutive crashes the run stops with the reason. A process that ran
``launcher.healthy_after_s`` before crashing was healthy: its count starts again. Each restart
waits ``launcher.restart_backoff_s``, doubled at each consecutive crash.

A process that stops on a configuration error (exit status
:data:`~asyncrl.exits.CONFIG_ERROR_EXIT`, or a :class:`ConfigError` a Ray actor raised)
is never restarted: the same config fails the same way every time, and retrying only hides the
message.

:class:`Restarts` applies the policy to one supervised process and says, in one line, why and
when it restarts or why it will not. The supervisors keep only what differs: how they learn
that a process ended, how they start it again, and what they do when it may not restart.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import IO

from asyncrl.config.schema import LauncherConfig
from asyncrl.exits import CONFIG_ERROR_EXIT, exit_reason

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Refusal:
    """Why a crashed process is not restarted, in one line that names it; ``config_error``:
    it stopped on a configuration error (the run then exits with that status)."""

    text: str
    config_error: bool = False


class Restarts:
    """The restart schedule of one supervised process (a role, a worker, a rank).

    ``policy`` None: the process is never restarted (the learner: a crash of it ends the run).
    A supervisor calls :meth:`crashed` when the process ended in error, starts it again once
    :meth:`due`, and then calls :meth:`started`; while :attr:`waiting` the process is not
    running and there is nothing to stop."""

    def __init__(self, name: str, policy: RestartPolicy | None = None) -> None:
        self.name = name
        self.budget = RestartBudget(policy) if policy is not None else None
        self.started_at = time.monotonic()
        self.restart_at: float | None = None

    @property
    def waiting(self) -> bool:
        """A restart is scheduled: the process ended and its backoff is not over yet."""
        return self.restart_at is not None

    def due(self) -> bool:
        """The scheduled restart's backoff is over: start the process again now."""
        return self.restart_at is not None and time.monotonic() >= self.restart_at

    def started(self) -> None:
        """The process was (re)started now: the time it runs from, no restart pending."""
        self.started_at, self.restart_at = time.monotonic(), None

    def crashed(self, how: str, detail: str = "", config_error: bool = False) -> Refusal | None:
        """The process ended in error: ``how`` it ended (``exit code 1``, ``killed by
        SIGKILL``, ``failed``) and the error, if the supervisor knows it. Schedules the restart
        and logs why and when (returns None), or returns why it will not restart."""
        if config_error:
            return Refusal(f"{self.name} stopped on a configuration error (not restarted)"
                           + (f": {detail}" if detail else ""), config_error=True)
        ran = time.monotonic() - self.started_at
        what = f"{self.name} {how} after {ran:.1f}s" + (f" ({detail})" if detail else "")
        delay = self.budget.next_delay(ran) if self.budget is not None else None
        if delay is None:
            return Refusal(what if self.budget is None else f"{what}, out of restarts")
        logger.warning("%s: %s in %.1fs", what, self.budget.describe(), delay)
        self.restart_at = time.monotonic() + delay
        return None

    def crashed_with_exit(self, code: int, detail: str = "") -> Refusal | None:
        """:meth:`crashed` for a process that exited with status ``code`` (``-N``: signal N)."""
        return self.crashed(exit_reason(code), detail, config_error=code == CONFIG_ERROR_EXIT)


class RoleFailed(RuntimeError):
    """A role that may not be restarted (the learner), or is out of restarts, died;
    ``exit_code`` is what `up` exits with (2 when the role stopped on a config error)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def config_error(self) -> bool:
        return self.exit_code == CONFIG_ERROR_EXIT

    def report(self, out: IO[str]) -> int:
        """Say why the run stopped, in the log and on `up`'s console; returns `up`'s exit
        status."""
        logger.error("%s", self)
        out.write(f"run stopped: {self}\n")
        return self.exit_code

    @classmethod
    def refused(cls, refusal: Refusal, where: str = "") -> RoleFailed:
        """The run stops on ``refusal``; ``where``: where to look and how to go on."""
        return cls(refusal.text + (f" [{where}]" if where else ""),
                   CONFIG_ERROR_EXIT if refusal.config_error else 1)

