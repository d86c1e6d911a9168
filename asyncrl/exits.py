"""The exit statuses a role process ends with, and how a supervisor reads them.

Every supervisor (`asyncrl up`, a role's children) reads a process's exit status the same way:
:data:`CONFIG_ERROR_EXIT` is "do not restart" (:mod:`asyncrl.launch.restart`), the others say
in one line what a traceback per process only buried.
"""

from __future__ import annotations

import signal
import sys
from typing import IO

from asyncrl.config.load import ConfigError

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
