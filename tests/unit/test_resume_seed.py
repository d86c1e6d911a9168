"""A learner that resumes from a checkpoint against a buffer that did not outlive it (both
backends, real servers): the loop seeds the buffer from ``meta.json``, so the version continues
from the checkpoint's and the gate admits one fresh start's worth of groups, not a flood."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config.schema import BufferConfig, Config, LearnerConfig, RunConfig
from learners.checkpoint import Checkpointer
from learners.lifecycle import counters, resume
from learners.rank_role import OtherRank, RankContext
from tests.buffers.conftest import (  # noqa: F401 (fixtures: real servers)
    backend,
    redis_cluster,
    staleness_mode,
)
from tests.unit.test_checkpoint import one_rank_group  # noqa: F401 (fixture)
from tests.unit.test_fsdp2 import tiny_model_dir  # noqa: F401 (fixture)

GPS, STALENESS, VERSION = 2, 1, 3


@pytest.mark.usefixtures("one_rank_group")
def test_resume_seeds_a_fresh_buffer(backend, tiny_model_dir: Path,  # noqa: F811
                                     tmp_path: Path) -> None:
    from learners.backends.fsdp2 import Fsdp2Trainer

    cfg = Config(run=RunConfig(name="seed", output_dir=tmp_path),
                 learner=LearnerConfig(groups_per_step=GPS),
                 buffer=BufferConfig(max_staleness=STALENESS))
    before = Fsdp2Trainer(tiny_model_dir, cfg.learner, "cpu")
    before.version = VERSION
    Checkpointer(cfg).save(before, counters(cfg, VERSION, {}))

    client = backend.start(groups_per_step=GPS, max_staleness=STALENESS).client()
    trainer = Fsdp2Trainer(tiny_model_dir, cfg.learner, "cpu")
    ctx = RankContext(cfg, 0, 1, client, "learner-0")
    resume(ctx, Checkpointer(cfg), trainer, OtherRank())   # a role with no engines to sync

    status = client.status()
    assert trainer.version == status["version"] == VERSION
    assert (status["accepted"], status["consumed"]) == (VERSION * GPS, VERSION * GPS)
    assert client.acquire("w", 100, VERSION).granted == (STALENESS + 1) * GPS
    assert status["members"]["learner-0"]["info"]["state"] == "resuming"


@pytest.mark.usefixtures("one_rank_group")
def test_a_fresh_learner_refuses_a_buffer_already_in_a_run(backend, tiny_model_dir: Path,  # noqa: F811
                                                         tmp_path: Path) -> None:
    """No checkpoint, and a buffer past version 0 (a hand-run broker that replayed the spill
    file of an earlier run of this name): the learner stops before its first step with what
    to do, instead of failing at its first publish after mixing that run's groups in."""
    from asyncrl.config import ConfigError
    from learners.backends.fsdp2 import Fsdp2Trainer

    cfg = Config(run=RunConfig(name="again", output_dir=tmp_path),
                 learner=LearnerConfig(groups_per_step=GPS))
    server = backend.start(groups_per_step=GPS)
    trainer = Fsdp2Trainer(tiny_model_dir, cfg.learner, "cpu")
    fresh = RankContext(cfg, 0, 1, server.client(), "learner-0")
    resume(fresh, Checkpointer(cfg), trainer, OtherRank())   # a fresh buffer: a fresh run
    assert trainer.version == 0

    server.client().publish_version(1)
    with pytest.raises(ConfigError, match=r"run.name = 'again': the buffer holds this run at "
                                          r"version 1.*no checkpoint") as refused:
        resume(fresh, Checkpointer(cfg), trainer, OtherRank())
    assert f"move its spill file {cfg.run_dir / 'buffer.spill'} aside" in str(refused.value)
