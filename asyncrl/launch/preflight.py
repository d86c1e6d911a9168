"""Checks `asyncrl up` runs once, before any role starts: the cheap half of "fail at start".

Schema validation (:mod:`asyncrl.config`) sees values only; these checks look at the machine the
roles will run on: are the sink packages installed, do a local ``model.path`` and the data files
exist, is every data row one the workers can use, can the run directory be made, are the fixed
ports free, do the plugin import paths import, does the buffer's server that no role starts
answer (Redis at ``buffer.redis.url``: :meth:`buffers.backends.BufferBackend.preflight`).
`asyncrl up --dry-run` runs the same :func:`check_startup`. Without them each
mistake surfaced in a role process, which its supervisor restarted several times before the run
stopped. Every problem found is reported at once, as a :class:`ConfigError` naming its key (exit
status 2).

The roles keep their own checks (they may be started by hand, elsewhere); these only move the
common mistakes to the front. `status` and `monitor` check the same way that there is a run to
ask before they wait on it.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.config import Config, ConfigError, ModelConfig

BROKER_PROBE_S = 2.0
"""How long `status` and `monitor` wait for a TCP connection to the broker before asking it."""

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
"""What Hugging Face accepts as a repo id: ``name`` or ``org/name``."""


class NotRunning(RuntimeError):
    """Nothing listens at a run's broker address: the run has finished or stopped."""


def check_startup(cfg: Config) -> None:
    """Everything `asyncrl up` checks before it starts a process, and all that `asyncrl up
    --dry-run` checks: raise one :class:`ConfigError` listing every sink package, path, data
    row, port, import or Redis URL that would stop a role of this run at start."""
    from buffers.backends import buffer_backend  # lazily: buffers imports numpy

    errors = [*sink_errors(cfg), *path_errors(cfg), *port_errors(cfg), *plugin_errors(cfg),
              *data_errors(cfg), *transport_errors(cfg)]
    if errors:
        raise ConfigError("\n".join(errors))
    buffer_backend(cfg.buffer).preflight()  # Redis, which no role starts, must answer


def transport_errors(cfg: Config) -> list[str]:
    """A weight transport that needs CUDA on a machine without it (``weights.transport``)."""
    from asyncrl.weights.transport import missing_cuda

    error = missing_cuda(cfg.weights.transport)
    return [error] if error else []


def sink_errors(cfg: Config) -> list[str]:
    """A metric sink whose package is missing (``monitor.sinks``)."""
    from asyncrl.sinks import check_sinks

    try:
        check_sinks(cfg.monitor)
    except ConfigError as exc:
        return [str(exc)]
    return []


def path_errors(cfg: Config) -> list[str]:
    """A missing ``model.path`` that is a local path, missing data files, a run directory that
    cannot be made, CURVE keys or a ``checkpoint.path`` that are not there."""
    from buffers.backends import buffer_backend

    errors = [err for err in (model_path_error(cfg.model), run_dir_error(cfg)) if err]
    if cfg.workflow.type != "digits":  # the digit tasks generate their data
        for key, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
            if path and not Path(path).expanduser().exists():
                errors.append(f"{key}: {path!r} does not exist")
    zmq = cfg.buffer.zmq
    if buffer_backend(cfg.buffer).broker and zmq.auth == "curve" and \
            not Path(zmq.curve_keys_dir).expanduser().is_dir():
        errors.append(f"buffer.zmq.curve_keys_dir: {zmq.curve_keys_dir!r} is not a directory "
                      "(buffer.zmq.auth = 'curve' reads its key pairs there)")
    if cfg.checkpoint.path and not Path(cfg.checkpoint.path).is_dir():
        errors.append(f"checkpoint.path (--resume): {cfg.checkpoint.path!r} is not a directory")
    return errors


def run_dir_error(cfg: Config) -> str | None:
    """``run.output_dir``/``run.name`` must be a directory `up` can make and write in."""
    run_dir = cfg.run_dir
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        return (f"run.output_dir: {str(existing)!r} is a file, not a directory: the run "
                f"directory {str(run_dir)!r} cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"run.output_dir: {str(existing)!r} is not writable: {str(run_dir)!r} needs it"
    return None


def port_errors(cfg: Config) -> list[str]:
    """A fixed port this run binds on this machine that something else already holds: the
    broker's, learner rank 0's rendezvous, the Prometheus endpoints. Ports of other machines
    (an address not of this one) are left to the roles there."""
    from buffers.backends import buffer_backend

    wanted: list[tuple[str, str, int]] = []
    if buffer_backend(cfg.buffer).broker and cfg.buffer.zmq.port:
        wanted.append(("buffer.zmq.port", cfg.buffer.zmq.host, cfg.buffer.zmq.port))
    if cfg.learner.master_port and cfg.learner.node_rank == 0:
        wanted.append(("learner.master_port", cfg.learner.master_addr, cfg.learner.master_port))
    if cfg.monitor.prometheus_port:
        last = cfg.monitor.prometheus_port + 1 + cfg.rollout.workers
        wanted += [("monitor.prometheus_port", cfg.monitor.prometheus_host, port)
                   for port in range(cfg.monitor.prometheus_port, last + 1)]
    return [f"{key}: {host}:{port} is already in use on this machine (another run, or another "
            f"program): stop it or pick another port" for key, host, port in wanted
            if port_in_use(host, port)]


def port_in_use(host: str, port: int) -> bool:
    """Something on this machine listens on ``host:port``. False where it cannot be told: an
    address of another machine, a name that does not resolve."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            None if host in ("*", "0.0.0.0") else host, port, type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError):
        return False
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the roles bind
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def data_errors(cfg: Config) -> list[str]:
    """Every row of the data files read and checked as the rollout workers will read them
    (:func:`rollouters.tasks.data.check_data_file`: streamed, once), and enough rows for every
    worker; the digit tasks: their held-out eval set fits the prompt space."""
    if cfg.workflow.type == "digits":
        return _task_errors(cfg)
    from rollouters.tasks.data import check_data_file  # lazily: rollouters imports numpy

    errors = []
    if not cfg.data.path and not cfg.workflow.env:
        errors.append(f"data.path: needed by workflow.type = {cfg.workflow.type!r} unless "
                      "workflow.env generates its own samples")
    for key, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if not path or not Path(path).expanduser().exists():
            continue  # missing: path_errors names it
        try:
            rows = check_data_file(path, cfg.data.format, cfg.data.split, cfg.data, key)
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        workers = cfg.rollout.workers
        if key == "data.path" and rows < workers:
            errors.append(f"data.path: {path!r} holds {rows} row(s) for rollout.workers = "
                          f"{workers}: worker i reads the rows j with j % {workers} == i, and "
                          f"worker {rows} would get none")
    return errors


def _task_errors(cfg: Config) -> list[str]:
    from rollouters.tasks.digits import make_task

    try:
        make_task(cfg.task, cfg.run.seed, cfg.model.tiny)
    except ConfigError as exc:
        return [str(exc)]
    return []


def model_path_error(model: ModelConfig) -> str | None:
    """``model.path`` is a local directory or a hub id; one that can only be local (absolute,
    ``./``, ``../``, ``~``, or more than one ``/``) and is missing gets a clear message here
    instead of Hugging Face's "Repo id must be in the form ..."."""
    path = model.path
    if not path or Path(path).expanduser().exists():
        return None
    local = path.startswith(("/", "~", "./", "../")) or path in (".", "..") \
        or not _HUB_ID.fullmatch(path)
    if not local:
        return None  # a hub id: downloaded (or found in the cache) by the roles
    return (f"model.path: {path!r} does not exist (a local path; a Hugging Face hub id is "
            "'name' or 'org/name')")


def plugin_errors(cfg: Config) -> list[str]:
    """Import every plugin the config names, as the roles will: ``workflow.path``,
    ``workflow.env`` and a ``reward.path`` of user code (custom, verl)."""
    if cfg.workflow.type == "digits":
        return []
    from asyncrl.plugins import load_callable

    checks: list[Callable[[], object]] = []
    if cfg.workflow.type == "custom":
        checks.append(lambda: load_callable(cfg.workflow.path, "workflow.path"))
    if cfg.workflow.env:
        from rollouters.workflows.factory import env_class  # built-in names, then import paths

        checks.append(lambda: env_class(cfg))
    from rollouters.rewards import user_path  # the reward types that run user code by path

    if user_path(cfg.reward):
        checks.append(lambda: load_callable(user_path(cfg.reward), "reward.path"))
    errors = []
    with _importable_from_cwd():
        for check in checks:
            try:
                check()
            except ConfigError as exc:
                errors.append(str(exc))
    return errors


def import_from_cwd() -> str | None:
    """Let user code (``reward.path``, ``workflow.env``...) be imported from the current
    directory, as the ``python -m asyncrl.cli`` roles that ``up`` starts can. The ``asyncrl``
    console script does not have it on ``sys.path``: ``asyncrl eval`` and roles started by
    hand (``asyncrl rollout``) failed with ``No module named 'examples'`` from the
    repository root, where the README runs them. Returns the path it added, if any."""
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        return None
    sys.path.insert(0, cwd)
    return cwd


@contextmanager
def _importable_from_cwd() -> Iterator[None]:
    """Roles run as ``python -m asyncrl.cli`` from this directory, so they import user code
    from it; the ``asyncrl`` console script does not have it on ``sys.path``. Put it there for
    the check, and take it off again."""
    added = import_from_cwd()
    try:
        yield
    finally:
        if added is not None:
            sys.path.remove(added)


def check_broker(address: str, run_name: str, wait_s: float = BROKER_PROBE_S) -> None:
    """Raise :class:`NotRunning` when nothing accepts a TCP connection at the broker's
    ``tcp://host:port``. A finished run leaves its ``buffer.addr`` behind, and a ZMQ request to
    a closed port is not refused: it waits out ``buffer.request_timeout_s`` and its retries."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s):
            return
    except ValueError:
        return  # not tcp://host:port: left to the client to report
    except OSError as exc:
        raise NotRunning(f"run {run_name!r} is not running: no buffer broker at {address} "
                         f"({exc.strerror or exc}); start it with `asyncrl up`, or give "
                         "--buffer ADDRESS") from None
