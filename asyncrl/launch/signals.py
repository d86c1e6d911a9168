"""What SIGINT and SIGTERM do: the first one stops gracefully, a second one does not wait.

A role process (:func:`stop_on_signals`) sets a stop event that every loop checks, so the
learner can still write its final model; a second signal exits at once. A launcher
(:class:`LauncherSignals`, the local one and Ray's alike) stops its roles in order, giving each
its grace (the learner saves); a second signal kills what is still stopping.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals() -> threading.Event:
    """First SIGTERM/SIGINT: set the returned event. Second: exit immediately.

    The signals are counted, not read off the event: code also sets the event to stop (the
    learner, when its buffer is lost, before it saves its steps), and a single SIGTERM then
    (its role stopping the other ranks) must not count as the second and kill the save."""
    stop = threading.Event()
    signalled: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if signalled:
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        signalled.append(signum)
        logger.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    for signum in SIGNALS:
        signal.signal(signum, handler)
    return stop


class LauncherSignals:
    """A launcher's stop: ``stop`` set by the first SIGINT/SIGTERM, ``force`` by a second one
    (the roles still stopping are killed without waiting out their grace: the learner may be
    saving for ``launcher.learner_stop_timeout_s``)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.force = threading.Event()

    def install(self) -> None:
        for signum in SIGNALS:
            signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop.is_set() and not self.force.is_set():
            logger.warning("second %s: killing the roles still stopping",
                           signal.Signals(signum).name)
            self.force.set()
        self.stop.set()

    def overran(self, stopped: Callable[[], bool], grace_s: float, poll_s: float = 0.1) -> bool:
        """Wait until ``stopped()``, at most ``grace_s``; True when the grace ran out first
        (the caller says so, then kills). A second signal ends the wait at once: what is
        still stopping is killed as asked, not reported as late."""
        deadline = time.monotonic() + grace_s
        while not stopped() and not self.force.is_set():
            if time.monotonic() >= deadline:
                return True
            self.force.wait(poll_s)
        return False


def say_learner_stops(grace_s: float) -> None:
    """On the console, when a stop reaches a learner still running: what it does before it
    exits (with a real model's eval set, minutes), and how not to wait for it."""
    logger.info("stopping the learner: it saves its checkpoint and final model, then runs the "
                "final eval (up to %.0f s, launcher.learner_stop_timeout_s); interrupt again "
                "to kill it now (the run resumes from its last checkpoint)", grace_s)
