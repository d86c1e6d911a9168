"""``learner.compile``: the per-block compiled FSDP2 trainer takes the eager trainer's steps,
and micro-batches of new lengths compile nothing once warm (``perf/compiles``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig
from learners.batching import collate
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import make_groups, tiny_model_dir  # noqa: F401 (fixture)

# Packed micro-batches of 40 tokens: several lengths per step, and other lengths every step.
CFG = LearnerConfig(lr=1e-2, micro_batch_tokens=40, packing=True)
# dynamo's "eager" backend: the compiled graphs, guards and recompiles, without inductor's
# code generation, which takes minutes on the 2-core CI machine (inductor: the GPU check).
BACKEND = "eager"


def _batches():
    for seed in range(3):
        yield collate(make_groups(seed=seed), std_norm=True, pad_id=0)


def _train(model_dir: Path, cfg: LearnerConfig):
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(model_dir, cfg, "cpu")
    metrics = [trainer.train_step(batch) for batch in _batches()]
    return metrics, trainer.full_state_dict()


@pytest.mark.usefixtures("one_rank_group")
def test_compiled_blocks_train_like_eager_without_recompiling(tiny_model_dir: Path) -> None:
    eager_metrics, eager_state = _train(tiny_model_dir, CFG)
    cfg = CFG.model_copy(update={"compile": True, "compile_backend": BACKEND})
    metrics, state = _train(tiny_model_dir, cfg)
    assert "perf/compiles" not in eager_metrics[0]
    assert metrics[0]["perf/compiles"] > 0
    assert [m["perf/compiles"] for m in metrics[1:]] == [0.0, 0.0]
    for step, eager in zip(metrics, eager_metrics):
        assert step["actor/loss"] == pytest.approx(eager["actor/loss"], rel=1e-4, abs=1e-6)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, eager_state[name], atol=1e-5, rtol=0)


@pytest.mark.usefixtures("one_rank_group")
def test_compile_is_refused_where_torch_compile_is_disabled(tmp_path: Path) -> None:
    """TORCH_COMPILE_DISABLE=1 turns dynamo off for the process: learner.compile would then
    train eager without a word, so the trainer refuses at once (no model is read)."""
    import torch._dynamo

    from learners.backends.fsdp2 import Fsdp2Trainer

    with torch._dynamo.config.patch(disable=True), \
            pytest.raises(ValueError, match="learner.compile = true, but torch.compile is "
                                            "disabled.*TORCH_COMPILE_DISABLE"):
        Fsdp2Trainer(tmp_path / "absent", CFG.model_copy(update={"compile": True}), "cpu")
    assert not torch._dynamo.config.disable


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_compiled_blocks_train_on_cuda(tiny_model_dir: Path) -> None:
    """inductor itself, on the device it is meant for (bench/gpu_check.sh runs gpu tests)."""
    from asyncrl.net import free_port
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.dist import init_learner_group, shutdown_learner_group
    init_learner_group(0, 1, master_port=free_port(), timeout_s=120.0, device="cuda")
    try:
        trainer = Fsdp2Trainer(tiny_model_dir, CFG.model_copy(update={"compile": True}), "cuda")
        metrics = [trainer.train_step(b) for b in _batches()]
    finally:
        shutdown_learner_group()
    assert metrics[0]["perf/compiles"] > 0 and metrics[-1]["perf/compiles"] == 0
    assert all(torch.isfinite(torch.tensor(m["actor/loss"])) for m in metrics)
