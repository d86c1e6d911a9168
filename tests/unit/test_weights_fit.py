"""An update is checked against the engine's model before anything loads (asyncrl.weights.fit),
and engines whose model lives in another process (vLLM) check it against the shapes of the
model class the learner builds (asyncrl.models.model_shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.models import load_causal_lm, model_shapes, prepare_model_dir
from asyncrl.weights.fit import WeightsRefused, check_fit

ROOT = Path(__file__).resolve().parents[2]


def test_a_fitting_update_passes_and_a_misfit_names_what_differs() -> None:
    shapes = {"a": (2, 3), "b": (4,)}
    check_fit([("a", torch.zeros(2, 3))], shapes)  # a part of the model is an update too
    check_fit([], shapes)
    with pytest.raises(WeightsRefused, match=r"b: shape \(5,\) does not match \(4,\)"):
        check_fit([("a", torch.zeros(2, 3)), ("b", torch.zeros(5))], shapes)
    unknown = [(f"x{i:02d}", torch.zeros(1)) for i in range(11)]
    with pytest.raises(WeightsRefused, match=r"unknown weight names: \['x00', .*'x07'\] "
                                             r"and 3 more"):
        check_fit([("a", torch.zeros(2, 3)), *unknown], shapes)


@pytest.mark.parametrize("config", ["quickstart.toml", "moe_quickstart.toml",
                                    "vlm_quickstart.toml"])
def test_model_shapes_are_the_loaded_models(tmp_path: Path, config: str) -> None:
    """Built on the meta device, yet the very names and shapes of the model as loaded, tied
    names included: the dense, the MoE and the vision-language tiny models."""
    cfg = load_config(ROOT / "configs" / config)
    model_dir = prepare_model_dir(cfg.model, tmp_path, seed=0)
    loaded = {name: tuple(t.shape) for name, t in load_causal_lm(model_dir).state_dict().items()}
    assert model_shapes(model_dir) == loaded
    assert "lm_head.weight" in loaded  # tied to the embedding, still a name an update may use
