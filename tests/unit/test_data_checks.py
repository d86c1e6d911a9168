"""Data rows are checked when a file is opened and before `asyncrl up` starts anything: a bad
row names the key, the file and its 1-based line (JSONL) or row (Parquet, `datasets`).

A JSON array as a row crash-looped the workers for minutes, ending in ``TypeError:
str.format() argument after ** must be a mapping``; a missing field named a 0-based row and no
file; and both were found only when a worker reached the row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from rollouters.tasks.data import check_data_file, load_rows

ROOT = Path(__file__).resolve().parents[2]
SINGLE_TURN = ROOT / "examples" / "agent" / "single_turn.toml"
ROW = {"question": "1+1", "answer": "2"}
EXAMPLE_ROW = {"id": "r0", "digits": "123", "answer": "321"}  # examples/agent/single_turn.toml


def _data(*extra: str):
    return load_config(None, ["data.prompt_template='Q: {question}'", *extra]).data


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_array_row_names_the_file_and_its_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, json.dumps(ROW), "", '["1+1", "2"]', json.dumps(ROW))
    expected = (f"data.path: {path}:3: a row must be a JSON object "
                '({"field": value, ...}), this one is an array')
    with pytest.raises(ConfigError) as info:
        load_rows(path)  # with or without the config's fields
    assert str(info.value) == expected
    with pytest.raises(ConfigError, match="this one is a number"):
        load_rows(_jsonl(tmp_path, "7"))


def test_a_missing_field_names_the_file_the_line_and_the_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, json.dumps(ROW), json.dumps({"question": "2+2"}))
    with pytest.raises(ConfigError) as info:
        load_rows(path, data=_data())
    assert str(info.value) == (f"data.path: {path}:2: no field 'answer' (named by "
                               "data.answer_field; the row has 'question')")
    with pytest.raises(ConfigError, match=rf"^data.eval_path: {path}:1: no field 'q' \(named "
                                          r"by data.prompt_template; the row has 'answer', "
                                          r"'question'\)$"):
        load_rows(path, key="data.eval_path", data=_data("data.prompt_template='{q}'"))
    with pytest.raises(ConfigError, match=rf"^data.path: {path}:1: no field 'id' \(named by "
                                          r"data.id_field"):
        load_rows(path, data=_data("data.id_field=id"))


def test_parquet_rows_are_numbered_from_1(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    rows = [{"xs": ["a", "b"], "answer": "1"}, {"xs": ["c", "d"], "answer": "2"},
            {"xs": ["e"], "answer": "3"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ConfigError, match=rf"^data.path: {path}: row 3: data.prompt_template = "
                                          r"'\{xs\[1\]\}' cannot format it: list index out"):
        load_rows(path, data=_data("data.prompt_template='{xs[1]}'"))
    with pytest.raises(ConfigError, match=rf"^data.path: {path}: row 1: no field 'question'"):
        check_data_file(path, "auto", "train", _data())
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="bad.parquet: not a readable Parquet file"):
        load_rows(tmp_path / "bad.parquet")


def test_a_worker_checks_every_row_when_it_opens_the_file(tmp_path: Path) -> None:
    """Worker 0 of 2 never reads row 2 (worker 1's), and still names it: every worker fails
    the same way, at once, not the one that reaches the row some time later."""
    from rollouters.workflows.factory import make_source

    path = _jsonl(tmp_path, json.dumps(ROW), json.dumps({"question": "2+2"}), json.dumps(ROW))
    cfg = load_config(SINGLE_TURN, [f"data.path={json.dumps(str(path))}", "rollout.workers=2",
                                    "data.prompt_template='{question}'", "data.id_field=''",
                                    f"run.output_dir={json.dumps(str(tmp_path))}"])
    with pytest.raises(ConfigError, match=rf"^data.path: {path}:2: no field 'answer' \(named "
                                          r"by data.answer_field"):
        make_source(cfg, 0, 2, 0)


def test_check_data_file_streams_counts_and_refuses_an_empty_file(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, *[json.dumps(ROW)] * 5)
    assert check_data_file(path, "auto", "train", _data()) == 5
    with pytest.raises(ConfigError, match="holds no rows"):
        check_data_file(_jsonl(tmp_path, ""), "auto", "train", _data())


def _asyncrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)


def test_dry_run_checks_the_data_rows_before_anything(tmp_path: Path) -> None:
    """`up --dry-run` runs `up`'s own checks: the bad line is named, nothing is written."""
    path = _jsonl(tmp_path, *[json.dumps(EXAMPLE_ROW)] * 3, '"a string"')
    done = _asyncrl("up", str(SINGLE_TURN), "--dry-run", "--set", f"data.path={path}",
                    "--set", f"run.output_dir={tmp_path}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.endswith(f"asyncrl: data.path: {path}:4: a row must be a JSON object "
                                '({"field": value, ...}), this one is a string\n'), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not any(tmp_path.glob("*/config.toml"))


def test_dry_run_counts_rows_for_the_workers(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, json.dumps(EXAMPLE_ROW))
    done = _asyncrl("up", str(SINGLE_TURN), "--dry-run", "--set", f"data.path={path}",
                    "--set", "rollout.workers=2", "--set", f"run.output_dir={tmp_path}")
    assert done.returncode == 2, done.stderr
    assert "data.path: " in done.stderr and "holds 1 row(s) for rollout.workers = 2" in \
        done.stderr
