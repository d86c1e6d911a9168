"""Entry points of the roles (`asyncrl buffer|learner|rollout`), each a plain OS process.

A role process stops on SIGTERM or SIGINT: the first signal sets a stop event that every loop
checks (so the learner can still write its final model), a second one exits at once. Children a
role spawns (learner ranks, rollout workers) ask the kernel to SIGTERM them if their parent dies,
so a crashed or killed role never leaves orphans.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config import Config

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def setup_logging(role: str) -> None:
    level = os.environ.get("ASYNCRL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr, force=True,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def die_with_parent() -> None:
    """Linux: deliver SIGTERM to this process when its parent exits (no orphans)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_on_signals() -> threading.Event:
    """First SIGTERM/SIGINT: set the returned event. Second: exit immediately."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        logger.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def serve_buffer(cfg: Config, address_file: Path | None) -> int:
    from buffers.zmq_broker import ZmqBroker

    stop = stop_on_signals()
    broker = ZmqBroker(cfg.buffer, cfg.learner.groups_per_step, run_id=cfg.run.name)
    address = broker.bind()
    if address_file is not None:
        tmp = address_file.with_suffix(".tmp")
        tmp.write_text(address)
        tmp.rename(address_file)  # atomic: readers never see a partial address
    logger.info("buffer listening on %s", address)
    try:
        broker.serve(stop)
    finally:
        broker.close()
    return 0


def run_learner(cfg: Config, address: str | None) -> int:
    from learners.dist import free_port
    from learners.loop import run_learner_rank

    port = cfg.learner.master_port or free_port()
    world = cfg.learner.ranks
    if world == 1:
        run_learner_rank(cfg, 0, 1, address, port, stop_on_signals())
        return 0
    return _run_children(run_learner_rank, [(cfg, rank, world, address, port)
                                            for rank in range(world)], "learner",
                         cfg.launcher.stop_timeout_s)


def run_rollout(cfg: Config, address: str | None, workers: int, first_index: int = 0) -> int:
    from rollouters.worker import run_rollout_worker

    if workers == 1:
        run_rollout_worker(cfg, first_index, address, stop_on_signals())
        return 0
    return _run_children(run_rollout_worker, [(cfg, first_index + i, address)
                                              for i in range(workers)], "rollout",
                         cfg.launcher.stop_timeout_s)


def _child_main(target: Callable[..., None], args: tuple, role: str) -> None:
    die_with_parent()
    setup_logging(role)
    target(*args, stop_on_signals())


def _run_children(target: Callable[..., None], arg_list: list[tuple], role: str,
                  grace_s: float) -> int:
    """Run each args tuple in its own spawned process; stop all when one fails or on signal."""
    ctx = mp.get_context("spawn")
    stop = stop_on_signals()
    procs = [ctx.Process(target=_child_main, args=(target, args, f"{role}[{i}]"),
                         name=f"{role}-{i}") for i, args in enumerate(arg_list)]
    for proc in procs:
        proc.start()
    failed = None
    while any(p.is_alive() for p in procs) and not stop.is_set():
        stop.wait(0.2)
        failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
        if failed is not None:
            logger.error("%s exited with %s: stopping the others", failed.name, failed.exitcode)
            break
    if failed is not None:
        for proc in procs:
            proc.terminate()
    for proc in procs:  # on a signal to the process group the children got it too
        proc.join(timeout=grace_s / 2)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=grace_s / 2)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return 0 if failed is None and all(p.exitcode in (0, -signal.SIGTERM) for p in procs) else 1

