"""HF exports are written whole, then swapped in (learners.export_dir.replace_dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from learners.export_dir import replace_dir


def _write(files: dict[str, str]):
    def write(directory: Path) -> None:
        for name, text in files.items():
            (directory / name).write_text(text)
    return write


def test_a_new_export_replaces_the_previous_one_whole(tmp_path: Path) -> None:
    final = tmp_path / "runs" / "final"
    assert replace_dir(final, _write({"config.json": "1", "model-00001.bin": "a"})) == final
    replace_dir(final, _write({"config.json": "2"}))
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "2"}
    assert sorted(p.name for p in final.parent.iterdir()) == ["final"]   # nothing left over


def test_a_write_that_fails_leaves_the_previous_export(tmp_path: Path) -> None:
    final = tmp_path / "final"
    replace_dir(final, _write({"config.json": "1"}))

    def fails(directory: Path) -> None:
        (directory / "config.json").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_dir(final, fails)
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_killed_writers_leftovers_are_removed_by_the_next_export(tmp_path: Path) -> None:
    final = tmp_path / "final"
    for leftover in (".final.tmp", ".final.old"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "config.json").write_text("torn")
    replace_dir(final, _write({"config.json": "new"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (final / "config.json").read_text() == "new"
