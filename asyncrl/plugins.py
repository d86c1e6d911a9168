"""Load user code (workflows, environments, reward functions) by import path ``pkg.module:name``,
or from a file, ``path/to/file.py:name`` (verl's ``custom_reward_function.path`` is a file).

Every error names the config key the path came from, so a typo in a TOML file points at itself.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncrl.config.load import ConfigError


def load_object(path: str, key: str) -> Any:
    """The object ``name`` of module ``pkg.module`` for ``path = "pkg.module:name"``, or of the
    Python file for ``path = "path/to/file.py:name"`` (absolute, or relative to the working
    directory).

    ``name`` may be dotted (``module:Class.factory``). Raises :class:`ConfigError` naming ``key``
    for a malformed path, a module that cannot be imported, or a missing attribute.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: expected an import path 'pkg.module:name' or a file "
                          f"'path/to/file.py:name', got {path!r}")
    try:
        obj: Any = (_load_file(Path(module_name).expanduser()) if module_name.endswith(".py")
                    else importlib.import_module(module_name))
    except FileNotFoundError:
        raise ConfigError(f"{key}: no file {module_name!r} (from {path!r}, relative to "
                          f"{Path.cwd()})") from None
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


def _load_file(file: Path) -> ModuleType:
    """The module a Python file defines, loaded once per process under a name of its own
    (registered in ``sys.modules``, as an import would be, so that pickle and dataclasses
    find it). An error inside the file is an ImportError naming the file."""
    if not file.is_file():
        raise FileNotFoundError(file)
    resolved = file.resolve()
    name = f"asyncrl_user_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"{resolved} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ImportError(f"{type(exc).__name__} while running {resolved}: {exc}") from exc
    return module


def load_callable(path: str, key: str) -> Any:
    """:func:`load_object`, and the object must be callable (a function or a class)."""
    obj = load_object(path, key)
    if not callable(obj):
        raise ConfigError(f"{key}: {path!r} is a {type(obj).__name__}, not a callable")
    return obj
