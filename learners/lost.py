"""A buffer lost while the learner trains: each rank notices it (:class:`Lost`), the ranks
agree on it and raise :class:`BufferLost` together, and every rank saves the steps it took
(:func:`save_before_exit`) before the role exits. Without it, a broker lost for good cost up
to ``checkpoint.every_steps`` steps of training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asyncrl.config import Config
from buffers import stopped_by, unanswered
from learners.lifecycle import counters

logger = logging.getLogger(__name__)


class BufferLost(TimeoutError):
    """The buffer stopped answering while the learner trained (a ZMQ broker or Redis gone
    for good, past ``buffer.request_timeout_s`` and the client's re-sends).

    Raised on every rank at the same point, after an agreement, so that all of them save the
    steps taken since the last checkpoint (a collective) before the role exits. On the rank
    whose request failed it is raised from that failure. A :class:`TimeoutError`, as the
    failure itself was: a one-rank learner still exits with status 3 (the buffer could not
    be reached; the supervisor of several ranks exits 1).

    ``stopping``: some rank was stopping when they agreed (a signal, or the eval target
    reached). Then the lost buffer only cut short a stop that was asked for: every rank saves
    its steps and ends as a stop does, quietly and with status 0, whichever rank's request
    failed: the agreement, not each rank's own failure, says so, or a rank that only heard of
    the loss from another would exit as if the buffer had been lost mid-run."""

    def __init__(self, message: str, stopping: bool = False) -> None:
        super().__init__(message)
        self.stopping = stopping


class Lost:
    """This rank's first buffer request that got no answer. Once there is one, the rank's
    later requests are skipped: each would wait out the whole request timeout again."""

    def __init__(self) -> None:
        self.cause: BaseException | None = None

    def call(self, request: Callable[..., Any], *args: Any, default: Any = None,
             **kwargs: Any) -> Any:
        """``request(*args, **kwargs)``, or ``default`` when the buffer is lost (already, or
        now: a failure that is not a lost buffer is raised as it is)."""
        if self.cause is not None:
            return default
        try:
            return request(*args, **kwargs)
        except Exception as exc:
            if unanswered(exc) is None:
                raise
            # a stop on a signal that gave up on a silent buffer is not an error
            (logger.info if stopped_by(exc) else logger.error)(
                "the buffer did not answer: %s", exc)
            self.cause = exc
            return default

    def error(self, stopping: bool) -> BufferLost:
        """What every rank raises once they agreed that one of them lost the buffer;
        ``stopping``: whether they also agreed to stop."""
        error = BufferLost(f"the buffer stopped answering: {self.cause}" if self.cause else
                           "another learner rank lost the buffer", stopping)
        error.__cause__ = self.cause
        return error


def save_before_exit(cfg: Config, trainer, checkpointer, resumed_at: int, stopping: bool,
                     reached: dict[str, Any] | None) -> None:
    """Every rank, the buffer lost: checkpoint the steps taken (COLLECTIVE), so that a learner
    restarted once the buffer is back resumes from the last one, not from the last periodic
    checkpoint. A step whose ack the buffer never got keeps its groups pending there: they
    are delivered and trained again (at-least-once), as after a learner crash. ``stopping``:
    the ranks were stopping anyway (:class:`BufferLost`), which is no error. When the stop
    was the eval target reached (``reached``, rank 0's), the checkpoint says so
    (:func:`~learners.lifecycle.counters`): the learner started again only finishes the
    run, as it would have without the loss."""
    log, lost = ((logger.info, "stopped while the buffer did not answer") if stopping
                 else (logger.error, "the buffer was lost"))
    if trainer.version == resumed_at:
        log("%s before a step was trained: nothing to save", lost)
        return
    checkpointer.save(trainer, {**counters(cfg, trainer.version, {}, reached),
                                "finished": False})
    log("%s: saved a checkpoint at version %d in %s; start the learner again once the buffer "
        "answers and it resumes there", lost, trainer.version, cfg.run_dir / cfg.checkpoint.dir)
