"""Checks `asyncrl up` runs once, before any role starts: the cheap half of "fail at start".

Schema validation (:mod:`asyncrl.config`) sees values only; these checks look at the machine the
roles will run on: do the data files and a local ``model.path`` exist, do the plugin import
paths import, does the buffer's server that no role starts answer (Redis at
``buffer.redis.url``: :meth:`buffers.backends.BufferBackend.preflight`). Without them each
mistake surfaced in a role process, which its supervisor restarted several times before the run
stopped. Every problem found is reported at once, as a :class:`ConfigError` naming its key (exit
status 2).

The roles keep their own checks (they may be started by hand, elsewhere); these only move the
common mistakes to the front. `status` and `monitor` check the same way that there is a run to
ask before they wait on it.
"""

from __future__ import annotations

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
    """Raise one :class:`ConfigError` listing every path, import or Redis URL that would stop
    a role of this run at start."""
    from buffers.backends import buffer_backend  # lazily: buffers imports numpy

    errors = [*path_errors(cfg), *plugin_errors(cfg)]
    if errors:
        raise ConfigError("\n".join(errors))
    buffer_backend(cfg.buffer).preflight()  # Redis, which no role starts, must answer


def path_errors(cfg: Config) -> list[str]:
    """A missing ``model.path`` that is a local path, and missing data files."""
    errors = [err for err in (model_path_error(cfg.model),) if err]
    if cfg.workflow.type != "digits":  # the digit tasks generate their data
        for key, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
            if path and not Path(path).expanduser().exists():
                errors.append(f"{key}: {path!r} does not exist")
    return errors


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
    ``workflow.env`` and a custom ``reward.path``."""
    if cfg.workflow.type == "digits":
        return []
    from asyncrl.plugins import load_callable

    checks: list[Callable[[], object]] = []
    if cfg.workflow.type == "custom":
        checks.append(lambda: load_callable(cfg.workflow.path, "workflow.path"))
    if cfg.workflow.env:
        from rollouters.workflows.factory import env_class  # built-in names, then import paths

        checks.append(lambda: env_class(cfg))
    if cfg.reward.type == "custom":
        checks.append(lambda: load_callable(cfg.reward.path, "reward.path"))
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
