"""Datasets: JSONL, Parquet and HF `datasets` directories; prompt template and answer field;
seeded shuffled epochs, sharding across workers and a resumable position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from rollouters.tasks.data import DatasetSource, load_rows

ROWS = [{"id": f"q{i}", "question": f"{i}+{i}", "answer": str(2 * i)} for i in range(10)]


def _write(tmp_path: Path, fmt: str) -> Path:
    if fmt == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets

        path = tmp_path / "rows_hf"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(path))
    return path


def _data_cfg(path: Path, *extra: str):
    return load_config(None, [f"data.path={json.dumps(str(path))}",
                              "data.prompt_template=Q: {question}", "data.id_field=id",
                              *extra]).data


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_every_format_gives_the_same_samples(tmp_path: Path, fmt: str) -> None:
    path = _write(tmp_path, fmt)
    assert load_rows(path) == ROWS
    source = DatasetSource(load_rows(path), _data_cfg(path, "data.shuffle=false"))
    first = source.next(3)
    assert [(s.sample_id, s.prompt, s.answer) for s in first] == \
        [("q0", "Q: 0+0", "0"), ("q1", "Q: 1+1", "2"), ("q2", "Q: 2+2", "4")]
    assert first[0].fields == ROWS[0]


def test_epochs_shuffle_with_a_seed_and_stop(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    cfg = _data_cfg(path, "data.epochs=2", "data.seed=3")
    ids = [s.sample_id for s in DatasetSource(load_rows(path), cfg).next(100)]
    assert len(ids) == 20 and sorted(ids[:10]) == sorted(ids[10:]) == sorted(r["id"] for r in ROWS)
    assert ids[:10] != [r["id"] for r in ROWS] and ids[:10] != ids[10:]  # shuffled, per epoch
    again = [s.sample_id for s in DatasetSource(load_rows(path), cfg).next(100)]
    assert again == ids  # same seed, same order
    other = _data_cfg(path, "data.epochs=2", "data.seed=4")
    assert [s.sample_id for s in DatasetSource(load_rows(path), other).next(10)] != ids[:10]


def test_position_resumes_from_the_run_dir(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    cfg = _data_cfg(path, "data.seed=1")
    state = tmp_path / "data" / "worker-0.json"
    straight = [s.sample_id for s in DatasetSource(load_rows(path), cfg).next(25)]
    source = DatasetSource(load_rows(path), cfg, state_path=state)
    head = [s.sample_id for s in source.next(13)]
    source.save_state()
    assert json.loads(state.read_text()) == {"epoch": 1, "position": 3}
    resumed = DatasetSource(load_rows(path), cfg, state_path=state)  # a restarted worker
    assert head + [s.sample_id for s in resumed.next(12)] == straight


def test_workers_read_disjoint_shards(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    cfg = _data_cfg(path, "data.epochs=1")
    shards = [{s.sample_id for s in DatasetSource(load_rows(path), cfg, i, 3).next(100)}
              for i in range(3)]
    assert set().union(*shards) == {r["id"] for r in ROWS}
    assert sum(len(s) for s in shards) == len(ROWS)


def test_bad_template_or_answer_field_names_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    with pytest.raises(ConfigError, match=r"data.path: row 1: no field 'nope' \(named by "
                                          r"data.prompt_template"):
        DatasetSource(load_rows(path), _data_cfg(path, "data.prompt_template={nope}"))
    with pytest.raises(ConfigError, match=r"data.path: row 1: no field 'ans' \(named by "
                                          r"data.answer_field"):
        DatasetSource(load_rows(path), _data_cfg(path, "data.answer_field=ans"))
    with pytest.raises(ConfigError, match="data.path: .* does not exist"):
        load_rows(tmp_path / "missing.jsonl")


def test_a_worker_past_rollout_workers_is_refused(tmp_path: Path) -> None:
    """Worker i of K reads the rows j with j % K == i: a worker started past
    ``rollout.workers`` (by hand, or joining with --first-index) used to read another
    worker's rows, silently. Workers within it read disjoint rows covering the data."""
    from rollouters.workflows.factory import make_source

    path = _write(tmp_path, "jsonl")
    cfg = load_config(None, [f"data.path={json.dumps(str(path))}", "data.epochs=1",
                             "data.prompt_template=Q: {question}", "data.id_field=id",
                             "data.shuffle=false", "rollout.workers=2",
                             f"run.output_dir={tmp_path}"])
    read = [{s.sample_id for s in make_source(cfg, i, 2, 0).next(100)} for i in (0, 1)]
    assert not read[0] & read[1] and len(read[0] | read[1]) == len(ROWS)
    with pytest.raises(ConfigError, match=r"^rollout.workers = 2 must count every rollout "
                                          r"worker .* this is worker 2"):
        make_source(cfg, 2, 2, 0)
