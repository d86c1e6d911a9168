"""Rank 0 balances one batch across 2 gloo ranks, which micro-batch and pack it: the step must
equal one rank's unbatched step on the same batch.

Tolerance: updated weights within 1e-5 absolute and every metric within 1e-4 relative after
3 AdamW steps (lr 1e-3), fp32. Packing changes only the shapes of the matmuls (one row of
concatenated sequences instead of padded rows), so differences are float rounding (~1e-7).
Group-level aggregation is used because it is the case a sequence-level split could break: the
groups' rows land on different ranks and in different micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, LossConfig
from learners.balance import split_batch
from learners.batching import collate
from learners.packing import plan_micro_batches
from tests.unit.test_fsdp2 import (  # noqa: F401 (fixture)
    WALL_CLOCK,
    _initial_state,
    make_groups,
    spawn_runs,
    step_flops,
    tiny_model_dir,
)

pytestmark = pytest.mark.slow   # 25-60 s on the loaded 2-core box (3 processes)

STEPS = 3
BASE = LearnerConfig(lr=1e-3, grad_clip=1.0, clip_eps=0.2,
                     loss=LossConfig(aggregation="group", clip_eps_high=0.28),
                     micro_batch_tokens=0, packing=False)
RUNS = {   # name: (world, config)
    # The reference: unbatched, full logits (the others run the chunked LM head).
    "unbatched": (1, BASE.model_copy(update={"logprob_chunk_tokens": 0})),
    "packed": (2, BASE.model_copy(update={"micro_batch_tokens": 16, "packing": True})),
    "padded": (2, BASE.model_copy(update={"micro_batch_tokens": 20, "packing": False})),
    "checkpointed": (1, BASE.model_copy(update={"activation_checkpointing": True,
                                                "micro_batch_tokens": 24, "packing": True})),
    "bf16": (1, BASE.model_copy(update={"mixed_precision": "bf16"})),
    # LM head 3 tokens at a time under FSDP2: its gradient reduced across the ranks.
    "chunked": (2, BASE.model_copy(update={"micro_batch_tokens": 16, "packing": True,
                                           "logprob_chunk_tokens": 3})),
}


def run_rank(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
             cfg: LearnerConfig) -> None:
    """One learner rank: rank 0 collates the whole batch and scatters balanced shares."""
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.balance import scatter_batch

    trainer = Fsdp2Trainer(model_dir, cfg, device)
    metrics = []
    for _ in range(STEPS):
        whole = collate(make_groups(), std_norm=True, pad_id=0) if rank == 0 else None
        metrics.append(trainer.train_step(scatter_batch(whole, rank, world)))
    state = trainer.full_state_dict()
    torch.save({"metrics": metrics, "state": state}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every run of RUNS (3 processes: the runs of one world size take turns)."""
    dirs = spawn_runs(run_rank, tiny_model_dir, tmp_path_factory.mktemp("balanced"),
                      {name: (world, (cfg,)) for name, (world, cfg) in RUNS.items()})
    return {name: torch.load(dirs[name] / "rank0.pt", weights_only=False) for name in RUNS}


def test_shares_are_balanced_and_micro_batched() -> None:
    batch = collate(make_groups(), std_norm=True, pad_id=0)
    shares = split_batch(batch, 2)
    loads = [int(s.lengths.sum()) for s in shares]
    assert abs(loads[0] - loads[1]) <= int(batch.lengths.max())
    # Each group's rows are spread over both ranks: the group-aggregation case is exercised.
    split_groups = set(shares[0].group_index.tolist()) & set(shares[1].group_index.tolist())
    assert split_groups
    assert all(len(plan_micro_batches(s.lengths.tolist(), 16, True)) > 1 for s in shares)


@pytest.mark.parametrize("name", ["packed", "padded", "checkpointed", "chunked"])
def test_matches_unbatched_one_rank(runs: dict[str, dict], tiny_model_dir: Path,
                                   name: str) -> None:
    single, other = runs["unbatched"], runs[name]
    initial = _initial_state(tiny_model_dir)
    assert set(other["state"]) == set(initial)
    for key, tensor in single["state"].items():
        torch.testing.assert_close(other["state"][key], tensor, atol=1e-5, rtol=0)
    moved = max((single["state"][n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3   # training moved the weights far more than the tolerance
    for step_single, step_other in zip(single["metrics"], other["metrics"]):
        for key, value in step_single.items():
            if key not in WALL_CLOCK:
                assert step_other[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_the_runs_count_the_model_flops_of_one_batch(runs: dict[str, dict]) -> None:
    """perf/tflops: however the batch is split over ranks and micro-batches, and whether
    activations are recomputed or the logits chunked, a step's model FLOPs are the same. The
    unbatched run's full logits run the LM head on every token, prompts too: more."""
    fused = [step_flops(runs[name]["metrics"][0], RUNS[name][0])
             for name in ("checkpointed", "packed", "padded", "chunked", "bf16")]
    assert fused == pytest.approx([fused[0]] * len(fused), rel=1e-9)
    assert step_flops(runs["unbatched"]["metrics"][0], 1) > fused[0] * (1 + 1e-6)


def test_bf16_mixed_precision_trains_close_to_fp32(runs: dict[str, dict],
                                                  tiny_model_dir: Path) -> None:
    """bf16 is a different computation, so no equality: fp32 master weights, the first loss
    (same weights, bf16 forward) within bf16's precision, and the 3-step update pointing the
    same way as fp32's (Adam turns tiny gradient differences into ±lr steps on some entries)."""
    fp32, bf16 = runs["unbatched"], runs["bf16"]
    initial = _initial_state(tiny_model_dir)
    assert all(t.dtype == torch.float32 for t in bf16["state"].values())   # fp32 master weights
    delta_fp32 = torch.cat([(fp32["state"][n] - initial[n]).flatten() for n in initial])
    delta_bf16 = torch.cat([(bf16["state"][n] - initial[n]).flatten() for n in initial])
    assert torch.cosine_similarity(delta_fp32, delta_bf16, dim=0) > 0.9
    first = fp32["metrics"][0]["actor/loss"]
    assert bf16["metrics"][0]["actor/loss"] == pytest.approx(first, abs=2e-2)
    # ...but not identical: the forward really ran in bf16.
    assert bf16["metrics"][0]["actor/loss"] != first
