"""``learner.offload``: "params" (FSDP2's CPUOffloadPolicy: sharded weights, gradients and
optimizer state on the host) and "optimizer" (AdamW's moments on the host, streamed one
parameter at a time): the steps are those of the plain trainer, and checkpoints resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, LossConfig
from learners import checkpoint
from learners.batching import collate
from learners.offload import HostStateAdamW
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import make_groups, tiny_model_dir  # noqa: F401 (fixture)

CFG = LearnerConfig(lr=1e-2)


def _train(model_dir: Path, cfg: LearnerConfig, device: str):
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(model_dir, cfg, device)
    metrics = [trainer.train_step(collate(make_groups(seed=s), std_norm=True, pad_id=0,
                                          advantage=cfg.loss.advantage)) for s in range(2)]
    return trainer, metrics


def _same_training(model_dir: Path, device: str, mode: str = "params") -> None:
    plain, plain_metrics = _train(model_dir, CFG, device)
    offloaded, metrics = _train(model_dir, CFG.model_copy(update={"offload": mode}), device)
    for param in offloaded.model.parameters():   # sharded weights on the host, or not
        assert param.to_local().device.type == ("cpu" if mode == "params" else device)
    for state in offloaded.optimizer.state.values():
        assert all(t.device.type == "cpu" for t in state.values() if torch.is_tensor(t))
    for step, want in zip(metrics, plain_metrics):
        assert step["actor/loss"] == pytest.approx(want["actor/loss"], rel=1e-4, abs=1e-6)
    want = plain.full_state_dict()
    for name, tensor in offloaded.full_state_dict().items():
        torch.testing.assert_close(tensor, want[name], atol=1e-5, rtol=0)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("mode", ["params", "optimizer"])
def test_offload_trains_like_plain_on_cpu(tiny_model_dir: Path, mode: str) -> None:
    """On a CPU learner offloading moves nothing, but runs its code paths."""
    _same_training(tiny_model_dir, "cpu", mode)


@pytest.mark.usefixtures("one_rank_group")
def test_critic_optimizer_offload_trains_like_plain(tiny_model_dir: Path) -> None:
    """GAE with learner.offload = "optimizer": the critic's AdamW keeps its moments on the
    host too, and actor and critic train as without offload (same losses, values, weights)."""
    cfg = CFG.model_copy(update={"loss": LossConfig(advantage="gae", critic_lr=5e-2)})
    plain, plain_metrics = _train(tiny_model_dir, cfg, "cpu")
    offloaded, metrics = _train(tiny_model_dir, cfg.model_copy(update={"offload": "optimizer"}),
                                "cpu")
    assert isinstance(offloaded.critic.optimizer, HostStateAdamW)
    assert not isinstance(plain.critic.optimizer, HostStateAdamW)
    moments = [t for state in offloaded.critic.optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    assert moments and all(t.device.type == "cpu" for t in moments)
    for step, want in zip(metrics, plain_metrics):
        for name in ("critic/loss", "critic/values/mean", "critic/grad_norm", "actor/loss"):
            assert step[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), name
    assert metrics[1]["critic/values/mean"] != 0.0   # the critic learned something
    want = dict(plain.critic.model.named_parameters())
    for name, param in offloaded.critic.model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), want[name].full_tensor(),
                                   atol=1e-6, rtol=0)


def test_host_state_adamw_equals_adamw() -> None:
    """One parameter at a time, two groups, weight decay: AdamW's own numbers, exactly."""
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True) for _ in range(3)]
    copies = [p.detach().clone().requires_grad_() for p in params]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}]  # noqa: E731
    plain = torch.optim.AdamW(groups(params), lr=0.01, weight_decay=0.1)
    streamed = HostStateAdamW(groups(copies), lr=0.01, weight_decay=0.1)
    for step in range(3):
        grads = [torch.randn(5, 3) for _ in params]
        for p, c, g in zip(params, copies, grads):
            p.grad, c.grad = g.clone(), g.clone()
        copies[1].grad = params[1].grad = None if step == 1 else params[1].grad  # skipped
        plain.step()
        streamed.step()
    for p, c in zip(params, copies):
        assert torch.equal(p, c)
    assert [len(g["params"]) for g in streamed.param_groups] == [2, 1]


@pytest.mark.usefixtures("one_rank_group")
def test_optimizer_offload_checkpoint_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer

    cfg = CFG.model_copy(update={"offload": "optimizer"})
    trainer, _ = _train(tiny_model_dir, cfg, "cpu")
    path = checkpoint.save(trainer, tmp_path, keep=1)
    batch = collate(make_groups(seed=7), std_norm=True, pad_id=0)
    trainer.train_step(batch)
    resumed = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    checkpoint.load(resumed, path)
    resumed.train_step(batch)
    want = trainer.full_state_dict()
    for name, tensor in resumed.full_state_dict().items():
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=0)


@pytest.mark.usefixtures("one_rank_group")
def test_critic_optimizer_offload_checkpoint_resumes(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """GAE with the critic's AdamW moments on the host: a checkpoint restores them, and the
    step after the resume is the step the uninterrupted trainer took (actor and critic)."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    cfg = CFG.model_copy(update={"offload": "optimizer",
                                 "loss": LossConfig(advantage="gae", critic_lr=5e-2)})
    trainer, _ = _train(tiny_model_dir, cfg, "cpu")
    path = checkpoint.save(trainer, tmp_path, keep=1)
    batch = collate(make_groups(seed=7), std_norm=True, pad_id=0, advantage="gae")
    uninterrupted = trainer.train_step(batch)
    resumed = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    checkpoint.load(resumed, path)
    assert isinstance(resumed.critic.optimizer, HostStateAdamW)
    step = resumed.train_step(batch)
    for name in ("critic/loss", "critic/grad_norm", "actor/loss"):
        assert step[name] == pytest.approx(uninterrupted[name], rel=1e-5, abs=1e-7), name
    want = trainer.full_state_dict()
    for name, tensor in resumed.full_state_dict().items():
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=0)
    want = dict(trainer.critic.model.named_parameters())
    for name, param in resumed.critic.model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), want[name].full_tensor(),
                                   atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["params", "optimizer"])
def test_offload_trains_like_plain_on_cuda(tiny_model_dir: Path, mode: str) -> None:
    from asyncrl.net import free_port
    from learners.dist import init_learner_group, shutdown_learner_group

    init_learner_group(0, 1, master_port=free_port(), timeout_s=120.0, device="cuda")
    try:
        _same_training(tiny_model_dir, "cuda", mode)
    finally:
        shutdown_learner_group()
