"""Reading a config: TOML file → ``--set`` overrides → validated :class:`Config`.

Errors are collected and reported together, each naming the dotted key path, what was given
and what is allowed, so a user fixes a config in one round instead of one error at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ValidationError

from asyncrl.config.errors import ConfigError
from asyncrl.config.resolve import map_legacy_keys, selected_only, warn_unselected
from asyncrl.config.schema import Config



def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Turn ``["learner.lr=1e-4", "run.name=x"]`` into a nested dict.

    Values are read as TOML values when they parse as one (numbers, booleans, quoted strings,
    arrays), otherwise taken as a bare string, so ``--set run.name=my-run`` needs no quotes.
    """
    nested: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is set both as a value and a section")
            node = child
        node[leaf] = value
    return nested


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively merge ``update`` into a copy of ``base``."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> Config:
    """Load ``path`` (or only defaults when None), apply overrides, validate.

    Legacy keys are mapped in the file and in the overrides apart, before they merge, so an
    override of a new key (``--set buffer.zmq.port=...``) wins over the file's old name of it
    (``buffer.port``) as any override wins over the file."""
    source = str(path) if path is not None else "<defaults>"
    data = map_legacy_keys(_read_toml(Path(path)), source) if path is not None else {}
    data = deep_merge(data, map_legacy_keys(parse_overrides(overrides), "--set"))
    return validate_config(data, source=source)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:   # was a traceback
        raise ConfigError(f"{path}: not UTF-8 text, as TOML must be (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r})") from None


def validate_config(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """The :class:`Config` of the raw dict ``data`` (parsed TOML): legacy keys mapped, then
    validated, then the keys of backends not selected named (:mod:`asyncrl.config.resolve`)."""
    data = map_legacy_keys(data, source)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(err) for err in exc.errors()]
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines)) from None
    warn_unselected(config)
    return config


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc) or "<root>"
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_model_at(loc[:-1]).model_fields))
        return f"{key}: unknown key (allowed in [{'.'.join(loc[:-1]) or 'root'}]: {allowed})"
    msg = err["msg"]
    given = "input" in err and not isinstance(err["input"], Mapping)
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
        if not given:  # a rule over a whole section: each of its lines names its keys
            return "\n  ".join(msg.splitlines())
    if loc and given:
        return f"{key}: {msg} (got {_shown(err['input'])})"
    return f"{key}: {msg}"


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened: a value pasted by mistake can be a whole file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"


def _model_at(loc: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    return model


def to_toml(config: BaseModel) -> str:
    """Render a config as TOML (the resolved config written to every run directory), without
    the sub-tables of backends it does not select (:func:`~asyncrl.config.resolve.selected_only`)."""
    out: list[str] = []
    _emit_table(selected_only(config.model_dump(mode="json")), [], out)
    return "\n".join(out).lstrip() + "\n"


def _emit_table(table: Mapping[str, Any], prefix: list[str], out: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if prefix and scalars:
        out.append(f"\n[{'.'.join(_toml_key(part) for part in prefix)}]")
    for key, value in scalars.items():
        if value is None:
            out.append(f"# {_toml_key(key)} = (unset)")
        else:
            out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in tables.items():
        _emit_table(value, [*prefix, key], out)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    """A bare key, or a quoted one (free-form keys, as in ``workflow.env_args``)."""
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    """A TOML basic string. JSON's escapes are TOML's, but with ``ensure_ascii`` JSON writes
    a character past U+FFFF as a surrogate pair, which TOML refuses, and JSON leaves DEL
    unescaped, which TOML also refuses."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):   # in an array (an array of tables): an inline table
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()
                               if v is not None) + "}"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
