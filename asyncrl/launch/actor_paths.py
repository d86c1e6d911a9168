"""The driver's relative paths, made absolute for roles that run in another directory.

Ray actors do not run in the driver's working directory: on a cluster started with ``ray
start`` they run in the directory ``ray start`` ran in (measured: a driver in ``a/`` and a
head started in ``b/`` give actors the working directory ``b/``). ``asyncrl up`` checks the
config's paths and plugin imports from the driver's directory
(:func:`~asyncrl.launch.preflight.check_startup`), so without this a relative ``data.path`` or a
plugin module next to the config passed the check and then failed in every actor, each
restarted until the budget ran out. Here every local path the config names is resolved
against the driver's directory, and that directory goes on the actors' ``PYTHONPATH``, as
the check put it on its own ``sys.path``. On a cluster of several machines the paths must
then exist on each (a shared filesystem), as they would have to anyway.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from asyncrl.config import Config
from asyncrl.config.schema import SPILL_AUTO

logger = logging.getLogger(__name__)


def for_actors(cfg: Config, cwd: Path) -> Config:
    """``cfg`` with every relative local path resolved against ``cwd``: ``run.output_dir``,
    ``buffer.zmq.spill_path`` (files to be written), and the inputs that exist under ``cwd``
    (``model.path``, ``data.path``, ``data.eval_path``, ``checkpoint.path``, the TLS files
    and ``buffer.zmq.curve_keys_dir``). An input that does not exist there is left as it is: a
    hub id (``model.path = "org/name"``), or a path the preflight check reports."""
    changed: dict[str, str] = {}

    def resolve(key: str, value: str, must_exist: bool = True) -> str:
        if not value or Path(value).is_absolute():
            return value
        path = (cwd / Path(value).expanduser()).resolve()
        if must_exist and not path.exists():
            return value
        changed[key] = str(path)
        return str(path)

    zmq_cfg = cfg.buffer.zmq
    updates = {
        "run": {"output_dir": Path(resolve("run.output_dir", str(cfg.run.output_dir), False))},
        "model": {"path": resolve("model.path", cfg.model.path)},
        "data": {"path": resolve("data.path", cfg.data.path),
                 "eval_path": resolve("data.eval_path", cfg.data.eval_path)},
        "checkpoint": {"path": resolve("checkpoint.path", cfg.checkpoint.path)},
        "buffer.redis": {name: resolve(f"buffer.redis.{name}", getattr(cfg.buffer.redis, name))
                         for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")},
        "buffer.zmq": {"curve_keys_dir": resolve("buffer.zmq.curve_keys_dir",
                                                 zmq_cfg.curve_keys_dir)},
    }
    if zmq_cfg.spill_path not in ("", SPILL_AUTO):
        updates["buffer.zmq"]["spill_path"] = resolve("buffer.zmq.spill_path",
                                                      zmq_cfg.spill_path, False)
    for key, value in changed.items():
        logger.info("%s resolved to %s for the actors", key, value)
    for section, fields in updates.items():
        cfg = cfg.with_fields(section, **fields)
    return cfg


def python_path(cwd: Path, existing: str | None) -> str:
    """The actors' ``PYTHONPATH``: ``cwd`` (plugin modules the config names by import path,
    importable from the driver's directory), then ``existing``."""
    return os.pathsep.join(filter(None, [str(cwd), existing]))
