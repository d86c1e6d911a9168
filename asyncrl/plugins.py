"""Load user code (workflows, environments, reward functions) by import path ``pkg.module:name``.

Every error names the config key the path came from, so a typo in a TOML file points at itself.
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncrl.config.load import ConfigError


def load_object(path: str, key: str) -> Any:
    """The object ``name`` of module ``pkg.module`` for ``path = "pkg.module:name"``.

    ``name`` may be dotted (``module:Class.factory``). Raises :class:`ConfigError` naming ``key``
    for a malformed path, a module that cannot be imported, or a missing attribute.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: expected an import path 'pkg.module:name', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} (from {path!r}): "
                          f"{exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r} "
                              f"(from {path!r})") from None
    return obj


def load_callable(path: str, key: str) -> Any:
    """:func:`load_object`, and the object must be callable (a function or a class)."""
    obj = load_object(path, key)
    if not callable(obj):
        raise ConfigError(f"{key}: {path!r} is a {type(obj).__name__}, not a callable")
    return obj
