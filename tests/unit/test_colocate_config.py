"""``launcher.colocate``: what the config refuses, naming the keys, and where Ray places the
roles (the rollout workers in the learner ranks' bundles, which are sized for both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.engine_kinds import ENGINE_KINDS

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"
COLOCATE = ["launcher.colocate=true"]


def test_the_quickstart_colocates() -> None:
    assert load_config(QUICKSTART, COLOCATE).launcher.colocate


@pytest.mark.parametrize("engine", [k for k, kind in ENGINE_KINDS.items() if not kind.sleeps])
def test_an_engine_that_cannot_sleep_is_refused(engine: str) -> None:
    sets = [*COLOCATE, f"rollout.engine={engine}", "rollout.url=http://a:1,http://b:1"]
    with pytest.raises(ConfigError, match=rf"launcher.colocate .* rollout.engine = '{engine}'"):
        load_config(QUICKSTART, sets)


@pytest.mark.parametrize("sets, message", [
    (["learner.backend=sim"], r"launcher.colocate = true needs learner.backend = 'fsdp2'"),
    (["learner.device=cuda"], r"learner.device \('cuda'\) and rollout.device \('cpu'\)"),
])
def test_a_learner_that_cannot_share_is_refused(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, [*COLOCATE, *sets])


def test_ray_places_each_rollout_worker_in_a_learner_bundle() -> None:
    from asyncrl.launch.ray import RayLauncher

    cfg = load_config(QUICKSTART, [*COLOCATE, "launcher.type=ray", "learner.ranks=2",
                                   "rollout.workers=3", "resources.learner.gpus=0.5",
                                   "resources.rollout.gpus=0.25", "resources.learner.cpus=1",
                                   "resources.rollout.cpus=1"])
    plan = RayLauncher(cfg).plan()
    # two workers share rank 0's bundle (0 and 2), one rank 1's: each bundle holds 1 + 2
    assert "placement group learner (PACK): 2 x {'CPU': 3.0, 'GPU': 1.0}" in plan
    for index, bundle in ((0, 0), (1, 1), (2, 0)):
        assert any(line.startswith(f"learner bundle {bundle} (launcher.colocate); actor "
                                   f"rollout[{index}]") for line in plan), plan
    assert not any(line.startswith("placement group rollout") for line in plan)
