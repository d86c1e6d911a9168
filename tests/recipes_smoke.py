"""The overrides that turn a GPU recipe (configs/recipes/) into a CPU smoke run with the tiny
model: same workflow, reward, loss and data layout, a few steps. Shared by the recipe tests."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.toml"))
# verl's layout, digits only (the tiny tokenizer cannot spell GSM8K): stands in for the
# recipes' ~/data Parquet files.
VERL_DATA = ROOT / "examples" / "verl" / "data"

SMOKE = ["model.path=", "model.dtype=float32", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "launcher.type=local", "rollout.engine=torch",
         "rollout.device=cpu", "learner.device=cpu", "learner.ranks=1", "rollout.workers=1",
         "rollout.group_size=4", "rollout.groups_per_batch=4", "rollout.max_new_tokens=4",
         "learner.groups_per_step=4", "learner.total_steps=2", "learner.micro_batch_tokens=0",
         "learner.activation_checkpointing=false", "eval.every_steps=0", "eval.device=cpu",
         "checkpoint.every_steps=0", "weights.host=127.0.0.1", "weights.timeout_s=60"]


def data_overrides(recipe: Path) -> list[str]:
    """The recipe's data files, replaced by the committed verl-layout example (a recipe whose
    environment generates its prompts has none)."""
    if not tomllib.loads(recipe.read_text()).get("data", {}).get("path"):
        return []
    return [f"data.path={VERL_DATA / 'train.parquet'}",
            f"data.eval_path={VERL_DATA / 'test.parquet'}", "data.eval_size=8"]


def smoke_overrides(recipe: Path) -> list[str]:
    """Everything the smoke run of ``recipe`` sets: the tiny model on CPU, and for an agent
    recipe the tool's tokens and the compact call format the tiny vocabulary can spell."""
    extra = data_overrides(recipe)
    if tomllib.loads(recipe.read_text()).get("workflow", {}).get("type") == "multi_turn":
        extra += ['model.tiny.extra_tokens=["lookup(", ")"]', "workflow.tool_format=compact",
                  "workflow.env_args={ key_length = 1, value_length = 1, eval_repeats = 1 }"]
    return SMOKE + extra
