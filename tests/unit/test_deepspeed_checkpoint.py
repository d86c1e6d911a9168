"""DeepSpeed ZeRO-2/3 training checkpoints over a real 2-rank gloo group: a fresh trainer that
loads step_<V> holds the saved weights, and its next step equals the uninterrupted run's next
step (weights, metrics, and every rank's AdamW moments in ZeRO's partitions), so the optimizer
state and its step count came back too. The layout is ``learners.checkpoint``'s: atomic
``step_<V>`` with ``meta.json`` (format "deepspeed"), pruned to ``keep``.

Cost: ~15 s per stage after DeepSpeed's first-use comm op build (~20 s, cached in
``~/.cache/torch_extensions``); the stages take turns on the same 2 processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is optional: DS_BUILD_OPS=0 pip install "
                                        "--no-build-isolation deepspeed==0.19.8")

from learners import checkpoint
from learners.batching import collate
from tests.unit import test_fsdp2
from tests.unit.test_deepspeed import CFG
from tests.unit.test_fsdp2 import WALL_CLOCK, rank_groups, spawn_runs

tiny_model_dir = test_fsdp2.tiny_model_dir

SAVE_AT = 2          # steps before the checkpoint (a first one at step 1 is pruned: keep = 1)
STAGES = (2, 3)
ZERO_OVERRIDES = {"stage3_param_persistence_threshold": 0}  # really partition the tiny model


def _moments(trainer) -> list[torch.Tensor]:
    """This rank's AdamW state (its ZeRO partition): exp_avg, exp_avg_sq and step."""
    base = trainer.optimizer.optimizer   # ZeRO's wrapper around the client torch AdamW
    return [tensor.detach().clone() for state in base.state.values()
            for _, tensor in sorted(state.items()) if torch.is_tensor(tensor)]


def run_rank(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
             stage: int) -> None:
    """Train SAVE_AT steps with checkpoints, take one more step; then a fresh trainer loads the
    checkpoint and takes that step again. Everything to compare goes to ``rank<r>.pt``."""
    from learners.backends.deepspeed import DeepSpeedTrainer

    cfg = CFG.model_copy(update={"backend": "deepspeed", "zero_stage": stage})
    directory = Path(out_dir) / "checkpoints"
    batch = collate(rank_groups(rank, world), std_norm=cfg.advantage_std_norm, pad_id=0)
    first = DeepSpeedTrainer(model_dir, cfg, device, zero_overrides=ZERO_OVERRIDES)
    for _ in range(SAVE_AT):
        first.train_step(batch)
        path = checkpoint.save(first, directory, keep=1, cfg_hash="h",
                               counters={"groups_consumed": first.version * 4})
    saved = first.full_state_dict()
    rng_expected = torch.rand(4)
    next_metrics, next_state = first.train_step(batch), first.full_state_dict()
    next_moments = _moments(first)

    resumed = DeepSpeedTrainer(model_dir, cfg, device, zero_overrides=ZERO_OVERRIDES)
    meta = checkpoint.load(resumed, path)
    loaded, rng = resumed.full_state_dict(), torch.rand(4)
    resumed_metrics = resumed.train_step(batch)
    torch.save({"path": str(path), "meta_version": meta.version, "saved": saved,
                "loaded": loaded, "rng": (rng_expected, rng),
                "next": (next_metrics, next_state, next_moments, first.version),
                "resumed": (resumed_metrics, resumed.full_state_dict(), _moments(resumed),
                            resumed.version)},
               Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """ZeRO-2 and ZeRO-3, in turn on the same 2 ranks."""
    dirs = spawn_runs(run_rank, tiny_model_dir, tmp_path_factory.mktemp("ds_ckpt"),
                      {f"zero{stage}": (2, (stage,)) for stage in STAGES}, timeout_s=120.0)
    return {stage: dirs[f"zero{stage}"] for stage in STAGES}


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("stage", STAGES)
def test_resumed_step_equals_the_uninterrupted_step(runs: dict[int, Path], stage: int) -> None:
    ranks = [_load(runs[stage] / f"rank{r}.pt") for r in range(2)]
    rank0 = ranks[0]
    assert rank0["meta_version"] == SAVE_AT
    assert set(rank0["loaded"]) == set(rank0["saved"])
    for name, tensor in rank0["saved"].items():
        assert torch.equal(rank0["loaded"][name], tensor), name
    next_metrics, next_state, _, next_version = rank0["next"]
    resumed_metrics, resumed_state, _, resumed_version = rank0["resumed"]
    assert next_version == resumed_version == SAVE_AT + 1
    moved = max((next_state[k] - rank0["saved"][k]).abs().max().item() for k in next_state)
    assert moved > 1e-4   # the step changed the weights far more than the tolerance below
    for name, tensor in next_state.items():
        torch.testing.assert_close(resumed_state[name], tensor, rtol=0, atol=1e-6)
    for key, value in next_metrics.items():
        if key not in WALL_CLOCK:
            assert resumed_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    for rank in ranks:   # every rank's own optimizer partition continued, step count included
        expected, got = rank["next"][2], rank["resumed"][2]
        assert len(got) == len(expected) > 0
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(rank["rng"][1], rank["rng"][0])


@pytest.mark.parametrize("stage", STAGES)
def test_layout_is_atomic_pruned_and_says_deepspeed(runs: dict[int, Path], stage: int) -> None:
    directory = runs[stage] / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == [f"step_{SAVE_AT}"]  # step_1 pruned
    step = directory / f"step_{SAVE_AT}"
    meta = checkpoint.read_meta(step)
    assert (meta.format, meta.world, meta.version) == ("deepspeed", 2, SAVE_AT)
    assert meta.counters == {"groups_consumed": SAVE_AT * 4} and len(meta.rng) == 2
    assert sorted(p.name for p in (step / "deepspeed").glob("*optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]


@pytest.mark.parametrize("stage", STAGES)
def test_weights_read_without_a_process_group_for_eval(runs: dict[int, Path],
                                                       tiny_model_dir: Path, stage: int) -> None:
    """What ``asyncrl eval --checkpoint step_<V>`` loads: the merged partitions, strictly."""
    from transformers import AutoModelForCausalLM

    from learners.backends.deepspeed import checkpoint_weights

    saved = _load(runs[stage] / "rank0.pt")["saved"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.load_state_dict(checkpoint_weights(runs[stage] / "checkpoints" / f"step_{SAVE_AT}"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
