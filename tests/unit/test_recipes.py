"""Every recipe in configs/recipes/ is a valid config (`asyncrl config show`) and passes the
start checks `asyncrl up --dry-run` runs, with its data files replaced by the committed
verl-layout example (the recipes' own are prepared by verl's scripts on the user's machine).
Their CPU smoke runs are in tests/integration/test_recipes_smoke.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.cli import main
from tests.recipes_smoke import RECIPES, data_overrides


def _sets(overrides: list[str]) -> list[str]:
    return [arg for value in overrides for arg in ("--set", value)]


def test_there_are_recipes_for_each_kind_of_run() -> None:
    names = {path.stem for path in RECIPES}
    assert {"gsm8k_qwen2.5_0.5b", "math_qwen2.5_7b", "agent_lookup_qwen2.5_1.5b",
            "lora_qwen2.5_0.5b"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_shows_and_dry_runs(recipe: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    head = recipe.read_text().splitlines()[:12]
    assert any("Expects" in line for line in head) and any("Should reach" in line
                                                           for line in recipe.read_text()
                                                           .splitlines())
    assert main(["config", "show", str(recipe)]) == 0
    assert "[rollout]" in capsys.readouterr().out
    code = main(["up", str(recipe), "--dry-run", "--set", f"run.output_dir={tmp_path}",
                 *_sets(data_overrides(recipe))])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "rollout" in out.out   # what either launcher would start
