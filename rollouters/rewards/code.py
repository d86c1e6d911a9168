"""Code-execution reward: run the model's program against the sample's tests in the sandbox."""

from __future__ import annotations

import logging
import re

from rollouters.rewards.base import RewardError
from rollouters.rewards.sandbox import SandboxLimits, SandboxResult, run_python
from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
# stderr markers of a program stopped by the sandbox rather than by a failing test
_CONTAINED = (("MemoryError", "memory_limit"), ("BlockingIOError", "process_limit"),
              ("Network is unreachable", "network_blocked"),
              ("PermissionError: network", "network_blocked"),
              ("Read-only file system", "write_blocked"))


# what the sandbox's launcher reports it enforced (SandboxResult.enforced), as a user reads it
_MEASURES = (("netns", "no network namespace (a Python-level socket guard only)"),
             ("pidns", "no PID namespace (descendants may outlive the program)"),
             ("fs_readonly", "no read-only filesystem (the program can write outside its "
                             "directory)"),
             ("caps_dropped", "capabilities not dropped"),
             ("processes", "no process limit (root without a pids cgroup: only the wall "
                           "clock stops a fork bomb)"))


def unenforced(enforced: dict) -> list[str]:
    """What the sandbox could not enforce on this machine, from its launcher's report."""
    return [text for key, text in _MEASURES if not enforced.get(key)]


def extract_code(response: str) -> str:
    """The last fenced code block, else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


class CodeReward:
    """1.0 if ``code + tests`` exits 0 in the sandbox, 0.0 if a test fails.

    Tests come from ``sample.fields[tests_field]`` (Python source, e.g. asserts), else from
    ``sample.answer``. A program the sandbox had to stop (wall or CPU time, memory, process
    count, network, a write outside its directory) raises :class:`RewardError` with that reason,
    so the scorer counts and logs it with the sample id; it still scores 0.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), tests_field: str = "tests"
                 ) -> None:
        self.limits, self.tests_field = limits, tests_field
        self._reported = False

    async def __call__(self, response: str, sample: Sample) -> float:
        tests = sample.fields.get(self.tests_field, sample.answer)
        if not tests:
            raise ValueError(f"sample {sample.sample_id} has no tests "
                             f"(field {self.tests_field!r} or the answer)")
        result = await run_python(f"{extract_code(response)}\n\n{tests}\n", self.limits)
        if not self._reported and result.enforced:  # once: the machine does not change
            self._reported = True
            missing = unenforced(result.enforced)
            if missing:
                logger.warning("the code sandbox runs model-written programs here with %s",
                               "; ".join(missing))
        if result.passed:
            return 1.0
        reason = contained_reason(result)
        if reason is not None:
            raise RewardError(reason, f"exit {result.returncode}: {result.stderr[-300:]}")
        return 0.0


def contained_reason(result: SandboxResult) -> str | None:
    """Why the sandbox stopped a program, or None if it just failed (e.g. an assertion)."""
    if result.timed_out:
        return "wall_timeout"
    if result.signal is not None:
        # SIGKILL not sent by our wall clock: RLIMIT_CPU's hard limit (the program is PID 1
        # of its namespace, which ignores the soft limit's SIGXCPU)
        return "cpu_limit" if result.signal in (9, 24) else f"signal_{result.signal}"
    for marker, reason in _CONTAINED:
        if marker in result.stderr:
            return reason
    return None
