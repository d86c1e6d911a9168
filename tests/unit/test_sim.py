"""The simulated engine, trainer and weight transport (issue 8): timing model, per-token
versions across an in-flight update, the trainer's wait and metrics, the wire's waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from asyncrl.config import Config, ConfigError, parse_overrides
from asyncrl.config.schema import LearnerConfig, SimConfig
from asyncrl.weights.transport import make_transport
from rollouters.engines.sim import SimEngine, sample_lengths, step_end_times
from tests.ranks import run_ranks

EOS = 3


class FakeClock:
    """A clock the test advances: sleeping moves time forward, and a callback can fire at a
    given time (a weight update landing mid-call)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, object]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        target = self.now + seconds
        for at, fire in sorted(self.events, key=lambda e: e[0]):
            if self.now <= at <= target:
                self.now = at
                fire()
        self.events = [e for e in self.events if e[0] > target]
        self.now = target


def test_lengths_follow_the_distribution_and_the_cap() -> None:
    rng = np.random.default_rng(0)
    uniform = sample_lengths(rng, SimConfig(length="uniform", mean_tokens=50), 20000, 1000)
    assert uniform.min() >= 1 and uniform.max() <= 99 and abs(uniform.mean() - 50) < 1
    tail = sample_lengths(rng, SimConfig(length="lognormal", mean_tokens=50, sigma=1.0),
                          20000, 100000)
    assert abs(tail.mean() - 50) < 3  # parameterised by its mean
    assert np.percentile(tail, 99) > 4 * np.percentile(uniform, 99) / 2  # a long tail
    capped = sample_lengths(rng, SimConfig(length="lognormal", mean_tokens=50), 5000, 64)
    assert capped.max() == 64


def test_step_times_model_batching() -> None:
    cfg = SimConfig(decode_step_s=0.01, batch_slowdown=1.0, max_batch=4, prefill_s=0.5)
    ends = step_end_times(cfg, np.array([1, 3, 3, 2]))
    # step 1: 4 active → 0.01·(1 + 3/4); step 2: 3 active; step 3: 2 active
    expected = 0.5 + np.cumsum([0.01 * 1.75, 0.01 * 1.5, 0.01 * 1.25])
    np.testing.assert_allclose(ends, expected)


def test_engine_waits_the_model_and_records_versions_across_an_update() -> None:
    clock = FakeClock()
    cfg = SimConfig(length="fixed", mean_tokens=10, decode_step_s=0.1)
    engine = SimEngine(cfg, eos_id=EOS, token_ids=[5, 6], seed=1, clock=clock,
                       sleep=clock.sleep)
    # The update lands at t = 0.45: steps 1-4 end before it (version 0), 5-10 after (7).
    clock.events.append((0.45, lambda: engine.load_weights(iter([]), version=7)))
    out = engine.generate([[1, 2], [1, 3]], n=3, temperature=1.0, max_new_tokens=20)
    assert clock.now == pytest.approx(1.0)
    assert [len(c) for c in out] == [3, 3]
    completion = out[1][2]
    assert completion.versions == [0] * 4 + [7] * 6
    assert completion.tokens[-1] == EOS and completion.finish_reason == "stop"
    assert set(completion.tokens[:-1]) <= {5, 6} and len(completion.logprobs) == 10
    assert engine.version == 7


def test_engine_caps_at_max_new_tokens_and_stops_on_close() -> None:
    cfg = SimConfig(length="fixed", mean_tokens=100, decode_step_s=0.001)
    engine = SimEngine(cfg, eos_id=EOS, token_ids=[5], seed=0)
    [[completion]] = engine.generate([[1]], n=1, temperature=1.0, max_new_tokens=8)
    assert completion.finish_reason == "length" and len(completion.tokens) == 8
    assert EOS not in completion.tokens
    slow = SimEngine(SimConfig(length="fixed", mean_tokens=100, decode_step_s=10.0),
                     eos_id=EOS, token_ids=[5])
    threading.Timer(0.2, slow.close).start()
    start = time.monotonic()
    slow.generate([[1]], n=1, temperature=1.0, max_new_tokens=100)
    assert time.monotonic() - start < 5  # close() cuts the wait short


def test_sim_group_serialises_broadcasts_and_aborts() -> None:
    group = make_transport("sim", host="127.0.0.1", timeout_s=5.0, s_per_byte=0.1 / 4000)
    group.connect(None, "g1", 0, 3)
    start = time.monotonic()
    works = [group.send(torch.zeros(1000)) for _ in range(3)]  # 4000 B each
    for work in works:
        work.wait()
    assert 0.28 < time.monotonic() - start < 1.0  # three back to back on one wire
    pending = group.send(torch.zeros(1000 * 100))
    assert pending.wait(0.01) is False, "a bounded wait gives up while it is on the wire"
    group.close()
    with pytest.raises(RuntimeError, match="aborted"):
        pending.wait()


def test_sim_trainer_waits_for_its_tokens(tmp_path) -> None:
    from asyncrl.models import build_char_tokenizer, build_tiny_model
    from asyncrl.config.schema import TinyModelConfig
    from learners.backends import make_trainer
    from learners.batching import collate
    from tests.unit.test_fsdp2 import make_groups

    path = tmp_path / "model"
    build_tiny_model(TinyModelConfig(), len(build_char_tokenizer()), 0).save_pretrained(path)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sim = SimConfig(train_token_s=0.01)
        trainer = make_trainer(path, LearnerConfig(backend="sim"), "cpu", sim=sim)
        batch = collate(make_groups(), True, 0)
        tokens = int(batch.loss_mask.sum())
        start = time.monotonic()
        metrics = trainer.train_step(batch)
        assert time.monotonic() - start >= tokens * 0.01 * 0.95
        assert trainer.version == 1 and metrics["perf/trained_tokens"] == tokens
        assert "critic/score/mean" in metrics and "response_length/mean" in metrics
        state = trainer.full_state_dict()
        assert state and all(isinstance(t, torch.Tensor) for t in state.values())
    finally:
        dist.destroy_process_group()


def _sim_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    """Rank ``rank`` of a sim learner given an UNEVEN share: groups 0-2 on rank 0, 3 on 1."""
    import json

    from learners.backends import make_trainer
    from learners.batching import collate
    from tests.unit.test_fsdp2 import make_groups

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        groups = make_groups()
        batch = collate(groups[:3] if rank == 0 else groups[3:], True, 0)
        trainer = make_trainer(model, LearnerConfig(backend="sim"), "cpu",
                               sim=SimConfig(train_token_s=0.01))
        start = time.monotonic()
        metrics = trainer.train_step(batch)
        took = time.monotonic() - start
        Path(out, f"{rank}.json").write_text(json.dumps(
            {"took": took, "tokens": int(batch.loss_mask.sum()), "metrics": metrics}))
    finally:
        dist.destroy_process_group()


def test_sim_ranks_wait_for_the_largest_share_and_report_the_global_batch(tmp_path) -> None:
    """Each rank waits for the LARGEST share (data-parallel ranks finish together), and the
    metrics, gathered in the same single collective as the share sizes, are the whole
    batch's: equal to step_metrics of the whole batch on one rank."""
    import json


    from asyncrl.config.schema import TinyModelConfig
    from asyncrl.models import build_char_tokenizer, build_tiny_model
    from asyncrl.net import ReservedPort
    from learners.batching import collate
    from learners.step_metrics import step_metrics
    from tests.unit.test_fsdp2 import make_groups

    model, out = tmp_path / "model", tmp_path / "out"
    out.mkdir()
    build_tiny_model(TinyModelConfig(), len(build_char_tokenizer()), 0).save_pretrained(model)
    with ReservedPort() as port:
        run_ranks(_sim_rank, args=(2, port, str(model), str(out)), nprocs=2)
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    largest = max(r["tokens"] for r in ranks)
    assert ranks[0]["tokens"] != ranks[1]["tokens"]
    for r in ranks:
        assert r["took"] >= largest * 2 * 0.01 * 0.95
    whole = collate(make_groups(), True, 0)
    tokens = whole.loss_mask.sum().to(torch.float32)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        want = step_metrics(torch.zeros(()), tokens, {"tokens": tokens}, whole)
    finally:
        dist.destroy_process_group()
    for r in ranks:
        got = r["metrics"]
        assert got["perf/trained_tokens"] == int(tokens)
        for name, value in want.items():
            if name != "actor/loss":   # 0 either way: the sim has no loss
                assert got[name] == pytest.approx(value), name


def test_config_accepts_sim_and_rejects_bad_values() -> None:
    cfg = Config.model_validate(parse_overrides([
        "rollout.engine=sim", "learner.backend=sim", "weights.transport=sim",
        "sim.model_params=1e9", "sim.sync_gb_per_s=2"]))
    assert cfg.sim.sync_s == pytest.approx(1.0)
    with pytest.raises((ConfigError, ValueError), match="sim.length|length"):
        Config.model_validate(parse_overrides(["sim.length=zipf"]))
