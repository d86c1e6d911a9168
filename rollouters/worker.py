"""The rollout worker loop: ask the gate, generate groups, hand them to the buffer.

Weights arrive on a background thread (:func:`rollouters.engines.make_weight_receiver`) and are
loaded between decode steps, so generation never stops for a sync; every token records its
version. The heartbeat has a thread of its own too (:class:`rollouters.heartbeat.Heartbeat`):
a worker busy with a long batch is alive, only a stopped or dead process falls silent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.config import Config, ConfigError
from asyncrl.control_plane import STOPPED
from asyncrl.metrics import RateMeter
from asyncrl.prometheus import MetricsEndpoint, start_endpoint
from buffers import BufferClient, BufferStopped, connect_buffer
from buffers.protocol import DATA_EXHAUSTED, DONE
from rollouters.colocate import follow_phases
from rollouters.heartbeat import Heartbeat

if TYPE_CHECKING:
    from asyncrl.weights.receiver import WeightReceiver

logger = logging.getLogger(__name__)

GATE_POLL_S = 0.02  # re-ask a closed gate this soon when the buffer's version is due to move
GATE_IDLE_S = 0.5  # otherwise wait up to this long for new weights before asking again
HEARTBEAT_S = 1.0
# rollout.engine = "sim": workers per process, as threads (a simulated engine only waits; a few
# processes keep the interpreter lock from serialising 64 engines' protocol work).
SIM_WORKERS_PER_PROCESS = 16


@dataclass
class WorkerStats:
    groups: int = 0
    rejected: int = 0
    gate_wait_s: float = 0.0
    generate_s: float = 0.0


def member_name(index: int, pid: int) -> str:
    """A worker's name on the control plane: a restarted worker is a new member."""
    return f"rollout-{index}-{pid}"


def report_crashed(cfg: Config, address: str | None, index: int, pid: int, reason: str,
                   stop: threading.Event | None = None) -> None:
    """Say on the control plane, for worker ``index`` (process ``pid``) that died without its
    last heartbeat, what that heartbeat would have said: stopped. Its supervisor calls this:
    the learner then stops waiting for it in a weight update at once, instead of after
    ``buffer.heartbeat_timeout_s`` of silence (the whole run waits while it does).
    ``stop``: the supervisor's stop event (a stopping supervisor does not wait for it)."""
    member = member_name(index, pid)
    try:
        with connect_buffer(cfg, address, stop) as client:
            client.heartbeat(member, "rollout", {"state": STOPPED, "exit": reason})
    except Exception as exc:  # noqa: BLE001 - the heartbeat timeout still ends the wait
        logger.warning("could not report %s as stopped: %s", member, exc)


def run_rollout_worker(cfg: Config, index: int, address: str | None,
                       stop: threading.Event | None = None) -> None:
    """Run worker ``index`` against the buffer at ``address`` until the run is done or stopped."""
    import torch

    from asyncrl.models import prepare_model_dir
    from asyncrl.net import broadcast_host
    from asyncrl.tokens import ModelTokenizer
    from rollouters.engines import make_engine, make_weight_receiver
    from rollouters.producers import make_producer

    stop = stop or threading.Event()
    torch.set_num_threads(cfg.rollout.threads)
    member = member_name(index, os.getpid())
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    tokens = ModelTokenizer(model_dir)  # loaded once, for the engine and the producer
    engine = make_engine(cfg, model_dir, index, tokens)
    producer = make_producer(cfg, engine, tokens, index, stop)
    client = connect_buffer(cfg, address, stop)
    receiver_client = connect_buffer(cfg, address, stop)  # clients are per thread
    receiver = make_weight_receiver(engine, receiver_client, member,
                                    host=broadcast_host(cfg, address))
    beat_client = connect_buffer(cfg, address, stop)
    beat = Heartbeat(beat_client, member, {"engine_version": engine.version}, HEARTBEAT_S)
    endpoint = start_endpoint(cfg.monitor, "rollout", member, index)
    unfollow = lambda: None  # noqa: E731 - launcher.colocate: ends the phase follower
    try:
        client.heartbeat(member, "rollout", {"engine_version": engine.version})
        receiver.start()
        beat.start()
        unfollow = follow_phases(cfg, engine, receiver, member, address, stop, beat)
        logger.info("%s ready (model %s), buffer %s", member, model_dir, address)
        _loop(cfg, index, member, engine, producer, client, stop, endpoint, receiver, beat)
    finally:
        unfollow()  # before the engine closes: it wakes an engine left asleep
        beat.stop()
        producer.close()
        if endpoint is not None:
            endpoint.close()
        receiver.stop()
        for each in (receiver_client, beat_client, client):
            each.close()
        engine.close()
        logger.info("%s stopped", member)


def run_worker_threads(cfg: Config, indices: list[int], address: str | None,
                       stop: threading.Event) -> None:
    """Rollout workers ``indices`` as threads of this process, sharing ``stop``; the first
    failure stops the others, and this raises once all have ended: the first config error
    as it is (the process then exits 2 and is not restarted, as a worker process would),
    else a RuntimeError naming the failed workers."""
    failures: list[int] = []
    config_errors: list[ConfigError] = []

    def run(index: int) -> None:
        try:
            run_rollout_worker(cfg, index, address, stop)
        except BufferStopped as exc:  # the stop asked for (a signal), with the broker gone
            logger.info("rollout worker %d stopped without waiting for the buffer: %s",
                        index, exc)
        except Exception as exc:  # noqa: BLE001 - reported, then every thread is stopped
            logger.exception("rollout worker %d failed: stopping the others", index)
            failures.append(index)
            if isinstance(exc, ConfigError):
                config_errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(i,), name=f"rollout-{i}", daemon=True)
               for i in indices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if config_errors:
        raise config_errors[0]
    if failures:
        raise RuntimeError(f"rollout workers {sorted(failures)} failed")


def _loop(cfg: Config, index: int, member: str, engine, producer, client: BufferClient,
          stop: threading.Event, endpoint: MetricsEndpoint | None,
          receiver: WeightReceiver, beat: Heartbeat) -> None:
    stats, tokens = WorkerStats(), RateMeter()
    next_beat, last = 0.0, {"state": STOPPED}
    while not stop.is_set():
        if receiver.refused is not None:  # no update will fit: stop, and say so (below)
            last.update(exit="refused the learner's weights")
            break
        if time.monotonic() >= next_beat:
            info = {**_info(engine, stats, tokens), **producer.metrics()}
            beat.update(info)  # the heartbeat thread sends it
            if endpoint is not None:  # producer metrics are namespaced already
                endpoint.publish({k if "/" in k else f"rollout/{k}": v for k, v in info.items()})
            next_beat = time.monotonic() + HEARTBEAT_S
            if beat.reply.get("run_status") == DONE:
                break
        grant = client.acquire(member, cfg.rollout.groups_per_batch, engine.version)
        if grant.run_status == DONE:
            break
        if grant.granted == 0:
            start = time.perf_counter()
            _wait_for_gate(grant.version, engine.version, receiver, stop)
            stats.gate_wait_s += time.perf_counter() - start
            continue
        start = time.perf_counter()
        groups = producer.produce(grant.granted)
        stats.generate_s += time.perf_counter() - start
        if len(groups) < grant.granted:  # episodes dropped, or the data ran out
            client.release(member, grant.granted - len(groups))
        if stop.is_set() and not groups:  # stopped mid-window: its samples are read again
            break
        if groups:
            results = client.put_many(member, groups)  # one round trip per window
            stats.groups += sum(r.accepted for r in results)
            stats.rejected += sum(not r.accepted for r in results)
            tokens.add(sum(group.num_generated for group in groups))
        producer.handed_over()
        if producer.exhausted:
            logger.info("%s: data exhausted (data.epochs = %d)", member, cfg.data.epochs)
            # the learner ends the run once every worker's share ran out
            last.update(exit=DATA_EXHAUSTED, shard=[index, cfg.rollout.workers])
            break
    beat.stop()  # no heartbeat may follow the last one, which says the worker stopped
    client.heartbeat(member, "rollout",
                     {**_info(engine, stats, tokens), **producer.metrics(), **last})
    if receiver.refused is not None:
        raise refused_weights(receiver.refused)


def refused_weights(exc: Exception) -> ConfigError:
    """The config error a refused weight update becomes: the learner's model is not this
    worker's, so no later update fits either, and a restart would only load the same model
    again. Its fleet stops with this line (exit status 2, not restarted)."""
    return ConfigError(f"model: this rollout worker's model does not take the learner's "
                       f"weights ({exc}); every fleet must load the learner's model "
                       f"(the same model.path, model.tiny.* and model.lora)")


def _wait_for_gate(buffer_version: int, engine_version: int, receiver: WeightReceiver,
                   stop: threading.Event) -> None:
    """Wait before asking a closed gate again, without polling the buffer in a tight loop.

    The gate opens when the learner publishes a version, and the learner publishes only after
    the engines acked its weights. So: if this engine already holds weights newer than the
    buffer's version, the publish is a moment away: ask again soon. Otherwise nothing will
    open the gate before new weights arrive: wait for them (event-driven, no request), at most
    ``GATE_IDLE_S`` (a release by another worker can open it too). With 64 engines this turns
    thousands of refused requests per second into a handful."""
    if engine_version > buffer_version:
        stop.wait(GATE_POLL_S)
    else:
        receiver.wait_for_version(engine_version + 1, GATE_IDLE_S)


def _info(engine, stats: WorkerStats, tokens: RateMeter) -> dict:
    return {"engine_version": engine.version, "groups": stats.groups,
            "rejected": stats.rejected, "gate_wait_s": round(stats.gate_wait_s, 3),
            "generate_s": round(stats.generate_s, 3), "tokens_per_s": round(tokens.rate(), 1),
            "tokens": tokens.total,
            # launcher.colocate: a sleeping engine says so (the loop may wait at the gate)
            **({"phase": "asleep"} if getattr(engine, "asleep", False) else {})}
