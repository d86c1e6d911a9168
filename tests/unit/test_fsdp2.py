"""FSDP2 over real gloo process groups: two ranks on half a batch each == one rank on all of it.

Since Adam is nearly invariant to the gradient's scale, equal weights alone would not catch a
gradient that is off by the world size; equal ``actor/grad_norm`` metrics do (they are taken
before clipping), so both are compared.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.config.schema import CorrectionConfig, LearnerConfig, LossConfig
from asyncrl.net import ReservedPort
from asyncrl.wire import TrajectoryGroup
from learners.batching import collate
from tests.ranks import rank_context

STEPS = 3
VOCAB = 16
JOIN_TIMEOUT_S = 120.0
CFG = LearnerConfig(lr=1e-3, grad_clip=1.0, clip_eps=0.2)
# One-rank variants: KL to the frozen (sharded) reference; decoupled PPO with group aggregation.
VARIANTS = {
    "kl": CFG.model_copy(update={"loss": LossConfig(kl_coef=0.5, kl_estimator="k3")}),
    "decoupled": CFG.model_copy(update={"loss": LossConfig(policy_loss="decoupled_ppo",
                                                           aggregation="group", tis_cap=1.5)}),
    # A band no token's ratio hits (exactly 1): every token rejected, the step trains nothing.
    "all_rejected": CFG.model_copy(update={"loss": LossConfig(correction=CorrectionConfig(
        mask="token", mask_low=1.0, mask_high=1.0))}),
    # The entropy bonus differentiates the entropy of the packed forward.
    "entropy": CFG.model_copy(update={"packing": True, "loss": LossConfig(entropy_coeff=0.5)}),
}
# 1 rank vs 2 ranks again, with per-sample units, the reference and the GAE critic sharded over
# both ranks.
SEQ_KL = CFG.model_copy(update={"loss": LossConfig(aggregation="sequence", kl_coef=0.5,
                                                   clip_eps_high=0.28, advantage="gae")})


def make_groups(n_groups: int = 4, group_size: int = 3, seed: int = 0) -> list[TrajectoryGroup]:
    """Deterministic groups with uneven completion lengths, so the ranks' token counts differ."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        samples = []
        for _ in range(group_size):
            prompt, gen = 3, int(rng.integers(1, 7))
            samples.append({
                "tokens": rng.integers(0, VOCAB, prompt + gen), "reward": float(rng.random()),
                "logprobs": np.r_[np.zeros(prompt), -np.log(VOCAB) + rng.normal(0, 0.4, gen)],
                "loss_mask": np.r_[np.zeros(prompt), np.ones(gen)],
                "versions": np.r_[-np.ones(prompt), np.zeros(gen)], "finish_reason": "stop"})
        groups.append(TrajectoryGroup.from_samples(f"g{g}", f"p{g}", samples))
    return groups


def rank_groups(rank: int, world: int) -> list[TrajectoryGroup]:
    """This rank's share, split at group boundaries (advantages are per group)."""
    groups = make_groups()
    share = len(groups) // world
    return groups[rank * share:(rank + 1) * share]


def run_rank(rank: int, world: int, device: torch.device, model_dir: str, out_dir: str,
             cfg: LearnerConfig = CFG) -> None:
    """One learner rank: train STEPS steps, write metrics, state dict and a checkpoint."""
    from learners.backends.fsdp2 import Fsdp2Trainer

    trainer = Fsdp2Trainer(model_dir, cfg, device)
    batch = collate(rank_groups(rank, world), std_norm=cfg.advantage_std_norm, pad_id=0,
                    advantage=cfg.loss.advantage)
    metrics = [trainer.train_step(batch) for _ in range(STEPS)]
    state = trainer.full_state_dict()
    # Written from the state just gathered (what the end of a run does), not re-gathered.
    trainer.save_pretrained(Path(out_dir) / "checkpoint", state=state)
    torch.save({"metrics": metrics, "state": state, "version": trainer.version},
               Path(out_dir) / f"rank{rank}.pt")


def join_all(procs: list[mp.process.BaseProcess], timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Wait for our own processes; kill (by handle) any that hang, then fail."""
    for proc in procs:
        proc.join(timeout_s)
    hung = [p for p in procs if p.is_alive()]
    for proc in hung:
        proc.kill()
        proc.join()
    assert not hung, f"{len(hung)} learner processes hung"
    assert [p.exitcode for p in procs] == [0] * len(procs)


def spawn_runs(target: Callable[..., None], model_dir: Path, root: Path,
               runs: dict[str, tuple[int, tuple]], timeout_s: float = 60.0) -> dict[str, Path]:
    """Run every ``name → (world, extra)``: on each of its ranks, ``target(rank, world, device,
    model_dir, root/name, *extra)``. Wait for all of them and return each run's directory.

    The runs of one world size take turns in the same processes, one per rank, in one gloo
    group (``timeout_s``), and the processes fork from a server that has imported torch,
    transformers and FSDP (:mod:`tests.ranks`): a spawned learner process cost ~7 s of CPU
    before its first step, more than the steps of a run here, and at most 2 cores run them.
    The worlds run at once."""
    ctx = rank_context()
    plans: dict[int, list[tuple[str, tuple]]] = {}
    for name, (world, extra) in runs.items():
        (root / name).mkdir()
        plans.setdefault(world, []).append((str(root / name), extra))
    procs = []
    with ExitStack() as ports:   # each world's rendezvous port, held until its ranks exit
        for world, plan in plans.items():
            port = ports.enter_context(ReservedPort())
            procs += [ctx.Process(target=_take_turns,
                                  args=(target, r, world, port, str(model_dir), plan, timeout_s))
                      for r in range(world)]
        for proc in procs:
            proc.start()
        join_all(procs, JOIN_TIMEOUT_S * max(len(plan) for plan in plans.values()))
    return {name: root / name for name in runs}


def _take_turns(target: Callable[..., None], rank: int, world: int, port: int, model_dir: str,
                plan: list[tuple[str, tuple]], timeout_s: float) -> None:
    """One rank's process: join the group, run ``target`` for each ``(out_dir, extra)`` of
    ``plan`` in turn, leave the group."""
    torch.set_num_threads(1)
    from learners.dist import init_learner_group, shutdown_learner_group

    device = init_learner_group(rank, world, master_port=port, timeout_s=timeout_s)
    try:
        for out_dir, extra in plan:
            target(rank, world, device, model_dir, out_dir, *extra)
    finally:
        shutdown_learner_group()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def all_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every run of this module (3 processes): 1 and 2 ranks with CFG and with SEQ_KL, and
    each of VARIANTS on one rank."""
    runs = {"world1": (1, (CFG,)), "world2": (2, (CFG,)), "seq_kl1": (1, (SEQ_KL,)),
            "seq_kl2": (2, (SEQ_KL,)), **{name: (1, (cfg,)) for name, cfg in VARIANTS.items()}}
    return spawn_runs(run_rank, tiny_model_dir, tmp_path_factory.mktemp("fsdp2"), runs)


@pytest.fixture(scope="module")
def runs(all_runs: dict[str, Path]) -> dict[int, Path]:
    """The 1-rank and the 2-rank run."""
    return {world: all_runs[f"world{world}"] for world in (1, 2)}


@pytest.fixture(scope="module")
def variant_runs(all_runs: dict[str, Path]) -> dict[str, Path]:
    """Each of VARIANTS on one rank."""
    return {name: all_runs[name] for name in VARIANTS}


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def test_ranks_have_uneven_token_counts() -> None:
    counts = [collate(rank_groups(r, 2), True, 0).num_tokens for r in range(2)]
    assert counts[0] != counts[1]   # so the global-count normalisation is actually exercised


@pytest.fixture(scope="module")
def seq_kl_runs(all_runs: dict[str, Path]) -> dict[int, Path]:
    return {world: all_runs[f"seq_kl{world}"] for world in (1, 2)}


def test_two_ranks_match_one_rank(runs: dict[int, Path], tiny_model_dir: Path) -> None:
    _assert_worlds_match(runs, tiny_model_dir)


def test_two_ranks_match_one_rank_sequence_kl_gae(seq_kl_runs: dict[int, Path],
                                              tiny_model_dir: Path) -> None:
    _assert_worlds_match(seq_kl_runs, tiny_model_dir)
    metrics = _load(seq_kl_runs[2] / "rank0.pt")["metrics"]
    assert metrics[-1]["actor/kl_loss"] > 0
    # The zero-initialised critic predicts 0 at first, then learns the rewards' scale.
    assert metrics[0]["critic/values/mean"] == 0.0
    assert metrics[-1]["critic/values/mean"] != 0.0


def _assert_worlds_match(runs: dict[int, Path], tiny_model_dir: Path) -> None:
    single, multi = _load(runs[1] / "rank0.pt"), _load(runs[2] / "rank0.pt")
    initial = _initial_state(tiny_model_dir)
    assert single["version"] == multi["version"] == STEPS
    assert set(single["state"]) == set(multi["state"]) == set(initial)
    for name, tensor in single["state"].items():
        torch.testing.assert_close(multi["state"][name], tensor, atol=1e-5, rtol=0)
    moved = max((single["state"][n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3   # training moved the weights far more than the tolerance
    for step_single, step_multi in zip(single["metrics"], multi["metrics"]):
        for name, value in step_single.items():
            if name not in WALL_CLOCK:
                assert step_multi[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        # The two ranks did the one rank's model FLOPs between them (perf/tflops).
        assert step_flops(step_multi, 2) == pytest.approx(step_flops(step_single, 1), rel=1e-9)


# Step metrics that depend on the wall clock: they differ between runs of the same step.
WALL_CLOCK = ("timing/train_step", "perf/tflops")


def step_flops(metrics: dict[str, float], world: int) -> float:
    """The model FLOPs of a step, from its perf/tflops (per device and second)."""
    return metrics["perf/tflops"] * 1e12 * metrics["timing/train_step"] * world


def test_metrics_identical_on_all_ranks(runs: dict[int, Path]) -> None:
    rank0, rank1 = _load(runs[2] / "rank0.pt"), _load(runs[2] / "rank1.pt")
    assert rank0["metrics"] == rank1["metrics"]
    assert rank0["metrics"][0]["perf/trained_tokens"] == collate(make_groups(), True, 0).num_tokens
    assert rank1["state"] == {}   # the full state dict lands on rank 0 only


def test_saved_checkpoint_reloads(runs: dict[int, Path]) -> None:
    from transformers import AutoModelForCausalLM

    state = _load(runs[2] / "rank0.pt")["state"]
    reloaded = AutoModelForCausalLM.from_pretrained(runs[2] / "checkpoint").state_dict()
    for name, tensor in state.items():
        assert torch.equal(reloaded[name], tensor), name


def _initial_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def test_kl_to_sharded_reference(variant_runs: dict[str, Path], tiny_model_dir: Path) -> None:
    run = _load(variant_runs["kl"] / "rank0.pt")
    kl = [m["actor/kl_loss"] for m in run["metrics"]]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)   # the reference IS the initial policy
    assert kl[1] > 0 and kl[2] > 0                 # ...and stays frozen while the actor moves
    initial = _initial_state(tiny_model_dir)
    assert max((run["state"][n] - initial[n]).abs().max().item() for n in initial) > 1e-3


def test_decoupled_ppo_runs(variant_runs: dict[str, Path]) -> None:
    run = _load(variant_runs["decoupled"] / "rank0.pt")
    for metrics in run["metrics"]:
        # One update per batch: the proximal policy IS the current one, so the ratio is 1.
        assert metrics["actor/clipfrac"] == 0.0
        assert 0.0 <= metrics["actor/is_capped_frac"] <= 1.0
        assert metrics["mismatch/tokens"] == metrics["perf/trained_tokens"]
        assert metrics["actor/ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert run["version"] == STEPS


def test_all_rejected_steps_train_nothing(variant_runs: dict[str, Path],
                                          tiny_model_dir: Path) -> None:
    run = _load(variant_runs["all_rejected"] / "rank0.pt")
    initial = _initial_state(tiny_model_dir)
    assert all(torch.equal(run["state"][n], initial[n]) for n in initial)   # not one bit moved
    for metrics in run["metrics"]:
        assert metrics["mismatch/masked_fraction"] == 1.0
        assert metrics["mismatch/kept_tokens"] == 0.0 < metrics["mismatch/tokens"]
    assert run["version"] == STEPS   # the steps still count: the learner's clock goes on


def test_entropy_bonus_trains(variant_runs: dict[str, Path], tiny_model_dir: Path) -> None:
    run = _load(variant_runs["entropy"] / "rank0.pt")
    initial = _initial_state(tiny_model_dir)
    assert max((run["state"][n] - initial[n]).abs().max().item() for n in initial) > 1e-4
    assert all(0.0 < m["actor/entropy"] <= np.log(VOCAB) + 1e-5 for m in run["metrics"])


def test_verl_named_metrics(runs: dict[int, Path]) -> None:
    metrics = _load(runs[2] / "rank0.pt")["metrics"]
    groups = make_groups()
    lengths = [int(g.loss_mask[s].sum()) for g in groups for s in g.sample_slices()]
    for step in metrics:
        assert 0.0 < step["actor/entropy"] <= np.log(VOCAB) + 1e-5
        assert step["actor/lr"] == CFG.lr
        assert step["response_length/mean"] == pytest.approx(np.mean(lengths))
        assert step["response_length/max"] == max(lengths)
        assert step["critic/score/mean"] == pytest.approx(np.mean(
            [r for g in groups for r in g.rewards]))
        assert step["critic/rewards/mean"] == step["critic/score/mean"]  # no KL in the reward


def test_mismatch_metrics_reported(runs: dict[int, Path]) -> None:
    first = _load(runs[1] / "rank0.pt")["metrics"][0]
    # Behaviour logprobs are −log V + N(0, 0.4) noise: the mismatch is large and visible.
    assert first["mismatch/abs_logp"] > 0.1
    assert first["mismatch/is_q01"] <= first["mismatch/is_q50"] <= first["mismatch/is_q99"]
    assert first["mismatch/is_q99"] <= first["mismatch/is_max"]
