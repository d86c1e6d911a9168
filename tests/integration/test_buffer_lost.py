"""A buffer lost for good while the learner trains costs no training: the learner's ranks agree
to stop, save the steps they took in a checkpoint and exit; once the buffer is back (its
spill file replayed), the learner started again resumes at that step and finishes the run.

Real processes through the CLI, as on separate machines: ``asyncrl buffer`` (SIGKILLed, and
nothing restarts it), ``asyncrl learner`` with two ranks in one gloo group, ``asyncrl
rollout`` (killed with the buffer, started again with it). The simulated engines and
learner (configs/sim.toml) keep it quick; the learner loop, the checkpoint and the ZMQ buffer
are the real ones. The tests of a stop in the step that reached the eval target run the
learner in this process instead (:func:`_reaching_the_target` says why)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.config import Config
from learners.checkpoint import read_meta, step_dirs
from tests.integration.conftest import ROOT, Processes, step_records, wait_for

pytestmark = pytest.mark.slow

SIM = ROOT / "configs" / "sim.toml"
STEPS = 12


def _sets(output_dir: Path) -> list[str]:
    values = [f"run.output_dir={output_dir}", "run.name=lost", f"learner.total_steps={STEPS}",
              "learner.ranks=2", "learner.groups_per_step=8", "rollout.workers=2",
              "sim.mean_tokens=32", "checkpoint.every_steps=0", "checkpoint.resume=true",
              "buffer.request_timeout_s=2", "buffer.zmq.reconnect_s=2",
              "buffer.zmq.spill_path=auto"]
    return [arg for value in values for arg in ("--set", value)]


def training_two_ranks(tmp_path: Path, processes: Processes, steps: int
                       ) -> tuple[subprocess.Popen, subprocess.Popen, subprocess.Popen, str]:
    """Buffer, two-rank learner and rollout started, once the learner trained ``steps``:
    the three processes and the buffer's address."""
    sets = _sets(tmp_path)
    buffer, address = processes.start_buffer(str(SIM), *sets)
    learner = processes.start("learner", "learner", str(SIM), *sets, "--buffer", address)
    rollout = processes.start("rollout", "rollout", str(SIM), *sets, "--buffer", address)
    metrics = tmp_path / "lost" / "metrics.jsonl"
    wait_for(lambda: len(step_records(metrics)) >= steps or learner.poll() is not None, 180,
             f"{steps} steps")
    assert learner.poll() is None, processes.log("learner")
    return buffer, learner, rollout, address


def test_a_learner_whose_buffer_is_lost_saves_its_steps_and_resumes_there(
        tmp_path: Path, processes: Processes) -> None:
    sets = _sets(tmp_path)
    run_dir, metrics = tmp_path / "lost", tmp_path / "lost" / "metrics.jsonl"
    buffer, learner, rollout, address = training_two_ranks(tmp_path, processes, 4)

    for proc in (buffer, rollout):   # nothing restarts the buffer: lost for good
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert processes.wait(learner, 120) != 0, processes.log("learner")
    log = processes.log("learner")
    trained = step_records(metrics)[-1]["step"]
    assert trained < STEPS
    assert f"saved a checkpoint at version {trained}" in log, log
    # each rank says why in one line (the cause logged before it), no traceback
    assert "learner[0] stopped: " in log and "learner[1] stopped: " in log, log
    assert "Traceback" not in log, log
    (version, path), = step_dirs(run_dir / "checkpoints")   # the only one: every_steps = 0
    assert version == trained and read_meta(path).counters["finished"] is False

    # The buffer is back at the same port, from its spill file; the learner resumes there.
    (tmp_path / "buffer.addr").unlink()
    port = address.rsplit(":", 1)[1]
    _, address = processes.start_buffer(str(SIM), *sets, "--set", f"buffer.zmq.port={port}")
    assert "restored" in processes.log("buffer"), processes.log("buffer")
    learner = processes.start("learner-2", "learner", str(SIM), *sets, "--buffer", address)
    rollout = processes.start("rollout-2", "rollout", str(SIM), *sets, "--buffer", address)
    assert processes.wait(learner, 300) == 0, processes.log("learner-2")
    assert f"resuming at version {trained}" in processes.log("learner-2")
    steps = [r["step"] for r in step_records(metrics)]
    assert steps == list(range(1, STEPS + 1)), steps   # no step lost, none trained twice
    assert read_meta(step_dirs(run_dir / "checkpoints")[-1][1]).counters["finished"] is True
    assert processes.wait(rollout, 60) == 0, processes.log("rollout-2")


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_two_rank_learner_stopped_while_its_buffer_is_gone_exits_quietly(
        tmp_path: Path, processes: Processes, fault: signal.Signals) -> None:
    """Ctrl-C to a learner of two ranks whose buffer is gone (killed) or hangs (a stopped
    process, a partition): both ranks save the steps they trained and exit as a stop does,
    status 0 and no error, whichever rank's request went unanswered. Before, the rank that
    only heard of the loss from the other exited as if the buffer had been lost mid-run
    (status 3, an error line), and so the learner exited 1."""
    run_dir, metrics = tmp_path / "lost", tmp_path / "lost" / "metrics.jsonl"
    buffer, learner, rollout, _ = training_two_ranks(tmp_path, processes, 3)

    os.killpg(rollout.pid, signal.SIGKILL)
    os.killpg(buffer.pid, fault)
    os.killpg(learner.pid, signal.SIGINT)   # Ctrl-C on the learner's terminal
    # A bound on a hang: a stop the ranks agreed on runs the final eval (256 prompts, 4 s on an
    # idle 2-core machine), which took over 30 s in a CI run beside two other tests.
    assert processes.wait(learner, 120) == 0, processes.log("learner")
    log = processes.log("learner")
    assert "Traceback" not in log and " ERROR " not in log, log   # a stop, as asked
    trained = step_records(metrics)[-1]["step"]
    # Whether the stop or the loss reached the ranks' agreement first is a race (a killed
    # buffer is usually first); when it was the loss, both ranks say so as a stop.
    if "stopped while the buffer did not answer" in log:
        for rank in (0, 1):
            assert re.search(rf"learner\[{rank}\] INFO .*stopped while the buffer did not "
                             rf"answer: saved a checkpoint at version {trained}", log), log
    (version, path), = step_dirs(run_dir / "checkpoints")   # every_steps = 0: the stop's own
    assert version == trained and read_meta(path).counters["finished"] is False


def _reaching_the_target(tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch,
                         at_first_batch: Callable[[subprocess.Popen, subprocess.Popen,
                                                   threading.Event], None]
                         ) -> tuple[Config, list[str]]:
    """A one-rank learner, run in this process until it returns, whose every step evaluates
    and meets ``eval.stop_at_accuracy``, against a real buffer and rollout fleet.
    ``at_first_batch(buffer, rollout, stop)`` runs on a thread once the learner started
    training its first batch, within that step's ~4 s of simulated training (``stop``: the
    learner's stop event, as a signal sets it). Returns the config and its ``--set`` arguments.
    It waits on the step itself, not on the buffer's delivery: a stop set between the lease
    and the ranks' agreement on it ends the run before step 1 (a CI flake, no record).

    The learner runs here so that its evaluator can be a stand-in that scores 1.0: the sim
    model never learns, and these races need the target met at a known step."""
    import rollouters.eval
    from asyncrl.config import load_config
    from asyncrl.net import free_port
    from learners.backends.sim import SimTrainer
    from learners.loop import run_learner_rank

    monkeypatch.setattr(rollouters.eval, "make_evaluator",
                        lambda cfg, tokens: lambda engine: {"val/test_score/copy": 1.0})
    values = [f"run.output_dir={tmp_path}", "run.name=lost", f"learner.total_steps={STEPS}",
              "learner.ranks=1", "learner.groups_per_step=8", "rollout.workers=2",
              "sim.mean_tokens=32", "sim.train_token_s=2e-3", "checkpoint.every_steps=0",
              "checkpoint.resume=true", "eval.every_steps=1", "eval.stop_at_accuracy=1",
              "buffer.request_timeout_s=2", "buffer.zmq.reconnect_s=2",
              "buffer.zmq.spill_path=auto"]
    sets = [arg for value in values for arg in ("--set", value)]
    cfg = load_config(str(SIM), values)
    buffer, address = processes.start_buffer(str(SIM), *sets)
    rollout = processes.start("rollout", "rollout", str(SIM), *sets, "--buffer", address)
    stop, training = threading.Event(), threading.Event()
    train_step = SimTrainer.train_step

    def train_step_seen(self, batch):
        training.set()
        return train_step(self, batch)

    monkeypatch.setattr(SimTrainer, "train_step", train_step_seen)

    ended = threading.Event()

    def watch() -> None:
        if not training.wait(120):
            stop.set()   # the learner never trained: end it, and the test's asserts say so
        elif not ended.is_set():
            at_first_batch(buffer, rollout, stop)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_learner_rank(cfg, 0, 1, address, free_port(), stop,
                         evaluator=rollouters.eval.EngineEvaluator)
    finally:
        ended.set()
        training.set()   # a learner that failed before training does not wait out the watch
        watcher.join()
    return cfg, sets


def test_a_learner_that_reached_its_eval_target_as_the_buffer_was_lost_finishes_on_resume(
        tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The eval target is reached in the step whose ack the lost buffer never answers: the
    learner stops, saving an unfinished checkpoint as it must (the run cannot be marked done:
    the buffer is gone). Started again, it only finishes the run: export, final eval, the run
    marked done. Before, the checkpoint did not say the target was reached, and the resumed
    learner trained on until an eval reached it again (a second step here)."""
    from asyncrl.net import free_port
    from learners.loop import run_learner_rank
    from rollouters.eval import EngineEvaluator

    def kill(buffer: subprocess.Popen, rollout: subprocess.Popen, _) -> None:
        for proc in (buffer, rollout):   # nothing restarts the buffer: lost for good
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    caplog.set_level("INFO")
    cfg, sets = _reaching_the_target(tmp_path, processes, monkeypatch, kill)  # a stop: returns
    run_dir, metrics = cfg.run_dir, cfg.run_dir / "metrics.jsonl"
    assert "stopped while the buffer did not answer: saved a checkpoint at version 1" in \
        caplog.text, caplog.text
    assert [r["step"] for r in step_records(metrics)] == [1]
    (version, path), = step_dirs(run_dir / "checkpoints")
    counters = read_meta(path).counters
    assert version == 1 and counters["finished"] is False, counters
    assert counters["eval_target"] == {"version": 1, "score": 1.0, "target": 1.0}, counters
    assert not (run_dir / "eval.json").exists()

    caplog.clear()
    address = (tmp_path / "buffer.addr").read_text().strip()
    (tmp_path / "buffer.addr").unlink()
    port = address.rsplit(":", 1)[1]
    _, address = processes.start_buffer(str(SIM), *sets, "--set", f"buffer.zmq.port={port}")
    rollout = processes.start("rollout-2", "rollout", str(SIM), *sets, "--buffer", address)
    run_learner_rank(cfg, 0, 1, address, free_port(), evaluator=EngineEvaluator)
    assert "resuming at version 1" in caplog.text, caplog.text
    assert "finishing it without training on" in caplog.text, caplog.text
    assert [r["step"] for r in step_records(metrics)] == [1]   # no step trained again
    assert read_meta(step_dirs(run_dir / "checkpoints")[-1][1]).counters["finished"] is True
    assert (run_dir / "eval.json").exists() and (run_dir / "final").is_dir()
    assert processes.wait(rollout, 60) == 0, processes.log("rollout-2")   # the run marked done


def test_a_stop_in_the_step_that_reached_the_eval_target_finishes_the_run(
        tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the step whose eval reaches the target (the buffer alive): the run is
    finished all the same, marked done and its checkpoint so, and `asyncrl up` would start a
    new run rather than resume a finished one. Before, it was left resumable."""
    def signal_the_learner(buffer, rollout, stop: threading.Event) -> None:
        stop.set()   # what the learner role's SIGINT handler does

    cfg, _ = _reaching_the_target(tmp_path, processes, monkeypatch, signal_the_learner)
    run_dir = cfg.run_dir
    assert [r["step"] for r in step_records(run_dir / "metrics.jsonl")] == [1]
    (version, path), = step_dirs(run_dir / "checkpoints")
    counters = read_meta(path).counters
    assert version == 1 and counters["finished"] is True, counters
    assert counters["eval_target"] == {"version": 1, "score": 1.0, "target": 1.0}, counters
    assert (run_dir / "eval.json").exists() and (run_dir / "final").is_dir()
    assert processes.wait(processes.procs[1], 60) == 0, processes.log("rollout")  # marked done
