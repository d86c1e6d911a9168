"""The Redis backend: :class:`~buffers.protocol.BufferClient` over Redis Streams.

Redis is the broker: there is no ``asyncrl buffer`` process. Groups are entries of one stream;
learners read them through the consumer group ``learners`` and ack after the optimizer step
that used them, so the run is at-least-once and loses nothing a durable Redis kept (AOF).
Every rule that touches two counters is one Lua script (:mod:`buffers.redis_scripts`, which
also documents the key layout).

Choices worth knowing:

- A batch is taken **all or nothing** inside one script: the script claims entries idle on
  other consumers for ``reclaim_idle_s`` (their owner is presumed dead) plus unread ones, and
  only when together they make ``count`` fresh groups. So several learners never strand
  partial batches at the end of the data. (``XPENDING IDLE`` + ``XCLAIM`` rather than
  ``XAUTOCLAIM``: the latter would also re-serve the caller's own slow batches and claim
  before it is known that a full batch can be formed.) Only an entry rejected when decoded
  (a producer that bypassed this client) leaves a partial batch, held here and topped up.
- A served batch must be acked within ``reclaim_idle_s``, or another learner takes it over.
- Consumer names are made unique per client (``name-pid-random``), so a restarted learner
  never silently inherits its dead predecessor's pending groups: they are reclaimed.
- Waiting is blocking reads, not spinning: ``get_batch`` blocks on the index stream for a new
  put (waking at least every ``reclaim_idle_s / 4`` to look for reclaimable groups) and
  ``get_key`` on a notification stream; the position is read atomically with the check, so a
  write in between is never missed. A full buffer makes ``put`` poll with a backoff of up to
  0.2 s (acks are not announced), then raise :class:`TimeoutError` after
  ``request_timeout_s``: unread data is never trimmed. ``put_many`` (``put`` is one of
  one) pays one round trip per ``PUT_WINDOW`` groups; the script takes them in order.
- ``gate_closed_s`` is accrued by the scripts that change the gate, so a transition caused
  only by time (a producer declared dead) is noticed at the next call of any client.
- Lost connections are retried (:mod:`buffers.redis_connect`). A connection lost after a
  script ran but before its reply arrived runs it again: a put then stores a duplicate group
  (at-least-once), an acquire holds its slots until the producer releases or goes silent.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import orjson
from redis.exceptions import RedisError, ResponseError

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import StalenessGate
from asyncrl.wire import Rejections, TrajectoryGroup, WireError, encode_group_views
from buffers.protocol import DONE, RUNNING, Batch, Grant, PutResult
from buffers.redis_connect import connect
from buffers.redis_entries import decode_entry, entry_order, put_args, put_results
from buffers.redis_scripts import GROUP, PRELUDE, SCRIPTS, RedisKeys
from buffers.redis_status import assemble_status, batch_stats

logger = logging.getLogger(__name__)

RUN_STATUS_KEY = "run/status"
PUT_BACKOFF_S = (0.01, 0.2)  # first and largest wait while the buffer is full
PUT_WINDOW = 8  # put_many: groups per script call (each call blocks Redis while it runs)


class BufferRefused(RuntimeError):
    """A request the buffer's rules refuse (a version going back, an unknown run status)."""


class RedisBufferClient:
    """Buffer and control plane of run ``run_id`` in the Redis at ``config.url``.

    Not thread-safe (like every client): open one per thread.
    """

    def __init__(self, config: BufferConfig, run_id: str = "", groups_per_step: int = 1) -> None:
        self.config = config
        self.gate = StalenessGate(config.max_staleness, groups_per_step)
        self.keys = RedisKeys(config.namespace or f"asyncrl:{run_id or 'default'}")
        self._redis = connect(config)
        self._scripts = {name: self._redis.register_script(PRELUDE + body)
                         for name, body in SCRIPTS.items()}
        self._params = [config.max_staleness, groups_per_step, config.max_groups,
                        int(config.heartbeat_timeout_s * 1000)]
        self._rejections = Rejections()
        self._consumers: dict[str, str] = {}
        self._held: dict[str, list[tuple[str, TrajectoryGroup]]] = {}
        self._dropped: Counter[str] = Counter()
        self._served: dict[str, int] = {}  # receipt -> staleness when served, until acked
        self._wake_s = max(0.01, min(1.0, config.reclaim_idle_s / 4,
                                     config.request_timeout_s / 2))
        self.run_id = self._run("init", run_id).decode()
        if run_id and self.run_id != run_id:
            logger.warning("namespace %s belongs to run %r, not %r", self.keys.namespace,
                           self.run_id, run_id)

    def _run(self, script: str, *args: Any) -> Any:
        return self._scripts[script](keys=self.keys.all(), args=[*self._params, *args])

    def close(self) -> None:
        """Forget consumers that hold nothing (their pending groups must stay reclaimable)."""
        try:
            for name in self._consumers.values():
                if not self._redis.xpending_range(self.keys.groups, GROUP, "-", "+", 1, name):
                    self._redis.xgroup_delconsumer(self.keys.groups, GROUP, name)
        except RedisError as exc:  # closing must work with the server gone too
            logger.warning("redis buffer %s: consumers not tidied on close: %s",
                           self.keys.namespace, exc)
        finally:
            self._redis.close()

    def __enter__(self) -> RedisBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- producers ------------------------------------------------------------------------

    def acquire(self, producer: str, want: int, engine_version: int) -> Grant:
        granted, version, status = self._run("acquire", producer, max(0, want), engine_version)
        return Grant(granted=int(granted), version=int(version), run_status=status.decode())

    def release(self, producer: str, count: int) -> None:
        self._run("release", producer, max(0, count))

    def put(self, producer: str, group: TrajectoryGroup) -> PutResult:
        return self.put_many(producer, [group])[0]

    def put_frames(self, producer: str, frames: Sequence[bytes]) -> PutResult:
        """Put already-encoded frames; validated here, and again by consumers."""
        args = put_args(frames, self.config.max_message_bytes, self._rejections, producer)
        return self._put_items(producer, [args])[0]

    def put_many(self, producer: str, groups: Sequence[TrajectoryGroup],
                 window: int = PUT_WINDOW) -> list[PutResult]:
        """:meth:`Buffer.put_many <buffers.protocol.Buffer.put_many>` with one script call
        per ``window`` groups (a bound on how long one call blocks Redis). All or error."""
        if window < 1:
            raise ValueError(f"window {window} must be >= 1")
        items = [put_args(encode_group_views(group), self.config.max_message_bytes,
                          self._rejections, producer) for group in groups]
        return self._put_items(producer, items, window)

    def _put_items(self, producer: str, items: list[list[Any]],
                   window: int = PUT_WINDOW) -> list[PutResult]:
        """Send ``items`` in windows; while the buffer is full, poll with a backoff; give up
        after ``request_timeout_s`` without progress (the rest then stays unaccepted)."""
        results: list[PutResult] = []
        deadline = time.monotonic() + self.config.request_timeout_s
        delay = PUT_BACKOFF_S[0]
        while len(results) < len(items):
            window_items = items[len(results):len(results) + window]
            done, full = put_results(self._run("put_many", producer,
                                               *[arg for item in window_items for arg in item]))
            results += done
            if done:  # progress: the timeout counts from here, like a fresh put
                deadline = time.monotonic() + self.config.request_timeout_s
                delay = PUT_BACKOFF_S[0]
            if full and time.monotonic() + delay > deadline:
                raise TimeoutError(f"redis buffer {self.keys.namespace}: still full (max_groups="
                                   f"{self.config.max_groups}) after "
                                   f"{self.config.request_timeout_s:.1f}s")
            if full:
                time.sleep(delay)  # backpressure: wait for learners to ack
                delay = min(PUT_BACKOFF_S[1], delay * 2)
        return results

    # --- learners -------------------------------------------------------------------------

    def get_batch(self, consumer: str, count: int, learner_version: int,
                  timeout_s: float) -> Batch | None:
        if not 1 <= count <= self.config.max_groups:
            raise ValueError(f"count {count} must be in [1, max_groups={self.config.max_groups}]")
        held = self._held.setdefault(consumer, [])
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._drop_stale_held(consumer, learner_version)
            tail, stats = self._take(consumer, count - len(held), learner_version)
            if len(held) >= count:
                return self._serve(consumer, count, learner_version, stats)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            wait_ms = max(1, int(min(remaining, self._wake_s) * 1000))
            self._redis.xread({self.keys.index: tail}, count=1, block=wait_ms)

    def _consumer_name(self, consumer: str) -> str:
        if consumer not in self._consumers:
            self._consumers[consumer] = f"{consumer}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return self._consumers[consumer]

    def _take(self, consumer: str, need: int, learner_version: int) -> tuple[bytes, list]:
        """One take script; valid entries join this consumer's held list."""
        held = self._held[consumer]
        lost, dropped, entries, tail, stats = self._run(
            "take", self._consumer_name(consumer), max(0, need), learner_version,
            int(self.config.reclaim_idle_s * 1000), *[entry_id for entry_id, _ in held])
        if lost:
            logger.warning("%d held groups were reclaimed by another consumer", len(lost))
            gone = {i.decode() for i in lost}
            held[:] = [(i, g) for i, g in held if i not in gone]
        self._dropped[consumer] += int(dropped)
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            try:
                held.append((entry_id, decode_entry(fields, self.config.max_message_bytes)))
            except WireError as exc:
                self._rejections.add(exc, f"stream entry {entry_id}")
                self._run("discard", "reject", exc.reason, entry_id)
        return tail, stats

    def _drop_stale_held(self, consumer: str, learner_version: int) -> None:
        held = self._held[consumer]
        stale = [i for i, g in held if not self.gate.is_fresh(learner_version, g.min_version())]
        if stale:
            self._run("discard", "stale", "", *stale)
            self._dropped[consumer] += len(stale)
            held[:] = [(i, g) for i, g in held if i not in stale]

    def _serve(self, consumer: str, count: int, learner_version: int, stats: list) -> Batch:
        held = self._held[consumer]
        held.sort(key=lambda item: entry_order(item[0]))  # oldest first: FIFO per producer
        served, held[:] = held[:count], held[count:]
        for entry_id, group in served:
            self._served[entry_id] = group.staleness(learner_version)
        return Batch(groups=[g for _, g in served], dropped_stale=self._dropped.pop(consumer, 0),
                     stats=batch_stats(stats), receipts=[i for i, _ in served])

    def ack(self, consumer: str, batch: Batch) -> None:
        if not batch.receipts:
            return
        args: list[Any] = []
        for receipt in batch.receipts:
            args += [receipt, self._served.pop(receipt, 0)]
        acked = int(self._run("ack", *args))
        if acked < len(batch.receipts):
            logger.warning("%s: %d of %d groups were already acked (reclaimed and trained "
                           "elsewhere: at-least-once)", consumer,
                           len(batch.receipts) - acked, len(batch.receipts))

    def renew(self, consumer: str, batch: Batch) -> int:
        """Keep ``batch`` from being reclaimed during a long step (see the protocol)."""
        name = self._consumers.get(consumer)
        if name is None or not batch.receipts:
            return 0
        return int(self._run("renew", name, *batch.receipts))

    # --- control plane --------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        try:
            self._run("publish_version", version)
        except ResponseError as exc:
            if "is behind" in str(exc):
                raise BufferRefused(f"redis buffer {self.keys.namespace}: {exc}") from None
            raise

    def restore_progress(self, version: int, consumed: int) -> int:
        return int(self._run("restore_progress", version, consumed))

    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> dict[str, Any]:
        version, status = self._run("heartbeat", member, role, _dumps(info))
        return {"version": int(version), "run_status": status.decode()}

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        status = ""
        if key == RUN_STATUS_KEY:
            status = value.get("status")
            if status not in (RUNNING, DONE):
                raise BufferRefused(f"run_status: unknown run status {status!r}")
        return int(self._run("set_key", key, _dumps(value), status))

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        if not keys:
            return {}
        pipe = self._redis.pipeline(transaction=True)  # each value with its own seq
        pipe.hmget(self.keys.kvseq, list(keys)).hmget(self.keys.kv, list(keys))
        seqs, values = pipe.execute()
        return {key: (int(seq), orjson.loads(value))
                for key, seq, value in zip(keys, seqs, values) if seq is not None}

    def get_key(self, key: str, newer_than: int = 0,
                timeout_s: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            pipe = self._redis.pipeline(transaction=True)  # value and wake-up position at once
            pipe.hget(self.keys.kvseq, key).hget(self.keys.kv, key)
            pipe.xrevrange(self.keys.notify, count=1)
            seq, value, last = pipe.execute()
            if seq is not None and int(seq) > newer_than:
                return int(seq), orjson.loads(value)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            wait_s = min(remaining, self.config.request_timeout_s / 2)
            self._redis.xread({self.keys.notify: last[0][0] if last else b"0-0"}, count=1,
                              block=max(1, int(wait_s * 1000)))

    def status(self) -> dict[str, Any]:
        self._run("reap")
        pipe = self._redis.pipeline(transaction=True)
        for name in ("state", "inflight", "seen", "roles", "info", "rejected", "hist"):
            pipe.hgetall(getattr(self.keys, name))
        pipe.hkeys(self.keys.kvseq).xlen(self.keys.groups)
        pipe.xpending(self.keys.groups, GROUP).time()
        return assemble_status(pipe.execute(), self.gate, self.config, self.keys.namespace)


def _dumps(value: dict[str, Any]) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def reset_run(config: BufferConfig, run_id: str) -> int:
    """Delete every key of run ``run_id``'s namespace; returns how many were deleted.

    ``asyncrl up`` starts a new run: without this, a second run of the same name would inherit
    the first one's version, gate counters and leftover groups from Redis.
    """
    keys = RedisKeys(config.namespace or f"asyncrl:{run_id or 'default'}").all()
    client = connect(config)
    try:
        return int(client.unlink(*keys))
    finally:
        client.close()
