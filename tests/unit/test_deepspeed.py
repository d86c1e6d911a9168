"""DeepSpeed ZeRO-2/3 over real gloo process groups: two ranks on half a batch each take the same
steps as the FSDP2 trainer on one rank with the whole batch (same objective, same normalisation).

Equal ``actor/grad_norm`` (pre-clip) catches a gradient off by the world size, which Adam's
scale invariance would hide from the weights alone. ZeRO-3 runs with
``stage3_param_persistence_threshold = 0`` so that the tiny model's parameters really are
partitioned (by default DeepSpeed keeps parameters under 1e5 elements whole on every rank).

Cost: ~50 s on 2 cores. The trainer keeps DeepSpeed from compiling its CPU shared-memory
comm op, which training never uses (``skip_shm_comm_op``; the compile took ~60 s on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is optional: DS_BUILD_OPS=0 pip install "
                                        "--no-build-isolation deepspeed==0.19.8")

from asyncrl.config.schema import LearnerConfig, LossConfig
from learners.batching import collate
from tests.unit import test_fsdp2
from tests.unit.test_fsdp2 import STEPS, WALL_CLOCK, rank_groups, spawn_runs, step_flops

# The same tiny Qwen2 (a module-scoped fixture), registered here under the same name.
tiny_model_dir = test_fsdp2.tiny_model_dir

# KL to the frozen reference and decoupled PPO: every objective input the backend computes.
CFG = LearnerConfig(lr=1e-3, grad_clip=1.0, clip_eps=0.2,
                    loss=LossConfig(policy_loss="decoupled_ppo", kl_coef=0.5, tis_cap=1.5))
WEIGHT_ATOL = 1e-5   # max abs difference of any weight after STEPS steps (fp32)
METRIC_REL = 1e-4


def run_rank(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
             backend: str, stage: int, micro_tokens: int, packing: bool,
             reject_all: bool = False) -> None:
    """One learner rank: STEPS steps, then metrics, full state dict and an HF export
    (``reject_all``: a correction band no token's ratio hits, as test_fsdp2's)."""
    from learners.backends import make_trainer
    from learners.backends.base import Trainer

    cfg = CFG.model_copy(update={"backend": backend, "zero_stage": stage,
                                 "micro_batch_tokens": micro_tokens, "packing": packing})
    if reject_all:
        # weight decay: what AdamW's step on a zero gradient would still apply
        cfg = cfg.model_copy(update={"loss": test_fsdp2.VARIANTS["all_rejected"].loss,
                                     "weight_decay": 0.1})
    if backend == "deepspeed":
        from learners.backends.deepspeed import DeepSpeedTrainer
        trainer = DeepSpeedTrainer(model_dir, cfg, device,
                                   zero_overrides={"stage3_param_persistence_threshold": 0})
    else:
        trainer = make_trainer(model_dir, cfg, device)
    assert isinstance(trainer, Trainer)
    forwards = [0]   # policy forwards through the DeepSpeed engine: one per micro-batch
    if backend == "deepspeed":
        trainer.engine.register_forward_pre_hook(lambda *_: forwards.__setitem__(0,
                                                                             forwards[0] + 1))
    batch = collate(rank_groups(rank, world), std_norm=cfg.advantage_std_norm, pad_id=0)
    metrics = [trainer.train_step(batch) for _ in range(STEPS)]
    state = trainer.full_state_dict()
    every = trainer.full_state_dict(every_rank=True)   # what weights.fanout sends
    trainer.save_pretrained(Path(out_dir) / "checkpoint")
    # Elements this rank holds in the module's weights: 0 once ZeRO-3 has partitioned them.
    held = sum(p.data.numel() for p in trainer.model.parameters())
    torch.save({"metrics": metrics, "state": state, "every": every, "version": trainer.version,
                "held": held, "forwards": forwards[0]}, Path(out_dir) / f"rank{rank}.pt")


# name → (backend, stage, world, micro_batch_tokens, packing[, reject_all]). The baseline is one
# micro-batch; the *_micro runs split each rank's share (<= 54 tokens) into several, a different
# number on each rank (the shorter rank adds zero-weight ones), through DeepSpeed's accumulation
# boundary. zero2_w2_rejected: every token rejected by the rollout correction.
RUNS = {"fsdp2_w1": ("fsdp2", 2, 1, 0, False), "zero2_w2": ("deepspeed", 2, 2, 0, False),
        "zero3_w2": ("deepspeed", 3, 2, 0, False),
        "zero2_w2_micro": ("deepspeed", 2, 2, 12, False),
        "zero3_w2_micro": ("deepspeed", 3, 2, 16, True),
        "zero2_w2_rejected": ("deepspeed", 2, 2, 0, False, True)}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The FSDP2 baseline, ZeRO-2 and ZeRO-3, each of them with and without micro-batches (3
    processes: the DeepSpeed runs take turns on 2 ranks)."""
    return spawn_runs(run_rank, tiny_model_dir, tmp_path_factory.mktemp("ds"),
                      {name: (world, (backend, stage, micro, packing, *rest))
                       for name, (backend, stage, world, micro, packing, *rest) in RUNS.items()})


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("name", ["zero2_w2", "zero3_w2", "zero2_w2_micro", "zero3_w2_micro"])
def test_zero_two_ranks_match_fsdp2_one_rank(runs: dict[str, Path], tiny_model_dir: Path,
                                            name: str) -> None:
    from safetensors.torch import load_file

    base, run = _load(runs["fsdp2_w1"] / "rank0.pt"), _load(runs[name] / "rank0.pt")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert base["version"] == run["version"] == STEPS
    assert set(run["state"]) == set(base["state"]) == set(initial)
    for key, tensor in base["state"].items():
        torch.testing.assert_close(run["state"][key], tensor, atol=WEIGHT_ATOL, rtol=0)
    moved = max((base["state"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * WEIGHT_ATOL   # training moved the weights far more than the tolerance
    for step_base, step_run in zip(base["metrics"], run["metrics"], strict=True):
        assert step_run.keys() == step_base.keys()
        for key, value in step_base.items():
            if key not in WALL_CLOCK:
                assert step_run[key] == pytest.approx(value, rel=METRIC_REL, abs=1e-6), key
        assert step_flops(step_run, 2) == pytest.approx(step_flops(step_base, 1), rel=1e-9)
    assert run["metrics"][-1]["actor/kl_loss"] > 0


@pytest.mark.parametrize("name", ["zero2_w2", "zero3_w2"])
def test_zero_rank0_only_state_and_reloadable_export(runs: dict[str, Path], name: str) -> None:
    from transformers import AutoModelForCausalLM

    rank0, rank1 = _load(runs[name] / "rank0.pt"), _load(runs[name] / "rank1.pt")
    assert rank1["state"] == {}
    full = sum(t.numel() for t in rank0["state"].values())
    assert rank1["held"] == (0 if name == "zero3_w2" else full)   # ZeRO-3 really shards
    assert rank0["metrics"] == rank1["metrics"]
    reloaded = AutoModelForCausalLM.from_pretrained(runs[name] / "checkpoint").state_dict()
    for key, tensor in rank0["state"].items():
        assert torch.equal(reloaded[key], tensor), key


@pytest.mark.parametrize("name", ["zero2_w2", "zero3_w2_micro"])
def test_zero_every_rank_state_is_rank0s(runs: dict[str, Path], name: str) -> None:
    """``weights.fanout``: ``full_state_dict(every_rank=True)`` gives each rank the full
    weights, equal to rank 0's plain gather, also where ZeRO-3 partitioned them."""
    rank0, rank1 = _load(runs[name] / "rank0.pt"), _load(runs[name] / "rank1.pt")
    assert rank1["held"] == (0 if name.startswith("zero3") else
                             sum(t.numel() for t in rank0["state"].values()))
    for rank in (rank0, rank1):
        assert rank["every"].keys() == rank0["state"].keys()
        for key, tensor in rank0["state"].items():
            assert torch.equal(rank["every"][key], tensor), key


def test_make_trainer_routes_deepspeed_and_rejects_gae() -> None:
    from learners.backends import make_trainer

    cfg = CFG.model_copy(update={"backend": "deepspeed",
                                 "loss": LossConfig(advantage="gae")})
    with pytest.raises(NotImplementedError, match="GAE"):   # before any collective
        make_trainer("unused", cfg, "cpu")


@pytest.mark.parametrize("name", ["zero2_w2", "zero3_w2", "zero2_w2_micro", "zero3_w2_micro"])
def test_zero_runs_the_micro_batch_plan(runs: dict[str, Path], name: str) -> None:
    """Each rank runs as many policy forwards per step as the rank with the most micro-batches
    (the others add zero-weight ones): with ``micro_batch_tokens`` ignored it would be one,
    and the equality with FSDP2 above would still hold."""
    from learners.packing import micro_batches

    _, _, world, tokens, packing = RUNS[name]
    plans = [micro_batches(collate(rank_groups(r, world), std_norm=True, pad_id=0), tokens,
                           packing) for r in range(world)]
    expected = max(len(plan) for plan in plans)
    assert expected == 1 if tokens == 0 else expected > 1
    for rank in range(world):
        assert _load(runs[name] / f"rank{rank}.pt")["forwards"] == expected * STEPS


def test_the_cpu_shared_memory_op_is_not_built() -> None:
    """Only tensor-parallel inference uses DeepSpeed's CPU shared-memory all-reduce; building
    it cost the first DeepSpeed run on a machine 20-80 s of g++ (82 s of this test file's
    setup in CI on 2 cores). The trainer marks it incompatible before DeepSpeed wraps the
    process group: the function that would build it then builds nothing."""
    from deepspeed.comm.torch import build_shm_op

    from learners.backends.deepspeed import skip_shm_comm_op

    skip_shm_comm_op()
    assert build_shm_op() is None


def test_zero_all_rejected_steps_train_nothing(runs: dict[str, Path],
                                              tiny_model_dir: Path) -> None:
    """Every token rejected by the correction: ZeRO steps at learning rate 0, so not one
    weight moves (before, AdamW's step on the zero gradient still did), and the clock goes on."""
    run = _load(runs["zero2_w2_rejected"] / "rank0.pt")
    initial = test_fsdp2._initial_state(tiny_model_dir)
    assert all(torch.equal(run["state"][n], initial[n]) for n in initial)
    for metrics in run["metrics"]:
        assert metrics["mismatch/kept_tokens"] == 0.0 < metrics["mismatch/tokens"]
        assert metrics["actor/lr"] == 0.0
    assert run["version"] == STEPS
