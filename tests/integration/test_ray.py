"""`asyncrl up` with ``launcher.type = "ray"`` against a real local Ray cluster.

One cluster for the module (``ray start --head --block`` on 127.0.0.1, small object store, no
dashboard), started in its own session and stopped by signalling only that session: never
``ray stop``, which would stop every Ray cluster of this user on the machine."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.net import free_port
from tests.integration.conftest import (QUICKSTART, ROOT, Processes, role_env, step_records,
                                        wait_for)

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head node on loopback; yields its address (``127.0.0.1:PORT``)."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # unix socket paths must be short
    # Ray >= 2.59 authenticates every client with a token: the head and the drivers the tests
    # start (through os.environ, which role_env copies) share this one.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    patch = pytest.MonkeyPatch()
    for key, value in auth.items():
        patch.setenv(key, value)
    env = {**role_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    log = open(Path(temp_dir) / "head.log", "wb")
    head_cwd = Path(temp_dir) / "head" / "cwd"  # deeper than ROOT: '../..' differs from both
    head_cwd.mkdir(parents=True)
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
         "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=4", "--num-gpus=0",
         f"--object-store-memory={256 << 20}", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp_dir}",
         f"--ray-client-server-port={free_port()}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        cwd=head_cwd)  # as a real cluster: its actors do not run in the driver's directory
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: b"Ray runtime started" in (Path(temp_dir) / "head.log").read_bytes()
                 or head.poll() is not None, 90, "the Ray head node")
        assert head.poll() is None, (Path(temp_dir) / "head.log").read_text()
        yield address
    finally:
        # --block: `ray start` stops what it started, draining the node through its GCS. A
        # SIGTERM to the whole group killed the GCS too, and the drain then waited out its
        # 30 s (the 10 s given here always ran out); to `ray start` alone it takes ~2 s.
        os.kill(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=10)  # else the group is killed (below)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
        patch.undo()


def _role_actors() -> dict[int, str]:
    """pid → process title of live asyncrl role actors (Ray titles them ray::Class.method)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if cmdline.startswith("ray::RoleActor") and state != "Z":
                found[int(entry.name)] = cmdline.strip()
    return found



def test_quickstart_learns_on_ray_and_survives_a_killed_worker(
        ray_cluster: str, tmp_path: Path, processes: Processes) -> None:
    up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=ray", "--set", "launcher.type=ray",
                         "--set", f"launcher.address={ray_cluster}",
                         "--set", "launcher.restart_backoff_s=0.5",
                         "--set", "buffer.heartbeat_timeout_s=3", "--set", "weights.timeout_s=5",
                         "--set", "learner.total_steps=120", "--set", "eval.every_steps=0")
    metrics = tmp_path / "ray" / "metrics.jsonl"
    wait_for(lambda: len(step_records(metrics)) >= 5, 300, "five steps on Ray")
    rollouts = [pid for pid, title in _role_actors().items() if "run_rollout" in title]
    assert len(rollouts) == 2, _role_actors()
    os.kill(rollouts[0], signal.SIGKILL)
    wait_for(lambda: re.search(r"rollout\[\d\] failed after .*restart 1/3",
                               processes.log("up")), 60, "the launcher to restart the worker")
    assert processes.wait(up, 600) == 0, processes.log("up")

    records = step_records(metrics)
    assert [r["step"] for r in records] == list(range(1, 121))
    rewards = [r["critic/score/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2 and last > 0.5, (first, last)
    assert max(r["staleness/max"] for r in records) <= 2
    log = processes.log("up")
    assert re.search(r"\(learner\[0\] pid=\d+.*step 120", log), log[-3000:]  # streamed logs
    assert re.search(r"\(rollout\[1\] pid=\d+", log)
    assert "final held-out greedy eval" in log
    wait_for(lambda: not _role_actors(), 30, "every role actor to exit")


def test_ctrl_c_stops_every_actor_and_the_learner_saves(
        ray_cluster: str, tmp_path: Path, processes: Processes) -> None:
    up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=raystop", "--set", "launcher.type=ray",
                         "--set", f"launcher.address={ray_cluster}",
                         "--set", "learner.total_steps=100000", "--set", "eval.every_steps=0")
    metrics = tmp_path / "raystop" / "metrics.jsonl"
    wait_for(lambda: len(step_records(metrics)) >= 2, 300, "two steps on Ray")
    start = time.monotonic()
    os.kill(up.pid, signal.SIGINT)
    assert processes.wait(up, 60) == 130, processes.log("up")
    assert time.monotonic() - start < 40
    assert "did not stop in time" not in processes.log("up")
    assert (tmp_path / "raystop" / "final" / "config.json").exists()  # the learner saved
    wait_for(lambda: not _role_actors(), 30, "every role actor to exit")


def test_a_role_config_error_is_not_restarted_and_exits_2(
        ray_cluster: str, tmp_path: Path, processes: Processes) -> None:
    """As with the local launcher: a config error only the rollout worker meets, at its start
    (``rollout.device = "cuda"`` on a machine without one: `up`'s start checks read files
    and imports, not devices). It is not restarted: the run stops at once with exit status 2
    and the error, naming its key. The data path is relative to the driver's directory, which
    is not the actors' (asyncrl.launch.actor_paths): the worker must still find the file to
    get as far as its engine. (A data file one row short, the earlier case here, is now
    refused by the start checks before any actor starts.)"""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: the error is 'no CUDA device'")
    data = tmp_path / "rows.jsonl"
    data.write_text((ROOT / "examples" / "agent" / "data.jsonl").read_text())
    relative = os.path.relpath(data, ROOT)  # `up` runs in ROOT
    up = processes.start("up", "up", str(ROOT / "examples" / "agent" / "single_turn.toml"),
                         "--set", f"data.path={relative}", "--set", "rollout.device=cuda",
                         "--set", f"run.output_dir={tmp_path}", "--set", "run.name=raycfg",
                         "--set", "launcher.type=ray", "--set", f"launcher.address={ray_cluster}",
                         "--set", "launcher.restart_backoff_s=0.5")
    assert processes.wait(up, 300) == 2, processes.log("up")
    log = processes.log("up")
    assert ("run stopped: rollout[0] stopped on a configuration error (not restarted): "
            "rollout.device: 'cuda', but this process sees no CUDA device") in log, log[-3000:]
    assert f"data.path resolved to {data} for the actors" in log
    assert "restart 1/" not in log
    assert not re.search(r"^final held-out greedy eval", log, re.M)  # the driver's summary
    wait_for(lambda: not _role_actors(), 30, "every role actor to exit")
