"""The learner driver: consume a batch, step, broadcast weights, publish the version.

One step reads like the algorithm::

    groups  = buffer.get_batch(groups_per_step / ranks, V)    # waits only if the buffer is empty
    metrics = trainer.train_step(collate(groups))             # V → V + 1
    weights = trainer.full_state_dict()                       # collective across ranks
    rank 0: broadcaster.sync(weights, V + 1); buffer.publish_version(V + 1)
    every checkpoint.every_steps: checkpoint.save(...)           # sharded DCP + meta.json

A restarted learner first resumes from its latest checkpoint (``learners.checkpoint``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.metrics import MetricsWriter, Timers
from buffers import BufferClient, connect_buffer

logger = logging.getLogger(__name__)

BATCH_POLL_S = 2.0  # get_batch long-poll; between polls rank 0 re-syncs engines that joined late


@dataclass
class RankContext:
    cfg: Config
    rank: int
    world: int
    client: BufferClient
    member: str


def run_learner_rank(cfg: Config, rank: int, world: int, address: str | None, master_port: int,
                     stop: threading.Event | None = None) -> None:
    """One training rank; rank 0 also owns the weight broadcast, metrics and evaluation."""
    import torch

    from asyncrl.models import prepare_model_dir
    from learners.backends import make_trainer
    from learners.checkpoint import Checkpointer
    from learners.dist import init_learner_group, shutdown_learner_group

    stop = stop or threading.Event()
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed + rank)
    device = init_learner_group(rank, world, master_port=master_port, device=cfg.learner.device)
    ctx = RankContext(cfg, rank, world, connect_buffer(cfg, address),
                      f"learner-{rank}")
    try:
        model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
        trainer = make_trainer(model_dir, cfg.learner, device)
        checkpointer = Checkpointer(cfg)
        driver = _RankZero(ctx, model_dir) if rank == 0 else None
        _resume(ctx, checkpointer, trainer, driver)
        _train(ctx, trainer, driver, stop, checkpointer)
        # A stop (signal) leaves the run resumable; the end of training marks it finished.
        checkpointer.save(trainer, {**_counters(cfg, trainer.version, {}),
                                    "finished": not stop.is_set()})
        state = trainer.full_state_dict()  # collective, like save_pretrained
        trainer.save_pretrained(cfg.run_dir / "final")
        if driver is not None:
            driver.finish(state, trainer.version)
    finally:
        ctx.client.close()
        shutdown_learner_group()


def _resume(ctx: RankContext, checkpointer, trainer, driver: _RankZero | None) -> None:
    """Load the checkpoint to resume from, if any (COLLECTIVE); rank 0 then re-syncs engines.

    A buffer that outlived the learner may hold a later version B than the checkpoint's V: the
    steps V+1..B were lost with the learner, but versions were published and the buffer's gate
    let groups in for them. Going on from V would reuse version numbers for other weights and,
    since the buffer refuses going backwards, keep the gate closed while V+1..B are redone
    (a deadlock once B − V > max_staleness). So the restored weights continue as version B."""
    if checkpointer.resume(trainer) is None:
        return
    reply = ctx.client.heartbeat(ctx.member, "learner", {"state": "resuming",
                                                         "version": trainer.version})
    buffer_version = int(reply["version"])  # the same on every rank: no one publishes now
    if buffer_version > trainer.version:
        logger.warning("checkpoint version %d is behind the buffer's %d (steps %d..%d were lost "
                       "with the learner): continuing as version %d", trainer.version,
                       buffer_version, trainer.version + 1, buffer_version, buffer_version)
        trainer.version = buffer_version
    state = trainer.full_state_dict()  # collective
    if driver is not None:
        driver.resumed(state, trainer.version)


def _train(ctx: RankContext, trainer, driver: _RankZero | None, stop: threading.Event,
           checkpointer) -> None:
    from asyncrl.models import PAD_ID
    from learners.batching import collate
    from learners.losses.filters import filter_groups, zero_loss_mask

    cfg, timers = ctx.cfg, Timers()
    share = cfg.learner.groups_per_step // ctx.world
    while trainer.version < cfg.learner.total_steps:
        with timers("wait_data"):
            batch = _next_batch(ctx, trainer, driver, share, stop)
        if batch is None:
            break
        groups, filter_counts = filter_groups(batch.groups, cfg.learner.loss)
        # train_step is collective: a rank whose groups were all filtered still takes part,
        # with a group that trains no token.
        groups = groups or [zero_loss_mask(batch.groups[0])]
        with timers("compute"):
            metrics = trainer.train_step(collate(groups, cfg.learner.advantage_std_norm, PAD_ID,
                                                 advantage=cfg.learner.loss.advantage))
        ctx.client.ack(ctx.member, batch)  # only now may the buffer forget these groups
        metrics.update({f"filter/{k}": float(v) for k, v in filter_counts.items()})
        metrics.update(_consumed_versions(batch.groups, trainer.version - 1, ctx.world))
        with timers("gather"):
            state = trainer.full_state_dict()
        should_stop = False
        if driver is not None:
            should_stop = driver.after_step(trainer.version, state, metrics, batch.stats,
                                            timers.pop("learner/"))
        checkpointer.after_step(trainer, _counters(cfg, trainer.version, batch.stats))
        if _agree(should_stop or stop.is_set(), ctx.world):
            break


def _next_batch(ctx: RankContext, trainer, driver: _RankZero | None, share: int,
                stop: threading.Event):
    """Wait for ``share`` fresh groups; meanwhile keep heartbeating and re-sync late joiners."""
    while not stop.is_set():
        batch = ctx.client.get_batch(ctx.member, share, trainer.version, BATCH_POLL_S)
        if batch is not None:
            return batch
        ctx.client.heartbeat(ctx.member, "learner", {"state": "waiting for data",
                                                     "version": trainer.version})
        if driver is not None:
            driver.resync_late_joiners(trainer.version)
    return None


def _counters(cfg: Config, version: int, stats: dict) -> dict[str, Any]:
    """The data position and the buffer's gate counters at this step, for ``meta.json``: the
    buffer keeps the live ones; these say where a resumed run picks up."""
    return {"groups_consumed": version * cfg.learner.groups_per_step,
            "buffer": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}}


def _consumed_versions(groups, version: int, world: int) -> dict[str, float]:
    """Staleness of what this step trained on, reduced over ranks (the s = 0 test reads it)."""
    import torch
    import torch.distributed as dist

    versions = [g.versions[g.loss_mask.astype(bool)] for g in groups]
    lo = min(int(v.min()) for v in versions if v.size)
    hi = max(int(v.max()) for v in versions if v.size)
    stale = [version - g.min_version() for g in groups]
    t = torch.tensor([-lo, hi, max(stale), sum(stale), len(stale)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t[:3], op=dist.ReduceOp.MAX)
        dist.all_reduce(t[3:], op=dist.ReduceOp.SUM)
    return {"learner/consumed_version_min": -t[0].item(),
            "learner/consumed_version_max": t[1].item(),
            "learner/staleness_max": t[2].item(),
            "learner/staleness_mean": (t[3] / t[4]).item()}


def _agree(flag: bool, world: int) -> bool:
    """Every rank stops together: rank 0 decides (eval target), any rank may be told to stop."""
    import torch
    import torch.distributed as dist

    if world == 1:
        return flag
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class _RankZero:
    """What only rank 0 does: broadcast weights, publish versions, write metrics, evaluate."""

    def __init__(self, ctx: RankContext, model_dir: Path) -> None:
        from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm
        from learners.weights import WeightBroadcaster
        from rollouters.engines.torch_engine import TorchEngine
        from rollouters.tasks import make_task

        self.ctx, self.cfg = ctx, ctx.cfg
        self.broadcaster = WeightBroadcaster(ctx.client, self.cfg.weights)
        self.writer = MetricsWriter(self.cfg.run_dir / "metrics.jsonl")
        self.task = make_task(self.cfg.task, self.cfg.run.seed)
        self.eval_engine = TorchEngine(load_causal_lm(model_dir, self.cfg.model.dtype, "cpu"),
                                       eos_id=EOS_ID, pad_id=PAD_ID)
        self.start = self.last_step_end = time.monotonic()
        self.last_state: dict[str, Any] | None = None
        self.last_eval: dict[str, float] = {}

    def resumed(self, state, version: int) -> None:
        """After a restart from a checkpoint, engines that outlived the learner hold weights it
        lost: send them the restored ones right away, and again to any that join later."""
        self.last_state = state
        self.broadcaster.sync(state, version)
        self.ctx.client.publish_version(version)  # a fresh buffer learns V; a surviving one has it

    def after_step(self, version: int, state, metrics: dict, stats: dict,
                   phase_times: dict) -> bool:
        sync = self.broadcaster.sync(state, version)
        self.ctx.client.publish_version(version)
        self.last_state = state
        now = time.monotonic()
        metrics["learner/tokens_per_s"] = metrics["learner/tokens"] / (now - self.last_step_end)
        self.last_step_end = now
        record = {"step": version, "time_s": round(now - self.start, 3), **metrics,
                  **phase_times, **sync,
                  **{f"buffer/{k}": v for k, v in stats.items()}, **self._rollout_totals()}
        if self.cfg.eval.every_steps and version % self.cfg.eval.every_steps == 0:
            record.update(self.evaluate(state, version))
        self.writer.write(record)
        self.ctx.client.heartbeat(self.ctx.member, "learner", record)
        _log_step(record)
        target = self.cfg.eval.stop_at_accuracy
        return target is not None and record.get("eval/accuracy", -1.0) >= target

    def evaluate(self, state, version: int) -> dict[str, float]:
        from rollouters.eval import evaluate

        self.eval_engine.load_weights(state.items(), version=version)
        self.last_eval = evaluate(self.eval_engine, self.task, self.cfg.rollout.max_new_tokens)
        return self.last_eval

    def resync_late_joiners(self, version: int) -> None:
        """An engine that joined after the last step would wait for weights forever while
        the learner waits for data (with small s): give it the current version now."""
        if self.last_state is not None and self.broadcaster.needs_sync():
            logger.info("engines changed while waiting for data: re-sending version %d", version)
            self.broadcaster.sync(self.last_state, version)

    def _rollout_totals(self) -> dict[str, float]:
        members = self.ctx.client.status().get("members", {})
        infos = [m.get("info", {}) for m in members.values()
                 if m.get("role") == "rollout" and m.get("alive")]
        return {"rollout/workers": len(infos),
                "rollout/tokens_per_s": sum(i.get("tokens_per_s", 0.0) for i in infos),
                "rollout/gate_wait_s": sum(i.get("gate_wait_s", 0.0) for i in infos)}

    def finish(self, state, version: int) -> None:
        final = self.evaluate(state, version)
        record = {"step": "final", "time_s": round(time.monotonic() - self.start, 3), **final}
        self.writer.write(record)
        (self.cfg.run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        self.ctx.client.set_key("run/status", {"status": "done"})
        self.broadcaster.close()
        self.writer.close()
        logger.info("final held-out greedy eval: accuracy %.3f (position accuracy %.3f, n=%d)",
                    final["eval/accuracy"], final["eval/position_accuracy"], final["eval/n"])


def _log_step(record: dict) -> None:
    logger.info("step %s  reward %.3f  loss %+.4f  staleness max %d  %s",
                record["step"], record.get("learner/reward_mean", float("nan")),
                record.get("learner/loss", float("nan")),
                record.get("learner/staleness_max", 0),
                f"eval acc {record['eval/accuracy']:.3f}" if "eval/accuracy" in record else "")
