"""Datasets as sample sources: JSONL, Parquet, local HF ``datasets`` directories, hub ids.

A :class:`DatasetSource` walks its rows epoch by epoch, each epoch in a seeded shuffled order
(``data.seed + epoch``), and can say where it is (:meth:`state`) and resume there
(:meth:`load_state`): rollout worker ``i`` of ``K`` reads the rows ``j`` with ``j % K == i``
and keeps its position in ``<run dir>/data/worker-<i>.json``.

Every row is checked as it is read (:func:`row_problem`): a JSON object with the fields the
config names, which the prompt template formats. An error names the config key, the file and
the 1-based line (JSONL) or row (Parquet, ``datasets``). `asyncrl up` (and ``--dry-run``)
streams each data file once before anything starts (:func:`check_data_file`); each worker
checks the rows again as it loads them.

verl's preprocessing scripts (``examples/data_preprocess/gsm8k.py`` and its kin) write rows
with ``prompt`` as a list of chat messages, the answer in ``reward_model.ground_truth``, and
``data_source`` and ``extra_info`` beside them. Users bring those files as they are: a file
whose rows have that layout is read as such (:class:`RowLayout`, ``data.format = "verl"``
requires it): the messages go through the model's chat template, the answer comes from
``reward_model.ground_truth`` unless ``data.answer_field`` names another field, and the whole
row stays on the sample for rewards (``reward.type = "verl"``). Field names may be dotted
paths into nested fields (``data.answer_field = "reward_model.ground_truth"``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from asyncrl.config.load import ConfigError
from asyncrl.config.schema import DataConfig
from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)


PARQUET_BATCH_ROWS = 65536
"""Rows read at once from a Parquet file or a ``datasets`` directory: memory stays one batch."""
FIELDS_SHOWN = 12
"""Field names listed in an error about a row."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``owner/name``: a ``data.path`` that is no local file is read from the hub."""
VERL_PROMPT, VERL_ANSWER = "prompt", "reward_model.ground_truth"


@dataclass(frozen=True)
class RowLayout:
    """How the rows of one file become samples: verl's chat-message layout or the template
    over the row's fields, and the (dotted) fields holding the answer and the id."""

    verl: bool
    answer_field: str
    id_field: str


def row_layout(data: DataConfig | None, first: Any) -> RowLayout:
    """The layout of a file whose first row is ``first``: verl's when ``data.format =
    "verl"``, or with ``auto`` when the row has it (:func:`is_verl_row`); the default answer
    field then is ``reward_model.ground_truth``."""
    fmt = data.format if data is not None else "auto"
    verl = fmt == "verl" or (fmt == "auto" and is_verl_row(first))
    answer = data.answer_field if data is not None else ""
    if verl and data is not None and answer == type(data).model_fields["answer_field"].default:
        answer = VERL_ANSWER
    return RowLayout(verl, answer, data.id_field if data is not None else "")


def is_verl_row(row: Any) -> bool:
    """Does ``row`` have verl's layout: ``prompt`` a list of ``{role, content}`` messages and
    a ``reward_model`` mapping?"""
    return (isinstance(row, dict) and isinstance(row.get("reward_model"), dict)
            and _messages_problem(row.get(VERL_PROMPT)) is None)


def field_value(row: dict[str, Any], path: str) -> tuple[bool, Any]:
    """``(found, value)`` of a field, ``path`` a name or a dotted path into nested mappings
    (a name with a dot in it is found as it is first)."""
    if path in row:
        return True, row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "is not a non-empty list of chat messages"
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return (f"message {i} is not a {{\"role\": str, \"content\": str}} object: "
                    f"{str(message)[:80]}")
    return None


def load_rows(path: str | Path, fmt: str = "auto", split: str = "train", key: str = "data.path",
              data: DataConfig | None = None) -> list[dict[str, Any]]:
    """Every row of a JSONL file, a Parquet file or a ``datasets`` directory, as dicts, each
    checked (:func:`row_problem`: an object, with the fields ``data`` names) as it is read."""
    return list(checked_rows(path, fmt, split, key, data))


def check_data_file(path: str | Path, fmt: str, split: str, data: DataConfig,
                    key: str = "data.path") -> int:
    """Read every row of a data file once, streaming, and check it as the rollout workers
    will; the number of rows. Raises :class:`ConfigError` naming ``key``, the file and the
    1-based line (JSONL) or row (Parquet, ``datasets``) of the first bad row."""
    rows = sum(1 for _ in checked_rows(path, fmt, split, key, data))
    if not rows:
        raise ConfigError(f"{key}: {str(path)!r} holds no rows")
    return rows


def checked_rows(path: str | Path, fmt: str = "auto", split: str = "train",
                 key: str = "data.path", data: DataConfig | None = None) -> Iterator[dict]:
    """The rows of a data file one by one, each checked, without holding the file."""
    p = Path(path).expanduser()
    kind = _format(p, fmt, key)
    layout = None
    for number, row in _read(p, kind, split, key):
        if layout is None and isinstance(row, dict):
            layout = row_layout(data, row)
            if layout.verl and data is not None and data.format == "auto":
                logger.info("%s: %s has verl's layout (prompt messages, answer from %s)",
                            key, p, layout.answer_field)
        problem = row_problem(row, data, layout)
        if problem:
            where = f"{p}:{number}" if kind == "jsonl" else f"{p}: row {number}"
            raise ConfigError(f"{key}: {where}: {problem}")
        yield row


def _format(p: Path, fmt: str, key: str) -> str:
    """The file kind to read: ``jsonl``, ``parquet``, ``hf`` (a ``save_to_disk`` directory)
    or ``hub`` (``owner/name``, through ``datasets.load_dataset``)."""
    if not p.exists():
        if HUB_ID.match(str(p)):
            return "hub"
        raise ConfigError(f"{key}: {str(p)!r} does not exist")
    if fmt in ("auto", "verl"):
        fmt = "hf" if p.is_dir() else {".jsonl": "jsonl", ".json": "jsonl",
                                       ".parquet": "parquet"}.get(p.suffix, "")
        if not fmt:
            raise ConfigError(f"{key}: cannot tell the format of {str(p)!r}; set data.format")
    return fmt


def _read(p: Path, fmt: str, split: str, key: str) -> Iterator[tuple[int, Any]]:
    """``(position, row)`` pairs, position 1-based: the line of a JSONL file (blank lines
    count), the row of a Parquet file or a dataset."""
    if fmt == "jsonl":
        yield from _read_jsonl(p, key)
    elif fmt == "parquet":
        yield from enumerate(_read_parquet(p, key), 1)
    elif fmt == "hub":
        yield from enumerate(_read_hub(str(p), split, key), 1)
    else:
        yield from enumerate(_read_dataset(p, split, key), 1)


def _read_jsonl(p: Path, key: str) -> Iterator[tuple[int, Any]]:
    with p.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield number, orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise ConfigError(f"{key}: {p}:{number}: not JSON: {exc}") from None


def _read_parquet(p: Path, key: str) -> Iterator[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(p).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        for batch in batches:
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{key}: {p}: not a readable Parquet file: {exc}") from None


def _read_dataset(p: Path, split: str, key: str) -> Iterator[dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"{key}: {p}: not a `datasets` directory (save_to_disk): "
                          f"{exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"data.split: {split!r} is not a split of {p} "
                              f"(splits: {sorted(loaded)})")
        loaded = loaded[split]
    yield from _dataset_rows(loaded)


def _read_hub(name: str, split: str, key: str) -> Iterator[dict[str, Any]]:
    """A hub dataset's ``split``, through ``datasets.load_dataset`` (its cache, or the network
    unless ``HF_HUB_OFFLINE`` is set)."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001 - network, auth, missing split: all name the key
        raise ConfigError(f"{key}: {name!r} is no local file, and loading it as a hub dataset "
                          f"(split {split!r}, data.split) failed: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from None
    yield from _dataset_rows(loaded)


def _dataset_rows(loaded: Any) -> Iterator[dict[str, Any]]:
    """A ``datasets.Dataset``'s rows as dicts, one batch in memory at a time."""
    for batch in loaded.iter(batch_size=PARQUET_BATCH_ROWS):
        yield from (dict(zip(batch, values)) for values in zip(*batch.values()))


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def row_problem(row: Any, data: DataConfig | None,
                layout: RowLayout | None = None) -> str | None:
    """What stops ``row`` from becoming a sample, in words; None when nothing does. A row is
    a JSON object (a mapping); with ``data``, it has every field ``data.prompt_template``
    (verl's layout: ``prompt``, a list of chat messages), ``data.answer_field`` and
    ``data.id_field`` name, and the template formats it. ``layout``: the file's
    (:func:`row_layout`), else this row's."""
    if not isinstance(row, dict):
        kind = _JSON_KINDS.get(type(row), type(row).__name__)
        return f"a row must be a JSON object ({{\"field\": value, ...}}), this one is {kind}"
    if data is None:
        return None
    layout = layout or row_layout(data, row)
    if layout.verl:
        problem = _messages_problem(row.get(VERL_PROMPT))
        if problem:
            return (f"{VERL_PROMPT!r} {problem} (verl's layout: data.format = "
                    f"{data.format!r}; the row has {_fields(row)})")
    else:
        try:
            data.prompt_template.format(**row)
        except KeyError as exc:
            return f"no field {exc} (named by data.prompt_template; the row has {_fields(row)})"
        except (IndexError, ValueError, TypeError, AttributeError) as exc:
            return f"data.prompt_template = {data.prompt_template!r} cannot format it: {exc}"
    for key, field in (("data.answer_field", layout.answer_field),
                       ("data.id_field", layout.id_field),
                       ("data.image_field", data.image_field)):
        if field and not field_value(row, field)[0]:
            return f"no field {field!r} (named by {key}; the row has {_fields(row)})"
    return None


def _fields(row: dict[str, Any]) -> str:
    names = sorted(row)
    shown = ", ".join(repr(name) for name in names[:FIELDS_SHOWN])
    return (shown + f", ... ({len(names)} fields)") if len(names) > FIELDS_SHOWN else \
        (shown or "no fields")


def row_to_sample(row: dict[str, Any], index: int, cfg: DataConfig,
                  layout: RowLayout | None = None) -> Sample:
    """Row ``index`` (0-based) as a sample; a row :func:`checked_rows` did not check is
    checked here, and named by its 1-based number."""
    layout = layout or row_layout(cfg, row)
    problem = row_problem(row, cfg, layout)
    if problem:
        raise ConfigError(f"data.path: row {index + 1}: {problem}")
    sample_id = str(field_value(row, layout.id_field)[1]) if layout.id_field else str(index)
    answer = field_value(row, layout.answer_field)[1] if layout.answer_field else None
    images = row_images(row, cfg.image_field, index) if cfg.image_field else ()
    if layout.verl:
        messages = [{"role": m["role"], "content": m["content"]} for m in row[VERL_PROMPT]]
        return Sample(sample_id=sample_id, prompt="\n".join(m["content"] for m in messages),
                      answer=answer, fields=row, messages=messages, images=images)
    return Sample(sample_id=sample_id, prompt=cfg.prompt_template.format(**row),
                  answer=answer, fields=row, images=images)


def row_images(row: dict[str, Any], field: str, index: int) -> tuple[bytes, ...]:
    """The encoded images ``data.image_field`` names in ``row``: file paths, bytes, or verl's
    ``{"bytes": ..., "path": ...}`` objects, one or a list of them."""
    found, value = field_value(row, field)
    if not found or value is None:
        raise ConfigError(f"data.path: row {index + 1}: no field {field!r} (named by "
                          f"data.image_field; the row has {_fields(row)})")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(_image_bytes(v, field, index) for v in values)


def _image_bytes(value: Any, field: str, index: int) -> bytes:
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_bytes()
        raise ConfigError(f"data.path: row {index + 1}: image {value!r} of data.image_field "
                          f"= {field!r} is no file")
    raise ConfigError(f"data.path: row {index + 1}: data.image_field = {field!r} holds "
                      f"{type(value).__name__}, not image paths, bytes or {{bytes, path}}")


class DatasetSource:
    """Samples in seeded shuffled epochs, resumable. ``next`` returns fewer than asked (then
    none) once ``data.epochs`` passes are done."""

    def __init__(self, rows: list[dict[str, Any]], cfg: DataConfig, shard: int = 0,
                 num_shards: int = 1, state_path: Path | None = None) -> None:
        self.cfg, self.state_path = cfg, state_path
        self.indices = list(range(shard, len(rows), num_shards))
        if not self.indices:
            raise ConfigError(f"data.path: no rows for worker {shard} of {num_shards} "
                              f"({len(rows)} rows)")
        layout = row_layout(cfg, rows[self.indices[0]])
        self.samples = {i: row_to_sample(rows[i], i, cfg, layout) for i in self.indices}
        self.epoch, self.position = 0, 0
        if state_path is not None and state_path.exists():
            self.load_state(json.loads(state_path.read_text()))
        self._order = self._epoch_order()

    @property
    def exhausted(self) -> bool:
        return bool(self.cfg.epochs) and self.epoch >= self.cfg.epochs

    def next(self, n: int) -> list[Sample]:
        out: list[Sample] = []
        while len(out) < n and not self.exhausted:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
                continue
            out.append(self.samples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()
        logger.info("data resumes at epoch %d, position %d", self.epoch, self.position)

    def save_state(self) -> None:
        """Atomically record the position (after the groups it produced were handed over)."""
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state()))
        os.replace(tmp, self.state_path)

    def _epoch_order(self) -> list[int]:
        order = list(self.indices)
        if self.cfg.shuffle:
            random.Random(self.cfg.seed * 1_000_003 + self.epoch).shuffle(order)
        return order


class GeneratedSource:
    """Samples an environment generates itself (``Env.samples(rng, n)``): endless, seeded."""

    def __init__(self, generate, rng: random.Random, env_args: dict[str, Any]) -> None:
        self.generate, self.rng, self.env_args = generate, rng, env_args
        self.exhausted = False

    def next(self, n: int) -> list[Sample]:
        return self.generate(self.rng, n, **self.env_args)

    def save_state(self) -> None:
        """Nothing to save: a restarted worker draws fresh prompts."""
