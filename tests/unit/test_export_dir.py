"""HF exports are written whole, then swapped in (learners.export_dir.replace_dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config.schema import LearnerConfig
from learners.export_dir import replace_dir
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import tiny_model_dir  # noqa: F401 (fixture)


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


@pytest.mark.usefixtures("one_rank_group")
def test_a_learner_export_replaces_the_previous_one_whole(tiny_model_dir: Path,  # noqa: F811
                                                          tmp_path: Path) -> None:
    """The FSDP2 learner's HF export goes through replace_dir: a file of an earlier export
    does not survive a re-export (here a LoRA adapter's config, which adapter-aware loaders
    would read as an adapter directory), and nothing is left beside it."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    final = tmp_path / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    Fsdp2Trainer(tiny_model_dir, LearnerConfig(), "cpu").save_pretrained(final)
    names = {p.name for p in final.iterdir()}
    assert "config.json" in names and "adapter_config.json" not in names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
