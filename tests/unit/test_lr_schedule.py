"""The learning-rate schedule: its values, the critic's, and that a resumed learner continues
it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, LossConfig
from learners import checkpoint
from learners.lr_schedule import LrSchedule
from tests.unit.test_checkpoint import _step, one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import tiny_model_dir  # noqa: F401 (fixture)


def test_constant_with_warmup() -> None:
    s = LrSchedule(1e-3, warmup_steps=4, schedule="constant", total_steps=10)
    assert [s.rate(v) for v in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_cosine_decays_to_the_floor() -> None:
    s = LrSchedule(1.0, warmup_steps=2, schedule="cosine", min_ratio=0.1, total_steps=12)
    assert s.rate(0) == 0.5 and s.rate(1) == 1.0
    assert s.rate(2) == pytest.approx(1.0)            # the peak, right after warmup
    assert s.rate(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.rate(12) == pytest.approx(0.1) and s.rate(50) == pytest.approx(0.1)
    rates = [s.rate(v) for v in range(2, 13)]
    assert all(a > b for a, b in zip(rates, rates[1:]))


def test_linear_without_warmup() -> None:
    s = LrSchedule(2.0, schedule="linear", min_ratio=0.0, total_steps=4)
    assert [s.rate(v) for v in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])


def test_config_keys_build_it() -> None:
    cfg = LearnerConfig(lr=0.01, lr_warmup_steps=3, lr_schedule="cosine", lr_min_ratio=0.2,
                        total_steps=9)
    assert LrSchedule.from_config(cfg) == LrSchedule(0.01, 3, "cosine", 0.2, 9)
    with pytest.raises(ValueError, match="lr_schedule"):
        LearnerConfig(lr_schedule="step")


def test_critic_schedule_takes_the_actors_shape() -> None:
    """The critic's own peak and warmup where set, the actor's shape, floor and steps always."""
    from learners.critic import critic_schedule

    cfg = LearnerConfig(lr=0.01, lr_warmup_steps=3, lr_schedule="cosine", lr_min_ratio=0.2,
                        total_steps=9)
    assert critic_schedule(cfg) == LrSchedule(0.01, 3, "cosine", 0.2, 9)
    own = cfg.model_copy(update={"loss": LossConfig(critic_lr=0.1, critic_lr_warmup_steps=0)})
    assert critic_schedule(own) == LrSchedule(0.1, 0, "cosine", 0.2, 9)
    with pytest.raises(ValueError, match="critic_lr_warmup_steps"):
        LossConfig(critic_lr_warmup_steps=-1)


@pytest.mark.usefixtures("one_rank_group")
def test_critic_lr_follows_its_schedule(tiny_model_dir: Path) -> None:
    """GAE: per step, the critic's rate (critic/lr and its AdamW's) and the actor's, by hand.
    Critic: peak 0.1, 1 warmup step, then linear over the 3 left; actor: peak 0.01, 2."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    cfg = LearnerConfig(lr=0.01, lr_warmup_steps=2, lr_schedule="linear", total_steps=4,
                        loss=LossConfig(advantage="gae", critic_lr=0.1,
                                        critic_lr_warmup_steps=1))
    trainer = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    steps = [trainer.train_step(_batch("gae")) for _ in range(4)]
    assert [m["critic/lr"] for m in steps] == pytest.approx([0.1, 0.1, 0.1 * 2 / 3, 0.1 / 3])
    assert [m["actor/lr"] for m in steps] == pytest.approx([0.005, 0.01, 0.01, 0.005])
    assert trainer.critic.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


@pytest.mark.usefixtures("one_rank_group")
def test_resumed_learner_continues_the_schedule(tiny_model_dir: Path, tmp_path: Path) -> None:
    """5 steps straight, and 3 steps + checkpoint + a fresh trainer loading it + 2 steps: the
    same rates (actor/lr) and the same weights."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    cfg = LearnerConfig(lr=1e-2, lr_warmup_steps=2, lr_schedule="cosine", lr_min_ratio=0.1,
                        total_steps=5)
    torch.manual_seed(0)
    straight = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    rates = [straight.train_step(_batch())["actor/lr"] for _ in range(5)]
    assert rates == pytest.approx([LrSchedule.from_config(cfg).rate(v) for v in range(5)])

    torch.manual_seed(0)
    first = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    for _ in range(3):
        _step(first)
    path = checkpoint.save(first, tmp_path, keep=1)
    resumed = Fsdp2Trainer(tiny_model_dir, cfg, "cpu")
    checkpoint.load(resumed, path)
    assert [resumed.train_step(_batch())["actor/lr"] for _ in range(2)] == \
        pytest.approx(rates[3:], rel=1e-12)
    want = straight.full_state_dict()
    for name, tensor in resumed.full_state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=1e-6)


def _batch(advantage: str = "grpo"):
    from learners.batching import collate
    from tests.unit.test_fsdp2 import make_groups

    return collate(make_groups(), std_norm=True, pad_id=0, advantage=advantage)
