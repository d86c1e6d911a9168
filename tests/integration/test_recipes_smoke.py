"""Each recipe of configs/recipes/ runs a few steps on CPU with the tiny model swapped in
(tests/recipes_smoke.py): the same workflow, reward type, loss, LoRA and data layout as on
GPUs. All at once, each through `asyncrl up`, to keep the suite short."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from tests.integration.conftest import Processes
from tests.recipes_smoke import RECIPES, smoke_overrides

pytestmark = pytest.mark.slow


def test_every_recipe_runs_a_few_steps_with_the_tiny_model(tmp_path: Path,
                                                           processes: Processes) -> None:
    runs = {}
    for recipe in RECIPES:
        sets = [arg for value in smoke_overrides(recipe) for arg in ("--set", value)]
        runs[recipe.stem] = processes.start(recipe.stem, "up", str(recipe), *sets,
                                            "--set", f"run.output_dir={tmp_path}")
    for name, up in runs.items():
        assert processes.wait(up, 400) == 0, (name, processes.log(name)[-3000:])
    for recipe in RECIPES:
        config = (tmp_path / recipe.stem / "config.toml").read_text()
        steps = [r["step"] for r in read_jsonl(tmp_path / recipe.stem / "metrics.jsonl")]
        assert [s for s in steps if isinstance(s, int)][-1] == 2, (recipe.stem, steps)
        assert "final held-out greedy eval" in processes.log(recipe.stem), recipe.stem
        assert 'engine = "torch"' in config
