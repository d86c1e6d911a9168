"""The run directory both launchers start a run in, and what they read back from the run.

``runs/<name>/`` holds the resolved config every role is started from, the logs, metrics,
checkpoints and the buffer's spill file. `asyncrl up` either starts a new run there (an earlier
run's files renamed aside) or resumes the one it holds (:func:`is_resuming`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import IO

from asyncrl.config import Config
from asyncrl.config.load import to_toml
from asyncrl.config.schema import DATA_POSITION_DIR, SPILL_NAME
from asyncrl.metrics import val_score_key
from asyncrl.models import INIT_MODEL_DIRNAME

logger = logging.getLogger(__name__)


def is_resuming(cfg: Config) -> bool:
    """`up` continues a run when the learner will resume one: ``--resume PATH``, or an
    unfinished checkpoint in the run directory with ``checkpoint.resume`` on (a finished run's
    checkpoints are archived and a new run starts).

    Finished means marked so by the learner's end of the run (export, final eval, the run
    marked done), not a checkpoint at ``learner.total_steps``: a learner that died or lost
    its buffer after the last step's checkpoint never exported or evaluated. Resumed, it
    trains no step and does that end; a new run would have archived the steps instead."""
    from learners.checkpoint import read_meta, resume_point

    path = resume_point(cfg.checkpoint, cfg.run_dir)
    if path is None:
        return False
    return bool(cfg.checkpoint.path) or not read_meta(path).counters.get("finished", False)


def run_dir_note(cfg: Config) -> str:
    """Where a stopped run is, and whether `asyncrl up` would resume it (for failure lines)."""
    resumable = " (resumable: run `asyncrl up` again)" if is_resuming(cfg) else ""
    return f"run directory {cfg.run_dir}{resumable}"


def write_run_dir(cfg: Config, resuming: bool = False) -> Path:
    """Create ``runs/<name>/`` with the resolved config that every role is started from,
    and the run's token (:mod:`buffers.run_token`; kept when a run is resumed or restarted).

    A new run keeps an earlier run's metrics, checkpoints, buffer spill file, data positions
    and initial model, renamed, never appended to, resumed from, replayed or reused (its
    groups are the earlier policy's). A resumed run appends to its metrics, its broker
    replays the spill file, and its rollout workers go on from their data positions.

    The data positions and the initial model were not archived: a new run of the same name
    read on from where the last one stopped (a third run of a one-epoch dataset found it
    exhausted and waited for ever), and trained the last run's initial model whatever
    ``model.tiny`` or ``run.seed`` now said."""
    from buffers.run_token import ensure_token

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    ensure_token(cfg.run_dir)
    archived = ("metrics.jsonl", "eval.json", cfg.checkpoint.dir, SPILL_NAME,
                DATA_POSITION_DIR, INIT_MODEL_DIRNAME)
    for name in () if resuming else archived:
        old = cfg.run_dir / name
        if old.exists():
            kept = old.with_name(f"{old.stem}.{int(old.stat().st_mtime)}{old.suffix}")
            old.rename(kept)
            logger.info("kept the previous run's %s as %s", name, kept.name)
    path = cfg.run_dir / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path


def status_client(cfg: Config, address: str | None):
    """The launcher's own buffer client for the progress view. The view must never hold up
    restarts or shutdown: a short timeout and no reconnect retries. It carries the run's
    token: :func:`reopen_run` marks the run running with it."""
    from buffers import make_buffer_client
    from buffers.run_token import read_token

    config = cfg.buffer.with_fields("zmq", reconnect_s=0.0).with_fields(
        request_timeout_s=min(5.0, cfg.buffer.request_timeout_s))
    return make_buffer_client(config, address, run_id=cfg.run.name,
                              groups_per_step=cfg.learner.groups_per_step,
                              token=read_token(cfg.run_dir))


def reopen_run(cfg: Config, address: str | None) -> bool:
    """A resumed run trains again: if its buffer says the run is done, say it is running,
    before any rollout worker asks (a worker that finds the run done exits, and is not
    restarted). The buffer keeps the status across the stop: a ZMQ broker replays it from
    its spill file, Redis keeps it. It reads done after ``--resume`` of a finished run, and
    after any stop of a run by versions before the learner stopped marking stopped runs
    done; without this the resumed learner trained the batches it held, then waited for
    data forever. Returns whether it reopened the run."""
    from buffers.protocol import DONE, RUN_STATUS_KEY, RUNNING

    client = status_client(cfg, address)
    try:
        if client.status().get("run_status") != DONE:
            return False
        client.set_key(RUN_STATUS_KEY, {"status": RUNNING})
    finally:
        client.close()
    logger.info("resuming run %r, which its buffer had marked done: running again",
                cfg.run.name)
    return True


def print_final(cfg: Config, out: IO[str]) -> None:
    """The final held-out eval the learner wrote, if it got that far."""
    path = cfg.run_dir / "eval.json"
    if path.exists():
        final = json.loads(path.read_text())
        task = cfg.task.name
        if f"val/position_score/{task}" in final:  # the digit tasks
            summary = (f"({final[f'val/num_prompts/{task}']} prompts): accuracy "
                       f"{final[val_score_key(task)]:.3f}, position accuracy "
                       f"{final[f'val/position_score/{task}']:.3f}")
        else:  # a workflow's validation: its val/* metrics
            summary = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in final.items() if k.startswith("val/"))
        out.write(f"final held-out greedy eval {summary}\nrun directory: {cfg.run_dir}\n")
        out.flush()
