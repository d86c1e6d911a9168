"""The one visible step between what a user wrote and the schema, logged key by key.

Each buffer backend and each engine that has keys of its own keeps them in its own sub-table
(``[buffer.zmq]``, ``[buffer.redis]``, ``[rollout.vllm]``, ``[rollout.sglang]``). Two things
follow, and both happen here rather than in a validator that rewrites silently (STYLE.md,
habit 6):

- **Flat keys of the earlier layout are still accepted.** :data:`LEGACY_KEYS` maps each one
  to its new place; :func:`map_legacy_keys` moves them in the raw dict (TOML, ``--set``)
  before validation and warns once per key. The old and the new key set to different values
  is a :class:`ConfigError` naming both: neither can be said to win.
- **A sub-table of a backend not selected is never read.** :func:`warn_unselected` names its
  keys set away from their defaults (a default changes nothing either way, and the run
  directory's ``config.toml`` writes every key), so a user who set ``[buffer.redis] url`` with
  ``buffer.type = "zmq"`` learns it is ignored. The rendered config (the run directory's
  ``config.toml``, ``asyncrl config show``) leaves such sub-tables out
  (:func:`selected_only`): every role reads that file, and each would warn again about keys
  the user was already told of once, by ``asyncrl up``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from asyncrl.config.errors import ConfigError
from asyncrl.engine_kinds import engine_kind

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

logger = logging.getLogger(__name__)

LEGACY_KEYS: dict[str, str] = {
    "buffer.host": "buffer.zmq.host",
    "buffer.port": "buffer.zmq.port",
    "buffer.auth": "buffer.zmq.auth",
    "buffer.curve_keys_dir": "buffer.zmq.curve_keys_dir",
    "buffer.spill_path": "buffer.zmq.spill_path",
    "buffer.io_threads": "buffer.zmq.io_threads",
    "buffer.reconnect_s": "buffer.zmq.reconnect_s",
    "buffer.url": "buffer.redis.url",
    "buffer.namespace": "buffer.redis.namespace",
    "buffer.cluster": "buffer.redis.cluster",
    "buffer.username": "buffer.redis.username",
    "buffer.password": "buffer.redis.password",
    "buffer.tls_ca_file": "buffer.redis.tls_ca_file",
    "buffer.tls_cert_file": "buffer.redis.tls_cert_file",
    "buffer.tls_key_file": "buffer.redis.tls_key_file",
    "rollout.kv_cache_memory_mb": "rollout.vllm.kv_cache_memory_mb",
    "rollout.gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "rollout.enforce_eager": "rollout.vllm.enforce_eager",
    "rollout.sglang_module": "rollout.sglang.module",
    "rollout.sglang_args": "rollout.sglang.args",
    "rollout.server_start_timeout_s": "rollout.sglang.server_start_timeout_s",
}
"""Each flat key of the earlier layout, and where it lives now."""


def _buffer_table(backend: str) -> str | None:
    """Each buffer backend reads the sub-table of its name (``[buffer.redis]``)."""
    return backend


def _engine_table(engine: str) -> str | None:
    """An engine kind reads the sub-table its descriptor names (``[rollout.vllm]`` is read by
    ``vllm`` and ``vllm-server``, not by ``torch``)."""
    return engine_kind(engine).table


SELECTORS: dict[str, tuple[str, Callable[[str], str | None]]] = {
    "buffer": ("type", _buffer_table), "rollout": ("engine", _engine_table)}
"""The field of a section that picks its backend, and the sub-table each value reads: every
other backend sub-table is not read (``[buffer.redis]`` with ``buffer.type = "zmq"``)."""


def selected_table(config: Config, name: str) -> str | None:
    """The backend sub-table of section ``name`` that ``config`` reads: ``"zmq"`` for
    ``selected_table(cfg, "buffer")`` when ``buffer.type = "zmq"``; None: it reads none."""
    selector, reads = SELECTORS[name]
    return reads(getattr(getattr(config, name), selector))


def map_legacy_keys(data: Mapping[str, Any], source: str = "<config>") -> dict[str, Any]:
    """A copy of the raw config ``data`` with every key of :data:`LEGACY_KEYS` moved to its
    new place, each logged. Raises ``ConfigError`` when a key and its new place are both set,
    to different values. ``source`` (a file, ``--set``) prefixes the error."""
    resolved = copy.deepcopy(dict(data))
    for old, new in LEGACY_KEYS.items():
        *old_parents, old_leaf = old.split(".")
        section = _table(resolved, old_parents)
        if section is None or old_leaf not in section:
            continue
        *new_parents, new_leaf = new.split(".")
        target = _table(resolved, new_parents, create=True)
        if target is None:  # the new place is not a table: validation names it
            continue
        value = section.pop(old_leaf)
        if new_leaf in target and target[new_leaf] != value:
            raise ConfigError(f"{source}: {old} = {value!r} and {new} = {target[new_leaf]!r} "
                              f"are both set: {old} is the earlier name of {new}; keep {new}")
        target[new_leaf] = value
        logger.warning("%s is deprecated: now %s (mapped)", old, new)
    return resolved


def _table(data: dict[str, Any], path: list[str], create: bool = False) -> dict[str, Any] | None:
    """The table at ``path`` in ``data`` (made when ``create``), or None where a step is
    missing or not a table."""
    node: Any = data
    for part in path:
        if create and part not in node:
            node[part] = {}
        node = node.get(part)
        if not isinstance(node, dict):
            return None
    return node


def warn_unselected(config: Config) -> None:
    """Warn, naming the keys, about every sub-table of a backend that ``config`` does not
    select and that is set away from its defaults: nothing reads it."""
    for name, (selector, reads) in SELECTORS.items():
        section = getattr(config, name)
        chosen = getattr(section, selector)
        for field, info in type(section).model_fields.items():
            table = getattr(section, field)
            if field == reads(chosen) or not isinstance(table, BaseModel):
                continue
            default = info.get_default(call_default_factory=True)
            changed = [f"{name}.{field}.{key}" for key in type(table).model_fields
                       if getattr(table, key) != getattr(default, key)]
            if changed:
                logger.warning("%s ignored: %s.%s = %r does not read [%s.%s]",
                               ", ".join(changed), name, selector, chosen, name, field)


def selected_only(dump: dict[str, Any]) -> dict[str, Any]:
    """``dump`` (a root config's ``model_dump``) without the sub-tables of the backends it
    does not select: what a role reading it back needs, and no key it would warn about."""
    kept = dict(dump)
    for name, (selector, reads) in SELECTORS.items():
        section = kept.get(name)
        if not isinstance(section, dict) or selector not in section:
            continue
        read = reads(section[selector])
        kept[name] = {key: value for key, value in section.items()
                      if not isinstance(value, dict) or key == read
                      or key not in _backend_tables(name)}
    return kept


def _backend_tables(name: str) -> set[str]:
    """The sub-tables of section ``name`` that belong to one backend each."""
    from asyncrl.config.schema import Config

    section = Config.model_fields[name].annotation
    return {field for field, info in section.model_fields.items()
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}
