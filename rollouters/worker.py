"""The rollout worker loop: ask the gate, generate groups, hand them to the buffer.

Weights arrive on a background thread (:class:`learners.weights.WeightReceiver`) and are loaded
between decode steps, so generation never stops for a sync; every token records its version.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass

from asyncrl.config import Config
from asyncrl.metrics import RateMeter
from buffers import BufferClient, connect_buffer
from buffers.protocol import DONE

logger = logging.getLogger(__name__)

GATE_POLL_S = 0.02  # how often a worker re-asks a closed gate (a loopback round trip is ~0.1 ms)
HEARTBEAT_S = 1.0


@dataclass
class WorkerStats:
    groups: int = 0
    rejected: int = 0
    gate_wait_s: float = 0.0
    generate_s: float = 0.0


def run_rollout_worker(cfg: Config, index: int, address: str | None,
                       stop: threading.Event | None = None) -> None:
    """Run worker ``index`` against the buffer at ``address`` until the run is done or stopped."""
    import torch

    from asyncrl.models import prepare_model_dir
    from learners.weights_receiver import WeightReceiver
    from rollouters.engines import make_engine
    from rollouters.tasks import make_task

    stop = stop or threading.Event()
    torch.set_num_threads(cfg.rollout.threads)
    member = f"rollout-{index}-{os.getpid()}"
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    engine = make_engine(cfg, model_dir, index)
    task = make_task(cfg.task, cfg.run.seed)
    client = connect_buffer(cfg, address)
    receiver_client = connect_buffer(cfg, address)  # clients are per thread
    receiver = WeightReceiver(receiver_client, member,
                              lambda named, version: engine.load_weights(named.items(), version))
    try:
        client.heartbeat(member, "rollout", {"engine_version": engine.version})
        receiver.start()
        logger.info("%s ready (model %s), buffer %s", member, model_dir, address)
        rng = random.Random(cfg.run.seed * 7919 + index)
        _loop(cfg, member, engine, task, client, rng, stop)
    finally:
        receiver.stop()
        receiver_client.close()
        client.close()
        engine.close()
        logger.info("%s stopped", member)


def _loop(cfg: Config, member: str, engine, task, client: BufferClient,
          rng: random.Random, stop: threading.Event) -> None:
    from rollouters.workflows.single_turn import generate_groups

    stats, tokens = WorkerStats(), RateMeter()
    next_beat = 0.0
    while not stop.is_set():
        if time.monotonic() >= next_beat:
            state = client.heartbeat(member, "rollout", _info(engine, stats, tokens))
            next_beat = time.monotonic() + HEARTBEAT_S
            if state.get("run_status") == DONE:
                break
        grant = client.acquire(member, cfg.rollout.groups_per_batch, engine.version)
        if grant.run_status == DONE:
            break
        if grant.granted == 0:
            start = time.perf_counter()
            stop.wait(GATE_POLL_S)
            stats.gate_wait_s += time.perf_counter() - start
            continue
        start = time.perf_counter()
        groups = generate_groups(engine, task, task.sample(rng, grant.granted),
                                 cfg.rollout.group_size, cfg.rollout.temperature,
                                 cfg.rollout.max_new_tokens, run_id=cfg.run.name)
        stats.generate_s += time.perf_counter() - start
        results = client.put_many(member, groups)  # one round trip per window, not per group
        stats.groups += sum(r.accepted for r in results)
        stats.rejected += sum(not r.accepted for r in results)
        tokens.add(sum(group.num_generated for group in groups))
    client.heartbeat(member, "rollout", {**_info(engine, stats, tokens), "state": "stopped"})


def _info(engine, stats: WorkerStats, tokens: RateMeter) -> dict:
    return {"engine_version": engine.version, "groups": stats.groups,
            "rejected": stats.rejected, "gate_wait_s": round(stats.gate_wait_s, 3),
            "generate_s": round(stats.generate_s, 3), "tokens_per_s": round(tokens.rate(), 1),
            "tokens": tokens.total}
