"""The Redis backend: :class:`~buffers.protocol.BufferClient` over Redis Streams.

Redis is the broker: there is no ``asyncrl buffer`` process. Each accepted group is an entry
of an index stream naming its payload (the packed frames under their own key); learners read
the index through the consumer group ``learners`` and ack after the optimizer step that used
them, so the run is at-least-once and loses nothing a durable Redis kept (AOF). Every rule that
touches two counters is one Lua script (:mod:`buffers.redis_scripts`, which also documents the
key layout); payloads never pass through Lua, they move with plain ``SET`` and ``MGET``.

Choices worth knowing:

- A batch is taken **all or nothing** inside one script: the script claims entries idle for
  ``reclaim_idle_s`` (nobody renewed them: their owner is presumed dead) plus unread ones,
  and only when together they make ``count`` fresh groups. So several learners never strand
  partial batches at the end of the data. (``XPENDING IDLE`` + ``XCLAIM`` rather than
  ``XAUTOCLAIM``: the latter would claim before it is known that a full batch can be
  formed.) Only an entry rejected when decoded (a producer that bypassed this client)
  leaves a partial batch, held here and topped up.
- Idle entries are reclaimed **whoever holds them**, the caller included: a live learner
  renews what it holds every ``reclaim_idle_s / 3`` (the batch in training, from whichever
  of its clients, see :meth:`RedisConsumer.learner`; a partial batch, at every take), so an
  idle entry of its own is one it does not know it holds (see the retries below).
- Groups are served **earliest deadline first**, as the ZMQ broker serves them: oldest
  version first, each producer's groups in their order. Groups arrive in the order they
  finish, so a long answer started at version v arrives behind groups of v + 1; served by
  arrival it is consumed a step late and dropped as stale (a bias against long answers).
  ``XREADGROUP`` hands out a stream only in arrival order, so every take moves the unread
  entries into the pending list of a reserved consumer (``~queued``), files them in sorted
  sets that keep each producer's entries in order, merges the producers' heads and claims
  the ones it chose (``XCLAIM``): its cost does not grow with what is queued (reading the
  whole index instead took Redis 8 ms at 4,096 queued groups, serving nobody meanwhile).
- A served batch must be acked within ``reclaim_idle_s``, or another learner takes it over.
  ``get_batch(ack=batch)`` acks inside the take script: one round trip for both.
- Consumer names are made unique per client (``name-pid-random``): a client deletes its
  consumers when it closes, and ``XGROUP DELCONSUMER`` drops whatever another client of a
  shared name had claimed meanwhile.
- Waiting is blocking reads, not spinning: ``get_batch`` blocks on the index stream for a new
  put (waking at least every ``reclaim_idle_s / 4`` to look for reclaimable groups) and
  ``get_key`` on a notification stream; the position is read atomically with the check, so a
  write in between is never missed. A full buffer makes ``put`` poll with a backoff of up to
  0.2 s (acks are not announced), then raise :class:`TimeoutError` after
  ``request_timeout_s``: unread data is never trimmed. ``put_many`` (``put`` is one of
  one) pays one round trip per ``PUT_WINDOW`` groups: their payloads are ``SET`` with an
  expiry in the same pipeline as the script that files them in order; a window that found
  the buffer full is retried with the keys alone. So Redis holds at most ``max_groups``
  accepted payloads plus ``PUT_WINDOW`` staged ones per waiting producer.
- ``gate_closed_s`` is accrued by the scripts that change the gate, so a transition caused
  only by time (a producer declared dead) is noticed at the next call of any client.
- A run marked done keeps its counters, members, keys and histograms (what ``asyncrl
  status`` reads) but not its data: the status change discards the groups never consumed
  (entries and payloads, in the same script; counted as ``discarded_at_done``), then the
  client deletes the payloads still staged. Puts are refused from then on.
- Lost connections are retried (:mod:`buffers.redis_connect`). A connection lost after a
  script ran but before its reply arrived runs it again: a put files each group once (its
  payload key, kept once filed, says so); an acquire holds its slots until the producer
  releases or goes silent; a take serves another batch, and the one the first run claimed,
  unknown to the client and never renewed, is reclaimed after ``reclaim_idle_s`` (by this
  consumer too: it was stranded for good with a single learner while a take spared the
  caller's own entries); an ack, a discard or a renewal counts only entries still pending,
  so a second run changes nothing; a release gives back its slots twice (down to none:
  the gate admits up to that many more, once).
- A client given the role's ``stop`` event stops waiting for a Redis that does not answer
  once it is set (:class:`~buffers.redis_stop.StopGuard`): no reconnect retries, about a
  second per request (one already waiting on a hung Redis too), then
  :class:`~buffers.BufferStopped`. Long polls (``get_batch``,
  ``get_key``) still run to their ``timeout_s`` on a live Redis, and a put that finds the
  buffer full waits :data:`STOP_GRACE_S` more, not ``request_timeout_s``, as with ZMQ.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

import orjson
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import StalenessGate
from asyncrl.wire import Rejections, TrajectoryGroup, encode_group_views
from buffers import BufferStopped
from buffers.protocol import DONE, RUN_STATUS_KEY, RUNNING, Batch, Grant, PutResult
from buffers.redis_connect import Client, connect, is_cluster, run_namespace
from buffers.redis_consumer import RedisConsumer
from buffers.redis_entries import StagedPut, put_results, stage_put
from buffers.redis_scripts import GROUP, LEGACY_KEY_NAMES, PAYLOAD_INFIX, PRELUDE, SCRIPTS, \
    RedisKeys
from buffers.redis_status import assemble_status
from buffers.outage import OutageWatch
from buffers.redis_stop import StopGuard, no_answer

logger = logging.getLogger(__name__)

PUT_BACKOFF_S = (0.01, 0.2)  # first and largest wait while the buffer is full
PUT_WINDOW = 8  # put_many: groups per script call (each call blocks Redis while it runs)
STAGE_MARGIN_S = 30.0  # a staged payload outlives 2 x request_timeout_s by this much
STOP_GRACE_S = 0.5  # once stopping: how much longer a put waits for room (ZMQ's grace)
LOST = (RedisError, RedisClusterException, BufferStopped)  # what closing and cleanup survive

F = TypeVar("F", bound=Callable[..., Any])


def _request(method: F) -> F:
    """A request of the client: once its stop event is set, a Redis that does not answer
    raises :class:`~buffers.BufferStopped` (see :class:`~buffers.redis_stop.StopGuard`)."""
    @functools.wraps(method)
    def request(self: RedisBufferClient, *args: Any, **kwargs: Any) -> Any:
        with self._stop.answered(f"redis buffer {self.keys.namespace}: {method.__name__}"):
            try:
                result = method(self, *args, **kwargs)
            except Exception as exc:  # a cluster's failures are not retried by ReconnectRetry
                if no_answer(exc) and not self._stop.stopping():
                    self._outage.failed(exc)
                raise
        self._outage.answered()
        return result

    return cast(F, request)


class BufferRefused(RuntimeError):
    """A request the buffer's rules refuse (a version going back, an unknown run status)."""


class RedisBufferClient:
    """Buffer and control plane of run ``run_id`` in the Redis at ``config.redis.url``.

    Not thread-safe (like every client): open one per thread. ``stop``: the owner's stop
    event (see the module docstring).
    """

    def __init__(self, config: BufferConfig, run_id: str = "", groups_per_step: int = 1,
                 stop: threading.Event | None = None) -> None:
        self.config = config
        self.gate = StalenessGate(config.max_staleness, groups_per_step)
        self._stop = StopGuard(stop)
        self._outage = OutageWatch(config.redis.url)  # warnings: buffers.outage
        with self._stop.answered("redis buffer: connect"):
            self._redis = self._stop.watch(connect(config, stop, self._outage))
        self._cluster = is_cluster(self._redis)
        self.keys = RedisKeys(run_namespace(config, run_id, self._cluster))
        self._all_keys = self.keys.all()
        self._scripts = {name: self._redis.register_script(PRELUDE + body)
                         for name, body in SCRIPTS.items()}
        self._params = [config.max_staleness, groups_per_step, config.max_groups,
                        int(config.heartbeat_timeout_s * 1000)]
        self._rejections = Rejections()
        self._stage_ttl_ms = int((2 * config.request_timeout_s + STAGE_MARGIN_S) * 1000)
        self._consumer = RedisConsumer(self._redis, self._run, self.keys, config, self.gate,
                                       self._rejections, self._stop)
        try:
            self.run_id = self._init(run_id)
        except BaseException:
            self._stop.close()
            self._redis.close()
            raise
        if run_id and self.run_id != run_id:
            logger.warning("namespace %s belongs to run %r, not %r", self.keys.namespace,
                           self.run_id, run_id)

    @_request
    def _init(self, run_id: str) -> str:
        return self._run("init", run_id, self.config.staleness_mode).decode()

    def _run(self, script: str, *args: Any) -> Any:
        return self._scripts[script](keys=self._all_keys, args=[*self._params, *args])

    def close(self) -> None:
        """Forget consumers that hold nothing (their pending groups must stay reclaimable)."""
        try:
            self._stop.stopping()  # a stopping owner's close is bounded too
            self._consumer.tidy()
        except LOST as exc:  # closing must work with the server gone too
            logger.warning("redis buffer %s: consumers not tidied on close: %s",
                           self.keys.namespace, exc)
        finally:
            self._stop.close()
            self._redis.close()

    def __enter__(self) -> RedisBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- producers ------------------------------------------------------------------------

    @_request
    def acquire(self, producer: str, want: int, engine_version: int) -> Grant:
        granted, version, status = self._run("acquire", producer, max(0, want), engine_version)
        return Grant(granted=int(granted), version=int(version), run_status=status.decode())

    @_request
    def release(self, producer: str, count: int) -> None:
        self._run("release", producer, max(0, count))

    def put(self, producer: str, group: TrajectoryGroup) -> PutResult:
        return self.put_many(producer, [group])[0]

    @_request
    def put_frames(self, producer: str, frames: Sequence[bytes]) -> PutResult:
        """Put already-encoded frames; validated here, and again by consumers."""
        staged = stage_put(frames, self.config.max_message_bytes, self._rejections, producer)
        return self._put_items(producer, [staged])[0]

    @_request
    def put_many(self, producer: str, groups: Sequence[TrajectoryGroup],
                 window: int = PUT_WINDOW) -> list[PutResult]:
        """:meth:`Buffer.put_many <buffers.protocol.Buffer.put_many>` with one round trip
        per ``window`` groups (a bound on how long one script call blocks Redis). All or
        error."""
        if window < 1:
            raise ValueError(f"window {window} must be >= 1")
        items = [stage_put(encode_group_views(group), self.config.max_message_bytes,
                           self._rejections, producer, group.group_id) for group in groups]
        return self._put_items(producer, items, window)

    def _put_items(self, producer: str, items: list[StagedPut],
                   window: int = PUT_WINDOW) -> list[PutResult]:
        """Send ``items`` in windows; while the buffer is full, poll with a backoff; give up
        after ``request_timeout_s`` without progress (the rest then stays unaccepted)."""
        results: list[PutResult] = []
        deadline = time.monotonic() + self.config.request_timeout_s
        delay = PUT_BACKOFF_S[0]
        while len(results) < len(items):
            done, full = put_results(self._put_window(
                producer, items[len(results):len(results) + window]))
            for item in items[len(results):len(results) + len(done)]:
                item.payload = None  # handled: Redis has it (or it was rejected)
            results += done
            if done:  # progress: the timeout counts from here, like a fresh put
                deadline = time.monotonic() + self.config.request_timeout_s
                delay = PUT_BACKOFF_S[0]
            if full and self._stop.stopping():  # as the ZMQ broker's put: a short grace
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
            if full and time.monotonic() + delay > deadline:
                self._still_full()
            if full:
                time.sleep(delay)  # backpressure: wait for learners to ack
                delay = min(PUT_BACKOFF_S[1], delay * 2)
        return results

    def _still_full(self) -> NoReturn:
        """The put gave up waiting for room: its remaining groups were not accepted."""
        if self._stop.stopping():
            raise BufferStopped(f"redis buffer {self.keys.namespace}: put: still full "
                                f"(max_groups={self.config.max_groups}); stopping")
        raise TimeoutError(f"redis buffer {self.keys.namespace}: still full (max_groups="
                           f"{self.config.max_groups}) after "
                           f"{self.config.request_timeout_s:.1f}s")

    def _put_window(self, producer: str, items: list[StagedPut]) -> Any:
        """One pipeline: ``SET`` (with an expiry) of the payloads not staged yet, then the
        put script with their keys (on a cluster, the script after the pipeline). Returns
        the script's answers."""
        keys: list[str] = []
        args: list[Any] = [producer, self._stage_ttl_ms]
        for item in items:
            if item.payload is not None and not item.key:
                item.key = self.keys.payload(uuid.uuid4().hex)
            if item.key:
                keys.append(item.key)
            args += [item.reason, item.min_version, item.run_id, len(keys) if item.key else 0]
        if self._cluster:  # redis-py's cluster pipelines refuse scripts: two round trips
            pipe = self._redis.pipeline(transaction=False)
            self._stage(items, pipe)
            pipe.execute()
            answers = self._scripts["put_many"](keys=[*self._all_keys, *keys],
                                                args=[*self._params, *args])
        else:
            answers = self._stage_and_file(items, keys, args)
        for item in items:
            item.staged = item.staged or item.payload is not None
        return answers

    def _stage_and_file(self, items: list[StagedPut], keys: list[str], args: list[Any]) -> Any:
        """The staging ``SET``s and the put script in one pipeline (one round trip)."""
        script = self._scripts["put_many"]

        def send() -> Any:
            pipe = self._redis.pipeline(transaction=False)
            self._stage(items, pipe)
            pipe.evalsha(script.sha, len(self._all_keys) + len(keys), *self._all_keys, *keys,
                         *self._params, *args)
            return pipe.execute()[-1]

        try:
            return send()
        except NoScriptError:  # a restarted Redis forgot the scripts: load, send again
            self._redis.script_load(script.script)
            return send()

    def _stage(self, items: list[StagedPut], pipe: Any) -> None:
        """Queue in ``pipe`` a ``SET`` with an expiry of each payload not staged yet. NX: a
        pipeline re-sent after a lost connection leaves a payload filed as it is."""
        for item in items:
            if item.payload is not None and not item.staged:
                pipe.set(item.key, item.payload, px=self._stage_ttl_ms, nx=True)

    # --- learners -------------------------------------------------------------------------

    @_request
    def get_batch(self, consumer: str, count: int, learner_version: int,
                  timeout_s: float, ack: Batch | None = None) -> Batch | None:
        return self._consumer.get_batch(consumer, count, learner_version, timeout_s, ack)

    @_request
    def ack(self, consumer: str, batch: Batch, consumed: int | None = None) -> None:
        """``consumed`` is not needed here (see the protocol): Redis keeps the counters."""
        self._consumer.ack(consumer, batch)

    @_request
    def renew(self, consumer: str, batch: Batch) -> int:
        """Keep ``batch`` from being reclaimed during a long step (see the protocol)."""
        return self._consumer.renew(consumer, batch)

    # --- control plane --------------------------------------------------------------------

    @_request
    def publish_version(self, version: int) -> None:
        try:
            self._run("publish_version", version)
        except ResponseError as exc:
            if "is behind" in str(exc):
                raise BufferRefused(f"redis buffer {self.keys.namespace}: {exc}") from None
            raise

    @_request
    def restore_progress(self, version: int, consumed: int) -> int:
        return int(self._run("restore_progress", version, consumed))

    @_request
    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> dict[str, Any]:
        version, status = self._run("heartbeat", member, role, _dumps(info))
        return {"version": int(version), "run_status": status.decode()}

    @_request
    def set_key(self, key: str, value: dict[str, Any]) -> int:
        """Marking the run done also discards the groups it never consumed: the script drops
        the filed ones with the status change, then :meth:`_discard_staged` the staged ones."""
        status = ""
        if key == RUN_STATUS_KEY:
            status = value.get("status")
            if status not in (RUNNING, DONE):
                raise BufferRefused(f"run_status: unknown run status {status!r}")
        seq, discarded = self._run("set_key", key, _dumps(value), status)
        if status == DONE:
            self._discard_staged(int(discarded))
        return int(seq)

    def _discard_staged(self, discarded: int) -> None:
        """After the run was marked done: delete the payloads still staged (set by a producer
        whose put script has not run, e.g. one waiting for room). The set_key script already
        deleted every filed group's payload with the status change, atomically, and a put
        script run after it refuses its groups and deletes their payloads, so what is found
        here is dead. Only a payload set after this sweep by a producer that dies before its
        put script runs outlives it, and it expires by itself (staged payloads carry a TTL).
        A failed sweep is logged, not raised: the run is done either way, and what it missed
        expires too."""
        try:
            staged = _payload_keys(self._redis, self.keys)
            deleted = int(self._redis.unlink(*staged)) if staged else 0
        except LOST as exc:
            logger.warning("redis buffer %s: run done; staged payloads not deleted (they "
                           "expire by themselves): %s", self.keys.namespace, exc)
            return
        logger.info("redis buffer %s: run done; %d unconsumed groups and %d staged payloads "
                    "discarded", self.keys.namespace, discarded, deleted)

    @_request
    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        if not keys:
            return {}
        pipe = self._redis.pipeline(transaction=True)  # each value with its own seq
        pipe.hmget(self.keys.kvseq, list(keys)).hmget(self.keys.kv, list(keys))
        seqs, values = pipe.execute()
        return {key: (int(seq), orjson.loads(value))
                for key, seq, value in zip(keys, seqs, values) if seq is not None}

    @_request
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
                              block=self._stop.block_ms(wait_s))

    @_request
    def status(self) -> dict[str, Any]:
        self._run("reap")
        pipe = self._redis.pipeline(transaction=True)
        for name in ("state", "inflight", "seen", "roles", "info", "rejected", "hist"):
            pipe.hgetall(getattr(self.keys, name))
        pipe.hkeys(self.keys.kvseq).xlen(self.keys.index)
        pipe.xpending(self.keys.index, GROUP)
        if self._cluster:  # a keyless command cannot join a cluster transaction: the clock
            node = self._redis.get_node_from_key(self.keys.state)  # of the run's node, after
            snapshot = [*pipe.execute(), self._redis.time(target_nodes=node)]
        else:
            snapshot = pipe.time().execute()
        return assemble_status(snapshot, self.gate, self.config, self.keys.namespace)


def _dumps(value: dict[str, Any]) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def start_run(config: BufferConfig, run_id: str, resuming: bool) -> None:
    """`asyncrl up` starts run ``run_id`` (either launcher): a resumed run keeps its state in
    Redis; a new one starts from an empty namespace (:func:`reset_run`)."""
    if resuming:
        logger.info("redis %s: resuming run %r, its state is kept", config.redis.url, run_id)
        return
    deleted = reset_run(config, run_id)
    logger.info("redis %s: fresh run %r (%d old keys removed)", config.redis.url, run_id, deleted)


def reset_run(config: BufferConfig, run_id: str) -> int:
    """Delete every key of run ``run_id``'s namespace; returns how many were deleted.

    ``asyncrl up`` starts a new run: without this, a second run of the same name would inherit
    the first one's version, gate counters and leftover groups from Redis. Payload keys are
    found by ``SCAN`` (a reset is rare; their names are random).
    """
    client = connect(config)
    keys = RedisKeys(run_namespace(config, run_id, is_cluster(client)))
    names = [*keys.all(), *(f"{keys.namespace}:{name}" for name in LEGACY_KEY_NAMES)]
    try:
        return int(client.unlink(*names, *_payload_keys(client, keys)))
    finally:
        client.close()


def _payload_keys(client: Client, keys: RedisKeys) -> list[str]:
    """Every payload key of the namespace, filed or staged, by ``SCAN`` (their names are
    random; used only at a run's reset and end)."""
    return list(client.scan_iter(match=_glob_escape(keys.namespace) + PAYLOAD_INFIX + "*",
                                 count=1000))


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
