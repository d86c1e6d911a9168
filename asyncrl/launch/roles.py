"""Entry points of the roles (`asyncrl buffer|learner|rollout`), each a plain OS process.

A role process stops on SIGTERM or SIGINT: the first signal sets a stop event that every loop
checks (so the learner can still write its final model), a second one exits at once. A role's
children (learner ranks, rollout workers) are forked from a fork server that imported torch and
transformers once (:func:`_fork_server`): each spawned child used to import them itself, about
7 s of CPU per child and per restart. A child SIGTERMs itself when its role exits
(:func:`stop_with_role`), so a crashed or killed role never leaves orphans.

A learner or rollout role first waits for its ZMQ broker to accept connections
(:func:`wait_for_broker`), saying so while it waits: a ZMQ request to an address where nothing
listens is not refused, it waits out ``buffer.request_timeout_s`` and its retries in silence, and
a signal meanwhile is seen only after them. Their buffer clients are given the stop event too:
once it is set, a request gives up on a broker that does not answer (a broker gone for good)
within about a second instead of ``request_timeout_s`` and its re-sends, and the role exits with
its stopped status, 0 (:func:`exit_quietly_when_stopped`).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.engine_kinds import engine_kind
from asyncrl.exits import (CONFIG_ERROR_EXIT, GROUP_LEFT_EXIT, NO_ANSWER_EXIT, GroupLeft,
                                  exit_reason, report_config_error)
from asyncrl.launch.restart import Restarts, RestartPolicy
from asyncrl.launch.signals import stop_on_signals

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

BROKER_WAIT_LOG_S = 5.0
"""How often a role waiting for its broker says so (the first time at once)."""

BROKER_PROBE_S = 0.5
"""Pause between connection attempts to a broker that is not there (and the longest a signal
waits to be seen meanwhile)."""


def setup_logging(role: str) -> None:
    level = os.environ.get("ASYNCRL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr, force=True,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    quiet_deepspeed_on_cpu()


def quiet_deepspeed_on_cpu() -> None:
    """With a CPU build of torch, tell DeepSpeed its accelerator (``DS_ACCELERATOR=cpu``)
    unless the user did. Why: transformers imports accelerate, which imports DeepSpeed when
    it is installed (it is a dependency), and DeepSpeed's detection then printed ``[WARNING]
    Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it.`` into the output of every run on a CPU machine, the quickstart's included, although
    nothing is wrong. A CPU build can only run DeepSpeed on the CPU; CUDA builds are left to
    DeepSpeed's own detection. The environment is inherited by the role processes."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        cpu_build = version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return
    if cpu_build:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def die_with_parent() -> None:
    """Linux: deliver SIGTERM to this process when its parent exits (no orphans)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_with_role(role_pid: int) -> None:
    """SIGTERM this process when the role process ``role_pid`` exits, however it ends (a
    SIGKILL included), as :func:`die_with_parent` does for a direct child. A child forked by the
    fork server has the server as its parent, and the server outlives its role while children
    hold its pipe, so the kernel's parent-death signal cannot stand for the role. A thread waits
    on a pidfd of the role (an event, no polling); a role already gone stops the child at once.
    The fork server's own death still ends the child too (:func:`die_with_parent`), so the
    role, which reads its children's exit through the server, never loses sight of one that
    still runs."""
    die_with_parent()
    if not hasattr(os, "pidfd_open"):  # not Linux: no pidfd
        return
    try:
        pidfd = os.pidfd_open(role_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def wait() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="stop-with-role", daemon=True).start()


def serve_buffer(cfg: Config, address_file: Path | None) -> int:
    from buffers.malloc_tuning import keep_large_buffers
    from buffers.run_token import ensure_token
    from buffers.zmq_broker import ZmqBroker

    keep_large_buffers()  # the broker forwards every group: no mmap per message
    stop = stop_on_signals()
    broker = ZmqBroker(cfg.buffer, cfg.learner.groups_per_step, run_id=cfg.run.name,
                       run_dir=cfg.run_dir, token=ensure_token(cfg.run_dir))
    address = broker.bind()
    if address_file is not None:
        tmp = address_file.with_suffix(".tmp")
        tmp.write_text(address)
        tmp.rename(address_file)  # atomic: readers never see a partial address
    logger.info("buffer listening on %s", address)
    status_client, endpoint = _buffer_endpoint(cfg, address, stop)
    try:
        broker.serve(stop)
    finally:
        if endpoint is not None:
            endpoint.close()
            status_client.close()
        broker.close()
    return 0


def _buffer_endpoint(cfg: Config, address: str, stop: threading.Event):
    """/metrics of the broker, read through a client of its own at each scrape (the broker's
    state belongs to its serving thread; a scrape during the stop does not hold it up)."""
    from asyncrl.prometheus import StatusSource, endpoint_port, start_endpoint
    from buffers import connect_buffer

    if not endpoint_port(cfg.monitor, "buffer"):
        return None, None
    client = connect_buffer(cfg, address, stop)
    return client, start_endpoint(cfg.monitor, "buffer", "buffer", source=StatusSource(client))


def wait_for_broker(cfg: Config, address: str | None, stop: threading.Event) -> bool:
    """Wait until something accepts TCP connections at the broker's ``address``, logging
    where and what to check every :data:`BROKER_WAIT_LOG_S`; False when ``stop`` (a signal)
    ended the wait. After ``buffer.request_timeout_s + buffer.zmq.reconnect_s``, as long as the
    role's first request would have waited, it gives up (TimeoutError, exit status 3). Once
    connected, the clients' own retries cover a broker that restarts. Redis (no address):
    nothing to wait for here."""
    if address is None or _broker_listening(cfg, address):
        return True
    budget = cfg.buffer.request_timeout_s + cfg.buffer.zmq.reconnect_s
    hint = (f"Is `asyncrl buffer` running there? Check the address: --buffer, else "
            f"{cfg.run_dir / 'buffer.addr'} (written by `asyncrl up`), else "
            "buffer.zmq.host / buffer.zmq.port")
    start = next_log = time.monotonic()
    while True:
        waited = time.monotonic() - start
        if waited >= budget:
            raise TimeoutError(f"no buffer broker at {address} after {waited:.0f}s "
                               f"(buffer.request_timeout_s + buffer.zmq.reconnect_s): {hint}")
        if time.monotonic() >= next_log:
            logger.warning("waiting for the buffer at %s (%.0fs so far, giving up at %.0fs): "
                           "nothing accepts connections there. %s", address, waited, budget,
                           hint)
            next_log += BROKER_WAIT_LOG_S
        if stop.wait(BROKER_PROBE_S):
            logger.info("stopped while waiting for the buffer at %s", address)
            return False
        if _broker_listening(cfg, address):
            break
    logger.info("buffer at %s accepts connections after %.0fs", address,
                time.monotonic() - start)
    return True


def _broker_listening(cfg: Config, address: str) -> bool:
    from asyncrl.launch.preflight import NotRunning, check_broker

    try:
        check_broker(address, cfg.run.name, wait_s=BROKER_PROBE_S)
    except NotRunning:
        return False
    return True


def run_learner(cfg: Config, address: str | None) -> int:
    """This node's learner ranks (torchrun semantics): ``learner.ranks`` processes with global
    ranks ``node_rank × ranks + i`` in a world of ``nnodes × ranks``, all dialling
    ``learner.master_addr:master_port``. Global rank 0 (node 0) reads the buffer."""
    stop = stop_on_signals()
    if not wait_for_broker(cfg, address, stop):
        return 0
    from asyncrl.net import ReservedPort
    from learners.loop import run_learner_rank
    from rollouters.eval import EngineEvaluator

    rank_main = partial(run_learner_rank, evaluator=EngineEvaluator)  # rank 0's eval
    learner = cfg.learner
    world = learner.nnodes * learner.ranks
    first = learner.node_rank * learner.ranks
    # the port rank 0 binds, held from other processes until the ranks have exited
    with nullcontext(learner.master_port) if learner.master_port else ReservedPort() as port:
        if learner.nnodes > 1:
            logger.info("learner node %d/%d: global ranks %d..%d of %d, rendezvous %s:%d",
                        learner.node_rank, learner.nnodes, first, first + learner.ranks - 1,
                        world, learner.master_addr, port)
        if learner.ranks == 1:
            with exit_quietly_when_stopped("learner"):
                rank_main(cfg, first, world, address, port, stop)
            return 0
        return _run_children(rank_main, [(cfg, first + i, world, address, port)
                                         for i in range(learner.ranks)], "learner",
                             cfg.launcher.stop_grace_s("learner"), stop=stop,
                             preload=("learners.loop", *ROLE_PRELOAD))


def run_rollout(cfg: Config, address: str | None, workers: int, first_index: int = 0) -> int:
    """K workers, each in its own process (one engine each), restarted when one crashes
    (``launcher.max_restarts``, ``launcher.restart_backoff_s``). Ctrl-C stops them and leaves
    the run: the broker releases their grants; the run goes on with the other workers."""
    stop = stop_on_signals()
    if not wait_for_broker(cfg, address, stop):
        return 0
    from rollouters.worker import report_crashed, run_rollout_worker

    if engine_kind(cfg.rollout.engine).threads:  # workers as threads of a few processes
        from rollouters.worker import SIM_WORKERS_PER_PROCESS, run_worker_threads

        indices = list(range(first_index, first_index + workers))
        chunks = [indices[i:i + SIM_WORKERS_PER_PROCESS]
                  for i in range(0, workers, SIM_WORKERS_PER_PROCESS)]
        return _run_children(run_worker_threads, [(cfg, chunk, address) for chunk in chunks],
                             "rollout", cfg.launcher.stop_timeout_s, stop=stop,
                             preload=("rollouters.worker",))
    return _run_children(run_rollout_worker, [(cfg, first_index + i, address)
                                              for i in range(workers)], "rollout",
                         cfg.launcher.stop_timeout_s, RestartPolicy.from_config(cfg.launcher),
                         first_index, partial(report_crashed, cfg, address, stop=stop), stop,
                         ("rollouters.worker", "rollouters.engines", *ROLE_PRELOAD))


def _child_main(target: Callable[..., None], args: tuple, role: str, role_pid: int) -> None:
    from buffers.malloc_tuning import keep_large_buffers

    stop = stop_on_signals()  # before the watch on the role: its SIGTERM must find the handler
    stop_with_role(role_pid)
    setup_logging(role)
    keep_large_buffers()  # groups are packed and sent, or received, as large buffers
    try:
        with exit_quietly_when_stopped(role):
            target(*args, stop)
    except ConfigError as exc:  # the exit status tells the parent not to restart this child
        sys.exit(report_config_error(exc))
    except TimeoutError as exc:  # e.g. learners.lost.BufferLost, raised on every rank
        logger.error("%s stopped: %s", role, exc)
        sys.exit(NO_ANSWER_EXIT)
    except GroupLeft as exc:  # the rank that left is the cause (_run_children reports it)
        logger.error("%s stopped: %s", role, exc)
        sys.exit(GROUP_LEFT_EXIT)


@contextmanager
def exit_quietly_when_stopped(role: str) -> Iterator[None]:
    """A role stopped on a signal while its broker did not answer ends with
    :class:`~buffers.BufferStopped` (or a failure raised from it): that is the stop it was
    asked for, logged in one line, not a crash (a traceback, exit status 1 or 3)."""
    from buffers import stopped_by

    try:
        yield
    except Exception as exc:
        stopped = stopped_by(exc)
        if stopped is None:
            raise
        logger.info("%s stopped without waiting for the buffer: %s", role, stopped)


ROLE_PRELOAD = ("torch", "transformers.modeling_utils")
"""What every learner rank and (non-simulated) rollout worker imports and the fork server imports
for them: about 7 s of CPU (``python -X importtime``), against well under 1 s for the rest of
a child's imports."""


def _fork_server(preload: tuple[str, ...]) -> Any:
    """The multiprocessing context whose children fork from a server that has imported
    ``preload`` (modules that fail to import are skipped; none named: multiprocessing's own
    choice, or what the process named before). The server is started here, with
    SIGTERM ignored, which it keeps: a stop signals the role's whole process group, and a
    server that died of it would take with it the exit statuses of children still stopping
    (the learner saving its final model), which the role reads through it. Each child installs
    its own handlers first (:func:`_child_main`). The server is multiprocessing's one per
    process: the first call's ``preload`` holds for the process (a role calls this once);
    nothing else in a role starts processes through it. It ends once the role and the
    children it forked have exited."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    if preload:
        ctx.set_forkserver_preload(list(preload))
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return ctx


class _Child:
    """One forked child and when it restarts (when it may be restarted at all)."""

    def __init__(self, ctx: Any, target: Callable[..., None], args: tuple, name: str,
                 index: int, policy: RestartPolicy | None) -> None:
        self.ctx, self.target, self.args, self.name = ctx, target, args, name
        self.index = index
        self.proc: Any = None
        self.restarts = Restarts(name, policy)

    def start(self) -> None:
        self.proc = self.ctx.Process(target=_child_main, name=self.name,
                                     args=(self.target, self.args, self.name, os.getpid()))
        self.proc.start()
        self.restarts.started()

    def crashed(self) -> bool:
        return not self.restarts.waiting and self.proc.exitcode not in (None, 0)

    def schedule_restart(self) -> bool:
        """After a crash: the restart is scheduled (and logged), or, False, the line saying
        why it is not is logged (out of restarts, or a config error a restart would repeat)."""
        refusal = self.restarts.crashed_with_exit(self.proc.exitcode)
        if refusal is not None:
            logger.error("%s: stopping the others", refusal.text)
        return refusal is None


def _run_children(target: Callable[..., None], arg_list: list[tuple], role: str,
                  grace_s: float, policy: RestartPolicy | None = None,
                  first_index: int = 0,
                  on_crash: Callable[[int, int, str], None] | None = None,
                  stop: threading.Event | None = None,
                  preload: tuple[str, ...] = ()) -> int:
    """Run each args tuple in its own process, forked from a server that imported ``preload``
    (:func:`_fork_server`); restart a crashed one while ``policy``
    allows (never without one, never after a config error); stop all when one fails for good,
    or on a signal (``stop``: the role's :func:`stop_on_signals` event, if it has one).
    ``on_crash(index, pid, reason)`` runs on a thread of its own for each
    crash (it may talk to a broker that is down: the supervision never waits for it).
    Returns :data:`CONFIG_ERROR_EXIT` when a config error stopped them."""
    ctx = _fork_server(preload)
    stop = stop or stop_on_signals()
    children = [_Child(ctx, target, args, f"{role}[{first_index + i}]", first_index + i, policy)
                for i, args in enumerate(arg_list)]
    for child in children:
        child.start()
    failed = None
    while not stop.wait(0.2):
        # A rank that left because another left (GROUP_LEFT_EXIT) is looked at last: the one
        # that left first, dead by then, is the cause to report.
        for child in sorted(children, key=lambda c: c.proc.exitcode == GROUP_LEFT_EXIT):
            if child.restarts.due():
                child.start()
            elif child.crashed():
                if on_crash is not None:
                    threading.Thread(target=on_crash, daemon=True, name=f"{child.name}-crash",
                                     args=(child.index, child.proc.pid,
                                           exit_reason(child.proc.exitcode))).start()
                if not child.schedule_restart():
                    failed = child
                    break
        if failed is not None or all(c.proc.exitcode == 0 for c in children):
            break
    procs = [c.proc for c in children]
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
    if failed is not None and failed.proc.exitcode == CONFIG_ERROR_EXIT:
        return CONFIG_ERROR_EXIT  # and so this role is not restarted either
    return 0 if failed is None and all(p.exitcode in (0, -signal.SIGTERM) for p in procs) else 1
