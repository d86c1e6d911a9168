"""Rank 0's part of the learner (:class:`~learners.rank_role.RankRole`): it alone reads the
buffer (:class:`~learners.batch_feed.BatchFeed`), publishes the weights to the engines and
the versions to the buffer, writes the metrics and evaluates.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from asyncrl.evaluation import EvaluatorFactory
from asyncrl.metrics import val_score
from asyncrl.prometheus import start_endpoint
from asyncrl.sinks import make_sinks
from asyncrl.snapshot import EVICTIONS
from buffers import connect_buffer, unanswered
from buffers.protocol import DONE, RUN_STATUS_KEY
from learners.batch_feed import BatchFeed
from learners.lost import Lost
from learners.rank_role import RankContext
from learners.vision import LearnerVision

logger = logging.getLogger(__name__)


class RankZero:
    """What only rank 0 does: read the buffer, broadcast weights, publish versions, write
    metrics, evaluate."""

    def __init__(self, ctx: RankContext, model_dir: Path, evaluator: EvaluatorFactory) -> None:
        from asyncrl.devices import resolve_device
        from asyncrl.net import broadcast_host
        from asyncrl.weights.broadcaster import WeightBroadcaster, broadcast_align, engine_weights
        from asyncrl.weights.publisher import WeightPublisher
        from asyncrl.weights.senders import fanout_senders

        self.ctx, self.cfg = ctx, ctx.cfg
        # weights.fanout: every rank sends to its slice of the engines (learners.rank_role)
        self.senders = fanout_senders(self.cfg, ctx.world)
        from asyncrl.tokens import special_tokens

        self.feed = BatchFeed.connect(ctx, special_tokens(model_dir).pad_id,
                                      LearnerVision.of(model_dir))
        # The publisher delivers weights on a thread of its own: it gets a client of its own.
        # Waiting for a delivery (slow engines: up to weights.timeout_s), this thread beats.
        self.weights_client = connect_buffer(self.cfg, ctx.address, ctx.stop)
        self.publisher = WeightPublisher(
            self.weights_client,
            WeightBroadcaster(self.weights_client,
                              engine_weights(self.cfg.weights, self.cfg.rollout.engine),
                              sim_sync_s=self.cfg.sim.sync_s,
                              align=broadcast_align(self.cfg.rollout.engine),
                              host=broadcast_host(self.cfg, ctx.address),
                              senders=self.senders,
                              device=resolve_device(self.cfg.learner.device, ctx.rank)),
            overlap=self.cfg.weights.overlap,
            beat=lambda: ctx.client.heartbeat(ctx.member, "learner", {
                **self.last_record, "state": "waiting for engines", "version": self.version}))
        self.writer = make_sinks(self.cfg.monitor, self.cfg.run_dir, self.cfg.run.name,
                                 self.cfg.model_dump(mode="json"))
        self.endpoint = start_endpoint(self.cfg.monitor, "learner", ctx.member)
        self.evaluator = evaluator(self.cfg, model_dir)
        self.start = self.last_step_end = time.monotonic()
        self.last_state: dict[str, Any] | None = None
        self.last_eval: dict[str, float] = {}
        self._record: dict[str, Any] = {}  # the last step's
        self._ranks_sent: dict[str, int] = {}  # every rank's sent totals, as last gathered
        self.version = 0  # the latest version handed to the publisher
        # the eval that reached eval.stop_at_accuracy: {"version", "score", "target"}
        self.reached: dict[str, Any] | None = None

    def starting(self, version: int, reached: dict[str, Any] | None) -> None:
        self.reached = reached
        self.writer.started_from(version)  # later steps' records: another line

    def resumed(self, state, version: int) -> None:
        """After a restart from a checkpoint, engines that outlived the learner hold weights it
        lost: send them the restored ones right away, and again to any that join later."""
        self.last_state, self.version = state, version
        # a fresh buffer learns V; a surviving one has it
        self.publisher.deliver_now(state, version)

    # The batch: rank 0's feed.
    def poll(self, version: int, stop: threading.Event, lost: Lost) -> tuple[bool, bool]:
        return self.feed.poll(version, stop, lost)

    def take_ready(self, version: int) -> None:
        self.feed.take_ready(version)

    def leased(self) -> contextlib.AbstractContextManager[Any]:
        return self.feed.leased()

    def prefetch(self, version: int) -> None:
        self.feed.prefetch(version)

    def next_shares(self, version: int) -> Any | None:
        return self.feed.next_shares(version)

    def ack(self, version: int, metrics: dict[str, Any], lost: Lost) -> dict[str, Any]:
        return self.feed.ack(version, metrics, lost)

    def say(self, message: str, *args: Any) -> None:
        logger.info(message, *args)

    def publish(self, version: int, state, metrics: dict, stats: dict,
                phase_times: dict, lost: Lost) -> bool:
        """Publish the step's weights and write its record; the record is written even when
        the buffer is lost (``lost``: its requests are skipped), so that every trained step,
        saved by :func:`~learners.lost.save_before_exit`, has one. Returns whether the eval
        target is reached."""
        self.version = version
        # overlap: the previous version's metrics
        sync = lost.call(self.publisher.publish, state, version, default={})
        self.last_state = state
        now = time.monotonic()
        step_s = now - self.last_step_end
        metrics["perf/trained_tokens_per_s"] = metrics["perf/trained_tokens"] / step_s
        self.last_step_end = now
        record = {"step": version, "training/global_step": version,
                  "time_s": round(now - self.start, 3), "timing/step": step_s, **metrics,
                  **phase_times, **sync, **self._ranks_sent,
                  **{f"buffer/{k}": v for k, v in stats.items()},
                  **lost.call(self._rollout_totals, default={})}
        if self.cfg.eval.every_steps and version % self.cfg.eval.every_steps == 0:
            record.update(self.evaluate(state, version))
        self.writer.write(record)
        if self.endpoint is not None:
            self.endpoint.publish(record)
        self._record = record
        lost.call(self.ctx.client.heartbeat, self.ctx.member, "learner", self.last_record)
        _log_step(record)
        target = self.cfg.eval.stop_at_accuracy
        score = val_score(record)
        if target is not None and score is not None and score >= target:
            self.reached = {"version": version, "score": float(score), "target": target}
        return self.reached is not None

    @property
    def last_record(self) -> dict[str, Any]:
        """The last step's record as every heartbeat of the learner carries it: with the
        engines the weight sync evicted and why (``weights/evictions``, until each is heard
        from again), which the monitor shows."""
        evicted = self.publisher.broadcaster.evictions()
        return {**self._record, EVICTIONS: evicted} if evicted else self._record

    def evaluate(self, state, version: int) -> dict[str, float]:
        self.last_eval = self.evaluator.evaluate(state, version)
        return self.last_eval

    def resync_late_joiners(self, version: int) -> None:
        """An engine that joined after the last step would wait for weights forever while
        the learner waits for data (with small s): give it the current version now."""
        if self.last_state is not None:
            self.publisher.resync(self.last_state, version)

    def _rollout_totals(self) -> dict[str, float]:
        members = self.ctx.client.status().get("members", {})
        rollouts = [m for m in members.values() if m.get("role") == "rollout"]
        infos = [m.get("info", {}) for m in rollouts if m.get("alive")]
        return {"rollout/workers": len(infos),
                "rollout/tokens_per_s": sum(i.get("tokens_per_s", 0.0) for i in infos),
                "rollout/gate_wait_s": sum(i.get("gate_wait_s", 0.0) for i in infos),
                "rollout/generate_s": sum(i.get("generate_s", 0.0) for i in infos),
                **fleet_counters(m.get("info", {}) for m in rollouts)}

    def finish(self, state, version: int, done: bool) -> None:
        """The final eval, and, when training finished (``done``), the run marked done: its
        workers exit and the buffer discards what was never consumed. A stopped run is left
        running for its resume: its broker replays the status from the spill file (Redis
        keeps it), and a resumed run marked done would find its workers gone."""
        # the last version is published before the run is marked done; its delivery's
        # figures (weights/*), which no step's record carries, go in the final record
        delivered = self.publisher.wait()
        final = self.evaluate(state, version)
        record = {"step": "final", "time_s": round(time.monotonic() - self.start, 3),
                  **delivered, **final}
        self.writer.write(record)
        (self.cfg.run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        if done:
            self.ctx.client.set_key(RUN_STATUS_KEY, {"status": DONE})
        self.close()
        logger.info("final held-out greedy eval: %s", final)

    def close(self, buffer_lost: bool = False) -> None:
        """Finish the weight delivery in flight (engines leave), flush the metric sinks and stop
        serving /metrics (idempotent). ``buffer_lost``: the delivery in flight failing for want
        of the buffer is expected, logged, not raised (the role exits on
        :class:`~learners.lost.BufferLost`)."""
        self.feed.close()
        if self.weights_client is not None:
            try:
                self.publisher.close()
            except Exception as exc:
                if not (buffer_lost and unanswered(exc)):
                    raise
                logger.warning("the weight delivery in flight ended with the buffer: %s",
                               unanswered(exc))
            finally:
                self.weights_client.close()
                self.weights_client = None
        self.writer.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


    def left_group(self) -> None:
        pass   # closed before the group's barrier: the other ranks' senders served it

    def sent_totals(self) -> list[int]:
        broadcaster = self.publisher.broadcaster
        return [broadcaster.sent_bytes, broadcaster.sent_engines]

    def ranks_sent(self, totals: list[list[int]]) -> None:
        """With fan-out, the next record says what each rank sent so far (gathered at the
        end of this step: rank 0's delivery of this version is still under way then)."""
        if self.senders > 1:
            self._ranks_sent = {
                **{f"weights/rank{k}/sent_bytes_total": row[0] for k, row in enumerate(totals)},
                **{f"weights/rank{k}/sent_engines_total": row[1]
                   for k, row in enumerate(totals)}}


def fleet_counters(infos: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The workers' own counters (``reward/*``, ``rollout/*``: namespaced, whole numbers,
    counted since each worker started), summed over every worker the buffer knows, the ones
    that left included: a total that only grows while the buffer lives."""
    totals: Counter[str] = Counter()
    for info in infos:
        totals.update({k: v for k, v in info.items()
                       if "/" in k and isinstance(v, int) and not isinstance(v, bool)})
    return dict(totals)


def _log_step(record: dict) -> None:
    score = val_score(record)
    failed = record.get("reward/failed", 0)
    logger.info("step %s  score %.3f  loss %+.4f  staleness max %d  %s%s",
                record["step"], record.get("critic/score/mean", float("nan")),
                record.get("actor/loss", float("nan")),
                record.get("staleness/max", 0),
                f"val score {score:.3f}" if score is not None else "",
                f"  rewards failed {failed} of {failed + record.get('reward/ok', 0)}"
                if failed else "")
