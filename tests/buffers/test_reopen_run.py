"""A resumed run whose buffer says the run is done is reopened before its workers start (both
backends, real servers): the status outlives a stop of the server (spill file, AOF), and a
rollout worker that finds the run done exits for good. Before, `asyncrl up` after Ctrl-C of
the quickstart (its broker replaying the spill file) trained the learner's held batches, then
waited for data forever."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config.schema import Config, LearnerConfig, RunConfig
from asyncrl.launch.run_dir import reopen_run
from buffers.protocol import DONE, RUN_STATUS_KEY, RUNNING
from buffers.run_token import token_path
from tests.buffers.conftest import RUN_ID

pytestmark = pytest.mark.timeout(60)

GPS = 2


def test_a_resumed_run_its_buffer_marked_done_runs_again(backend, tmp_path: Path) -> None:
    deployment = backend.start(groups_per_step=GPS)
    client = deployment.client()
    client.set_key(RUN_STATUS_KEY, {"status": DONE})
    assert client.acquire("w", 1, 0).granted == 0        # done: nothing more is generated
    deployment.restart(kill=True)
    cfg = Config(run=RunConfig(name=RUN_ID, output_dir=tmp_path),
                 learner=LearnerConfig(groups_per_step=GPS), buffer=deployment.config)
    if deployment.token:  # `up` wrote it with the run directory, and gave it to the broker
        token_path(cfg.run_dir).parent.mkdir(parents=True)
        token_path(cfg.run_dir).write_text(deployment.token)
    assert reopen_run(cfg, deployment.address)

    client = deployment.client()
    assert client.status()["run_status"] == RUNNING
    assert client.acquire("w", 1, 0).granted == 1
    assert not reopen_run(cfg, deployment.address)       # running: left as it is
