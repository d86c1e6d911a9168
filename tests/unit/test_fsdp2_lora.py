"""LoRA under FSDP2 over real gloo groups: 2 ranks match 1 rank, only the adapters train, the
adapters and the merged weights agree, the HF export loads with ``from_pretrained``, and a DCP
checkpoint round trip resumes the adapters and their AdamW moments exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import Config, LearnerConfig, LoraConfig, LossConfig, ModelConfig
from asyncrl.weights.lora_wire import merge, split_adapters
from learners import checkpoint
from learners.batching import collate
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import (  # noqa: F401 (fixture)
    WALL_CLOCK,
    _initial_state,
    make_groups,
    rank_groups,
    spawn_runs,
    step_flops,
    tiny_model_dir,
)

STEPS = 3
CFG = LearnerConfig(lr=1e-2, grad_clip=1.0, clip_eps=0.2)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
# One-rank variants: recomputed activations (must not change a thing: non-reentrant checkpointing
# lets gradients reach adapters whose layer inputs need none), and LoRA beside the frozen
# reference (KL) and the fully trained GAE critic.
VARIANTS = {
    "checkpointing": CFG.model_copy(update={"activation_checkpointing": True}),
    "kl_gae": CFG.model_copy(update={"loss": LossConfig(kl_coef=0.5, advantage="gae")}),
    # KL against a loaded copy of the base (reference_path given), not the adapters-off policy
    "kl_copy": CFG.model_copy(update={"loss": LossConfig(kl_coef=0.5)}),
    "kl_base": CFG.model_copy(update={"loss": LossConfig(kl_coef=0.5)}),
}


def run_rank(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
             cfg: LearnerConfig = CFG, reference_path: str | None = None) -> None:
    """One LoRA learner rank: STEPS steps; metrics, merged state, adapters, HF export."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(model_dir, cfg, device, lora=LORA, reference_path=reference_path)
    batch = collate(rank_groups(rank, world), std_norm=True, pad_id=0,
                    advantage=cfg.loss.advantage)
    metrics = [trainer.train_step(batch) for _ in range(STEPS)]
    state, adapters = trainer.full_state_dict(), trainer.adapter_state_dict()
    trainer.save_pretrained(Path(out_dir) / "hf")
    optimized = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    torch.save({"metrics": metrics, "state": state, "adapters": adapters,
                "optimized": optimized, "version": trainer.version,
                "reference_copy": trainer.reference is not None},
               Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[int | str, Path]:
    """The 1-rank and the 2-rank LoRA run, and each 1-rank variant (3 processes: the 1-rank
    runs take turns in one)."""
    worlds = {1: (1, CFG), 2: (2, CFG), **{name: (1, cfg) for name, cfg in VARIANTS.items()}}
    dirs = spawn_runs(run_rank, tiny_model_dir, tmp_path_factory.mktemp("lora"),
                      {str(key): (world, (cfg, str(tiny_model_dir) if key == "kl_copy" else None))
                       for key, (world, cfg) in worlds.items()})
    return {key: dirs[str(key)] for key in worlds}


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_two_ranks_match_one_rank(runs: dict[int | str, Path]) -> None:
    single, multi = _load(runs[1] / "rank0.pt"), _load(runs[2] / "rank0.pt")
    assert single["version"] == multi["version"] == STEPS
    for key in ("state", "adapters"):
        assert set(single[key]) == set(multi[key])
        for name, tensor in single[key].items():
            torch.testing.assert_close(multi[key][name], tensor, atol=1e-5, rtol=0)
    for step_single, step_multi in zip(single["metrics"], multi["metrics"]):
        for name, value in step_single.items():
            if name not in WALL_CLOCK:
                assert step_multi[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        assert step_flops(step_multi, 2) == pytest.approx(step_flops(step_single, 1), rel=1e-9)
    assert _load(runs[2] / "rank1.pt")["adapters"] == {}   # rank 0 only, like the state


def test_only_adapters_train(runs: dict[int | str, Path], tiny_model_dir: Path) -> None:
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


def test_hf_export_is_the_merged_model(runs: dict[int | str, Path]) -> None:
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
    saved = trainer.full_state_dict()
    step(trainer)   # the step the resumed trainer must reproduce: needs adapters AND moments
    expected = trainer.adapter_state_dict()

    resumed = Fsdp2Trainer(tiny_model_dir, CFG, "cpu", lora=LORA)
    assert checkpoint.load(resumed, path).version == resumed.version == 2
    step(resumed)
    got = resumed.adapter_state_dict()
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    # `asyncrl eval --checkpoint` reads the LoRA checkpoint as the merged plain model.
    from asyncrl.eval_checkpoint import load_policy

    cfg = Config(model=ModelConfig(path=str(tiny_model_dir), lora=LORA))
    model, version, _ = load_policy(cfg, path)
    assert version == 2 and type(model).__name__ == "Qwen2ForCausalLM"
    state = model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6)


def test_activation_checkpointing_changes_nothing(runs: dict[int | str, Path]) -> None:
    plain, recomputed = _load(runs[1] / "rank0.pt"), _load(runs["checkpointing"] / "rank0.pt")
    for name, tensor in plain["adapters"].items():
        torch.testing.assert_close(recomputed["adapters"][name], tensor, atol=1e-6, rtol=0)


def test_lora_beside_reference_and_critic(runs: dict[int | str, Path],
                                          tiny_model_dir: Path) -> None:
    run = _load(runs["kl_gae"] / "rank0.pt")
    kl = [m["actor/kl_loss"] for m in run["metrics"]]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 0   # the base IS the reference
    assert run["metrics"][-1]["critic/values/mean"] != 0.0          # the critic trains
    initial = _initial_state(tiny_model_dir)
    assert torch.equal(run["state"]["model.embed_tokens.weight"],
                       initial["model.embed_tokens.weight"])


def test_kl_reference_is_the_base_with_adapters_off(runs: dict[int | str, Path]) -> None:
    """Under LoRA the KL reference is the policy with its adapters off (no model copy): it
    trains exactly as against a loaded copy of the base model."""
    base, copy = _load(runs["kl_base"] / "rank0.pt"), _load(runs["kl_copy"] / "rank0.pt")
    assert not base["reference_copy"] and copy["reference_copy"]
    kl = [m["actor/kl_loss"] for m in base["metrics"]]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 0
    for step_base, step_copy in zip(base["metrics"], copy["metrics"]):
        for name in ("actor/kl_loss", "actor/loss", "actor/grad_norm"):
            assert step_base[name] == pytest.approx(step_copy[name], rel=1e-5, abs=1e-7), name
    for name, tensor in copy["adapters"].items():
        torch.testing.assert_close(base["adapters"][name], tensor, atol=1e-6, rtol=0)
