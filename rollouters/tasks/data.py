"""Datasets as sample sources: JSONL, Parquet and local HF ``datasets`` directories.

A :class:`DatasetSource` walks its rows epoch by epoch, each epoch in a seeded shuffled order
(``data.seed + epoch``), and can say where it is (:meth:`state`) and resume there
(:meth:`load_state`): rollout worker ``i`` of ``K`` reads the rows ``j`` with ``j % K == i``
and keeps its position in ``<run dir>/data/worker-<i>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import orjson

from asyncrl.config.load import ConfigError
from asyncrl.config.schema import DataConfig
from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)


def load_rows(path: str | Path, fmt: str = "auto", split: str = "train",
              key: str = "data.path") -> list[dict[str, Any]]:
    """Every row of a JSONL file, a Parquet file or a ``datasets`` directory, as dicts."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}: {str(p)!r} does not exist")
    if fmt == "auto":
        fmt = "hf" if p.is_dir() else {".jsonl": "jsonl", ".json": "jsonl",
                                       ".parquet": "parquet"}.get(p.suffix, "")
        if not fmt:
            raise ConfigError(f"{key}: cannot tell the format of {str(p)!r}; set data.format")
    if fmt == "jsonl":
        rows = []
        for number, line in enumerate(p.read_bytes().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    raise ConfigError(f"{key}: {p}:{number}: not JSON: {exc}") from None
        return rows
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    import datasets

    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"data.split: {split!r} is not a split of {p} "
                              f"(splits: {sorted(loaded)})")
        loaded = loaded[split]
    return loaded.to_list()


def row_to_sample(row: dict[str, Any], index: int, cfg: DataConfig) -> Sample:
    try:
        prompt = cfg.prompt_template.format(**row)
    except KeyError as exc:
        raise ConfigError(f"data.prompt_template: row {index} has no field {exc} "
                          f"(fields: {sorted(row)})") from None
    if cfg.answer_field and cfg.answer_field not in row:
        raise ConfigError(f"data.answer_field: row {index} has no field {cfg.answer_field!r} "
                          f"(fields: {sorted(row)})")
    sample_id = str(row[cfg.id_field]) if cfg.id_field else str(index)
    return Sample(sample_id=sample_id, prompt=prompt,
                  answer=row.get(cfg.answer_field) if cfg.answer_field else None, fields=row)


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
        self.samples = {i: row_to_sample(rows[i], i, cfg) for i in self.indices}
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
