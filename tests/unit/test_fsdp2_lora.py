"""LoRA under FSDP2 over real gloo groups: 2 ranks match 1 rank, only the adapters train, the
adapters and the merged weights agree, the HF export loads with ``from_pretrained``, and a DCP
checkpoint round trip resumes the adapters and their AdamW moments exactly."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, LoraConfig
from learners import checkpoint
from learners.batching import collate
from learners.dist import free_port
from learners.lora_wire import merge, split_adapters
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import (  # noqa: F401 (fixture)
    _initial_state,
    join_all,
    make_groups,
    rank_groups,
    tiny_model_dir,
)

STEPS = 3
CFG = LearnerConfig(lr=1e-2, grad_clip=1.0, clip_eps=0.2)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


def run_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One LoRA learner process: STEPS steps; metrics, merged state, adapters, HF export."""
    torch.set_num_threads(1)
    from learners.backends.fsdp2 import Fsdp2Trainer
    from learners.dist import init_learner_group, shutdown_learner_group

    device = init_learner_group(rank, world, master_port=port, timeout_s=60.0)
    try:
        trainer = Fsdp2Trainer(model_dir, CFG, device, lora=LORA)
        batch = collate(rank_groups(rank, world), std_norm=True, pad_id=0)
        metrics = [trainer.train_step(batch) for _ in range(STEPS)]
        state, adapters = trainer.full_state_dict(), trainer.adapter_state_dict()
        trainer.save_pretrained(Path(out_dir) / "hf")
        optimized = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
        torch.save({"metrics": metrics, "state": state, "adapters": adapters,
                    "optimized": optimized, "version": trainer.version},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown_learner_group()


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The 1-rank and the 2-rank LoRA run at once (3 processes)."""
    ctx = mp.get_context("spawn")
    out, procs = {}, []
    for world in (1, 2):
        out[world] = tmp_path_factory.mktemp("lora") / f"world{world}"
        out[world].mkdir()
        port = free_port()
        procs += [ctx.Process(target=run_rank,
                              args=(r, world, port, str(tiny_model_dir), str(out[world])))
                  for r in range(world)]
    for proc in procs:
        proc.start()
    join_all(procs)
    return out


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_two_ranks_match_one_rank(runs: dict[int, Path]) -> None:
    single, multi = _load(runs[1] / "rank0.pt"), _load(runs[2] / "rank0.pt")
    assert single["version"] == multi["version"] == STEPS
    for key in ("state", "adapters"):
        assert set(single[key]) == set(multi[key])
        for name, tensor in single[key].items():
            torch.testing.assert_close(multi[key][name], tensor, atol=1e-5, rtol=0)
    for step_single, step_multi in zip(single["metrics"], multi["metrics"]):
        for name, value in step_single.items():
            if name != "timing/train_step":
                assert step_multi[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert _load(runs[2] / "rank1.pt")["adapters"] == {}   # rank 0 only, like the state


def test_only_adapters_train(runs: dict[int, Path], tiny_model_dir: Path) -> None:
    run, initial = _load(runs[2] / "rank0.pt"), _initial_state(tiny_model_dir)
    adapters, _ = split_adapters(run["adapters"].items())
    assert run["optimized"] == sum(a.numel() + b.numel() for a, b in adapters.values())
    assert set(run["state"]) == set(initial)   # plain HF names, no peft ones
    targeted = {n for n in initial if n.split(".")[-2] in LORA.target_modules
                and n.endswith(".weight")}
    assert set(adapters) == targeted
    for name, tensor in initial.items():
        if name in targeted:
            moved = (run["state"][name] - tensor).abs().max().item()
            assert moved > 1e-4, name   # B started at 0: training moved it
            lora_a, scaled_b = adapters[name]
            torch.testing.assert_close(run["state"][name], merge(tensor, lora_a, scaled_b),
                                       rtol=0, atol=1e-6)
        else:
            assert torch.equal(run["state"][name], tensor), name   # frozen, exactly


def test_hf_export_is_the_merged_model(runs: dict[int, Path]) -> None:
    from transformers import AutoModelForCausalLM

    state = _load(runs[2] / "rank0.pt")["state"]
    reloaded = AutoModelForCausalLM.from_pretrained(runs[2] / "hf").state_dict()
    for name, tensor in state.items():
        assert torch.equal(reloaded[name], tensor), name


@pytest.mark.usefixtures("one_rank_group")
def test_checkpoint_round_trip_resumes_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer

    def step(trainer) -> None:
        trainer.train_step(collate(make_groups(), std_norm=True, pad_id=0))

    trainer = Fsdp2Trainer(tiny_model_dir, CFG, "cpu", lora=LORA)
    step(trainer)
    step(trainer)
    path = checkpoint.save(trainer, tmp_path, keep=2, cfg_hash="lora")
    step(trainer)   # the step the resumed trainer must reproduce: needs adapters AND moments
    expected = trainer.adapter_state_dict()

    resumed = Fsdp2Trainer(tiny_model_dir, CFG, "cpu", lora=LORA)
    assert checkpoint.load(resumed, path).version == resumed.version == 2
    step(resumed)
    got = resumed.adapter_state_dict()
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
