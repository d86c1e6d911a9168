"""The configuration reference, rendered from the pydantic schema.

The documentation site's reference page (``docs/_hooks/config_reference.py`` adds it at build
time) and ``asyncrl config reference`` both print :func:`config_reference`: one table per TOML
table, each key with its type, default, bounds and description as :mod:`asyncrl.config.schema`
declares them. Nothing is written by hand, so the reference cannot drift from the code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from asyncrl.config.schema import Config

__all__ = ["config_reference", "sections"]

INTRO = """# Configuration reference

Every key of the TOML file, as the schema (`asyncrl/config/schema.py`) declares it; this page
is generated from that schema when the site is built (`asyncrl config reference` prints it).
A key left out takes its default. `--set table.key=value` overrides any of them on the command
line; `asyncrl config show FILE` prints a whole resolved config.
"""


def sections(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[
        tuple[str, type[BaseModel]]]:
    """``(dotted table name, model)`` for every table under ``model``, depth first."""
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            table = f"{prefix}{name}"
            yield table, sub
            yield from sections(sub, f"{table}.")


def config_reference() -> str:
    """The whole reference as Markdown."""
    parts = [INTRO]
    for table, model in sections():
        parts.append(f"\n## `[{table}]`\n")
        doc = _first_paragraph(model.__doc__)
        if doc:
            parts.append(f"{doc}\n")
        rows = [_row(name, field) for name, field in model.model_fields.items()
                if _submodel(field.annotation) is None]
        if rows:
            parts.append("\n| key | type | default | description |\n|---|---|---|---|")
            parts.extend(rows)
            parts.append("")
    return "\n".join(parts)


def _row(name: str, field: FieldInfo) -> str:
    description = " ".join((field.description or "").split())
    bounds = _bounds(field)
    if bounds:
        description = f"{description} ({bounds})" if description else bounds
    return (f"| `{name}` | {_cell(_type_name(field.annotation))} | "
            f"{_cell(_default(field))} | {_cell(description)} |")


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation,
                                                                     BaseModel) else None


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is not None and str(origin).endswith("Literal"):
        return " | ".join(f"`{json.dumps(a)}`" for a in get_args(annotation))
    if origin is None:
        return getattr(annotation, "__name__", str(annotation))
    args = ", ".join(_type_name(a) for a in get_args(annotation))
    return f"{getattr(origin, '__name__', str(origin))}[{args}]"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, Path):
        value = str(value)
    return f"`{json.dumps(value)}`" if _jsonable(value) else f"`{value!r}`"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _bounds(field: FieldInfo) -> str:
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    found = []
    for item in field.metadata:
        for attr, symbol in symbols.items():
            value = getattr(item, attr, None)
            if value is not None and isinstance(item, annotated_types.BaseMetadata):
                found.append(f"{symbol} {value}")
    return ", ".join(found)


def _cell(text: str) -> str:
    """``text`` safe in a Markdown table cell: no bare ``|``, no ``<name>`` read as HTML."""
    return (text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            .replace("\n", " "))


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())
