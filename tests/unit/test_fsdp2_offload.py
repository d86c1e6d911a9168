"""``learner.offload = "params"``: FSDP2's CPUOffloadPolicy keeps the sharded weights, their
gradients and the optimizer state on the host; the steps are those of the plain trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig
from learners.batching import collate
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import make_groups, tiny_model_dir  # noqa: F401 (fixture)

CFG = LearnerConfig(lr=1e-2)


def _train(model_dir: Path, cfg: LearnerConfig, device: str):
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(model_dir, cfg, device)
    metrics = [trainer.train_step(collate(make_groups(seed=s), std_norm=True, pad_id=0))
               for s in range(2)]
    return trainer, metrics


def _same_training(model_dir: Path, device: str) -> None:
    plain, plain_metrics = _train(model_dir, CFG, device)
    offloaded, metrics = _train(model_dir, CFG.model_copy(update={"offload": "params"}), device)
    for param in offloaded.model.parameters():   # sharded weights on the host
        assert param.to_local().device.type == "cpu"
    for state in offloaded.optimizer.state.values():
        assert all(t.device.type == "cpu" for t in state.values() if torch.is_tensor(t))
    for step, want in zip(metrics, plain_metrics):
        assert step["actor/loss"] == pytest.approx(want["actor/loss"], rel=1e-4, abs=1e-6)
    want = plain.full_state_dict()
    for name, tensor in offloaded.full_state_dict().items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0)


@pytest.mark.usefixtures("one_rank_group")
def test_params_offload_trains_like_plain_on_cpu(tiny_model_dir: Path) -> None:
    """On a CPU learner the policy changes where nothing lives, but runs its code path."""
    _same_training(tiny_model_dir, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_params_offload_trains_like_plain_on_cuda(tiny_model_dir: Path) -> None:
    from asyncrl.net import free_port
    from learners.dist import init_learner_group, shutdown_learner_group

    init_learner_group(0, 1, master_port=free_port(), timeout_s=120.0, device="cuda")
    try:
        _same_training(tiny_model_dir, "cuda")
    finally:
        shutdown_learner_group()
