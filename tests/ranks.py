"""How tests start the processes that stand for learner ranks: forked from one server per
pytest process that has imported torch and transformers (multiprocessing's ``forkserver``), as
``asyncrl.launch.roles`` starts a role's children. Spawned, every rank imported them itself,
about 7 s of CPU each: more than most of these tests' own work on the 2-core CI machine.

The server starts at the first use in a pytest process and keeps the environment and the
stdout/stderr it had then (its children inherit those, not the test's): a test that changes
``os.environ`` for its ranks passes the values as arguments instead. ``tests/conftest.py``
names what the server imports (:func:`configure`), before anything starts it.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from asyncrl.launch.roles import ROLE_PRELOAD

START_METHOD = "forkserver"

PRELOAD = (*ROLE_PRELOAD, "torch.distributed.fsdp", "learners.dist")
"""What nearly every rank imports: the roles' own preload and the learner's process group. The
server imports it once (a module that fails to import is skipped)."""


def configure() -> None:
    """Name the server's imports; ``asyncrl.launch.roles._fork_server`` leaves them alone
    when its caller (a test running ``_run_children`` in-process) names none."""
    mp.set_forkserver_preload(list(PRELOAD))


def rank_context() -> Any:
    """The multiprocessing context for rank processes (queues and events included)."""
    return mp.get_context(START_METHOD)


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn``'s contract, forked: ``fn(rank, *args)`` on ``nprocs``
    processes, joined; a rank's exception is raised here."""
    import torch.multiprocessing as torch_mp

    torch_mp.start_processes(fn, args=args, nprocs=nprocs, start_method=START_METHOD)
