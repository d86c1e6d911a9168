"""`asyncrl eval --checkpoint` on a learner checkpoint: the sharded DCP state of a trained FSDP2
actor loads into a plain model with exactly the trainer's weights and its version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.eval_checkpoint import load_policy
from asyncrl.models import load_causal_lm
from learners import checkpoint
from tests.unit.test_checkpoint import CFG, _step, one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import tiny_model_dir  # noqa: F401 (fixture)


@pytest.mark.usefixtures("one_rank_group")
def test_learner_checkpoint_loads_for_evaluation(tiny_model_dir: Path, tmp_path: Path) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(tiny_model_dir, CFG, "cpu")
    _step(trainer)
    path = checkpoint.save(trainer, tmp_path / "checkpoints", keep=1)
    expected = trainer.full_state_dict()
    cfg = load_config(None, [f"model.path={json.dumps(str(tiny_model_dir))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}"])
    model, version, model_dir = load_policy(cfg, path)
    assert version == 1 and model_dir == tiny_model_dir
    state = model.state_dict()
    assert set(expected) <= set(state)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    init = load_causal_lm(tiny_model_dir).state_dict()
    assert any(not torch.equal(init[n], state[n]) for n in expected)  # trained, not the init


def test_eval_device_cuda_without_a_gpu_names_the_key(tmp_path: Path) -> None:
    """``eval.device`` puts the learner's greedy eval on a GPU for real models; asked for on a
    machine without one, the error names the key rather than failing deep in torch."""
    import torch

    from asyncrl.config import ConfigError, load_config
    from asyncrl.models import prepare_model_dir
    from asyncrl.tokens import ModelTokenizer
    from rollouters.eval import EngineEvaluator

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "eval.device=cuda"])
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    with pytest.raises(ConfigError, match="eval.device: 'cuda', but this process sees no CUDA"):
        EngineEvaluator(cfg, ModelTokenizer(model_dir))
