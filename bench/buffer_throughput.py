"""Buffer throughput: groups/s and MB/s through each backend, next to its raw transport.

Every row moves the same trajectory groups (``--samples`` samples of ``--tokens`` tokens, i.e.
13 bytes a token: int32 ids, float32 logprobs, uint8 mask, int32 versions) from ``P`` producers
to one consumer that takes batches of ``--batch`` groups:

- ``zmq``: the asyncrl ZMQ backend, broker in its own process (as ``asyncrl buffer`` runs):
  producers ``acquire`` + ``put(group)`` (encode included), the consumer ``get_batch`` (decode
  and validation included) carrying the ``ack`` of the batch before.
- ``zmq-raw``: PUSH → PULL of the 5 pre-encoded frames (multipart), direct: one hop, no
  broker, no decode. ``zmq-raw-packed``: the same bytes as the one packed frame the backend
  sends (:func:`buffers.zmq_protocol.pack_group`). ``zmq-raw-2hop``: packed, through
  ``zmq.proxy`` in its own process (the broker's topology: the bytes cross loopback twice).
- ``redis`` / ``redis-raw``: the asyncrl Redis backend; raw ``XADD`` / ``XREADGROUP`` +
  ``XACK`` + ``XDEL`` of the same five fields on a unique stream key (deleted afterwards).
  ``redis-raw-kv``: the backend's own way of moving bytes, bare: ``SET`` of the packed group
  + ``RPUSH`` of its key (one pipeline), ``LPOP`` of a batch of keys then ``MGET`` + ``DEL``
  (Redis stores a big ``SET`` argument without copying it; a big stream field is copied into
  the stream's listpack, so the backend can beat ``redis-raw``).
- ``zmq-put-many`` / ``redis-put-many``: the backend with producers calling
  ``put_many`` of 8 groups (one engine batch, as the rollout worker does) instead of ``put``.

The backend consumer keeps ``--take-depth`` batch requests in flight (default 1, what the
learner's prefetcher does; :class:`bench.inflight.TakeAhead`); Redis serves one at a time.
Producers of the put-many rows keep ``--put-depth`` ``put_many`` calls in flight (default 1,
what a rollout worker does; :class:`bench.inflight.PutAhead`; Redis: one at a time).

Producers are processes, not threads, so Python producers do not share one GIL (the consumer
runs in this process, the ZMQ broker in another). Every process, raw or backend, keeps large
buffers in the heap (:func:`buffers.malloc_tuning.keep_large_buffers`, as the ``asyncrl``
roles do; ``--default-malloc`` leaves glibc's defaults). The gate never closes (``max_staleness``
huge); ``max_groups`` bounds what is held, so backpressure is part of the measure. Each row
warms up, then counts what the consumer received over ``--seconds``; it is run ``--repeats``
times (interleaved with the other rows) and the median is printed, as a shared machine is
noisy. ``vs raw`` is backend / the fastest raw transport of the same size and producer count
(zmq: the better of ``zmq-raw`` and ``zmq-raw-packed``, one hop; redis: ``redis-raw``);
``vs 2-hop / kv`` is a zmq row / ``zmq-raw-2hop`` (the raw transport with the broker's
topology) and a redis row / ``redis-raw-kv`` (the raw commands the backend uses). The last
column is the CPU each role used over the counted window, in cores (medians; all producers
together; ``server`` is the broker, ``zmq.proxy`` or ``redis-server``, ``–`` where there is
none or it is not on this machine; in brackets its main thread alone, without ZMQ's I/O
threads): a Python process near 1.0 is bound by its interpreter, the broker's main thread
near 1.0 by the broker, all of them together near the machine's core count by the machine.

    python bench/buffer_throughput.py [--seconds 3] [--repeats 3] [--tokens 1024 8192]
                                      [--producers 1 4] [--only zmq zmq-raw ...]
                                      [--io-threads 2] [--spill-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.schema import BufferConfig, RedisBufferConfig, ZmqBufferConfig  # noqa: E402
from asyncrl.wire import TrajectoryGroup, encode_group  # noqa: E402

logger = logging.getLogger("bench.buffer_throughput")
WARMUP_S = 0.5
START_TIMEOUT_S = 60.0
# The gate's room is (V + max_staleness + 1) x groups_per_step, and the benchmark's consumer
# never publishes a version: with max_staleness at its bound (1000) a large groups_per_step
# keeps the gate out of the measure, which max_groups bounds alone.
GATE_OPEN = 10**6
HWM = 64  # raw ZMQ high-water marks, in messages: bounded like max_groups
FIELDS = (b"header", b"tokens", b"logprobs", b"loss_mask", b"versions")


@dataclass(frozen=True)
class Spec:
    tokens: int
    samples: int
    batch: int
    max_groups: int
    redis_url: str
    put_many: int = 0  # producers use put_many(chunk) where the backend has it
    spill_dir: str = ""  # the ZMQ broker journals to a spill file there
    io_threads: int = ZmqBufferConfig.model_fields["io_threads"].default  # broker's and proxy's
    chunk: int = 8  # groups per put_many in the put-many rows: one engine batch of a worker
    gate_poll_s: float = 0.002  # a producer refused a grant asks again after this long
    take_depth: int = 1  # the consumer's get_batch requests in flight (TakeAhead)
    put_depth: int = 1  # each producer's put_many calls in flight (PutAhead)


def make_group(spec: Spec, name: str) -> TrajectoryGroup:
    """``samples`` sequences of ``tokens`` tokens: a quarter prompt, the rest generated."""
    rng = np.random.default_rng(0)
    prompt = spec.tokens // 4
    gen = spec.tokens - prompt
    samples = [{"tokens": rng.integers(0, 150_000, spec.tokens),
                "logprobs": np.r_[np.zeros(prompt), -rng.random(gen)],
                "loss_mask": np.r_[np.zeros(prompt), np.ones(gen)],
                "versions": np.r_[np.full(prompt, -1), np.zeros(gen)],
                "reward": 1.0, "finish_reason": "stop"} for _ in range(spec.samples)]
    return TrajectoryGroup.from_samples(name, f"prompt-{name}", samples)


def group_bytes(spec: Spec) -> int:
    return sum(len(f) for f in encode_group(make_group(spec, "g-000000")))


# --- producers (each in its own process) ---------------------------------------------------

def _backend_producer(spec: Spec, make_client: Callable[[], Any], index: int,
                      stop: Any) -> None:
    """acquire + put, as a rollout worker does; ``put_many`` (up to 8 at a time, one engine
    batch) when the spec asks for it and the backend has it. Grants are asked for in bulk
    (fewer round trips than a worker, so the rows measure puts), and whatever was granted is
    put, as a worker puts what it generated: a producer that waited for a whole chunk's
    grant would starve when producers × chunk exceeds ``max_groups``."""
    from bench.inflight import PutAhead

    client = make_client()
    name, sent, granted = f"p{index}", 0, 0
    chunk = spec.put_many if hasattr(client, "put_many") else 0
    puts = PutAhead(client, name, spec.put_depth)
    groups = [make_group(spec, "g") for _ in range(max(1, chunk))]
    while not stop.is_set():
        if not granted:
            granted = client.acquire(name, 256, 0).granted
            if not granted:  # full: re-ask after a pause, as a worker does (not a busy loop)
                stop.wait(spec.gate_poll_s)
            continue
        batch = groups[:granted]
        for group in batch:
            group.group_id, sent = f"{name}-{sent}", sent + 1
        try:
            if chunk:
                puts.put_many(batch)
            else:
                client.put(name, batch[0])
        except TimeoutError:
            continue  # the consumer stopped: the run is over
        granted -= len(batch)
    client.close()


def _zmq_backend_client(address: str) -> Any:
    from buffers.zmq_client import ZmqBufferClient

    return ZmqBufferClient(address, timeout_s=2.0)


def _redis_backend_client(spec: Spec, namespace: str) -> Any:
    from buffers import make_buffer_client

    return make_buffer_client(_redis_config(spec, namespace), run_id="bench",
                              groups_per_step=GATE_OPEN)


def _redis_config(spec: Spec, namespace: str) -> BufferConfig:
    return BufferConfig(type="redis",
                        redis=RedisBufferConfig(url=spec.redis_url, namespace=namespace),
                        max_staleness=1000, max_groups=spec.max_groups,
                        # a bound, not a measure: 2 s ran out on a machine at a load of 124 (the
                        # sandbox's fork-bomb test beside the CI smoke run) and failed the bench
                        request_timeout_s=30.0)


def _zmq_raw_producer(spec: Spec, address: str, packed: bool, index: int, stop: Any) -> None:
    import zmq

    from buffers.zmq_protocol import pack_group

    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, HWM)
    push.setsockopt(zmq.SNDTIMEO, 200)
    push.connect(address)
    frames = encode_group(make_group(spec, f"p{index}"))
    if packed:
        frames = [pack_group(frames)]
    while not stop.is_set():
        try:
            push.send_multipart(frames, copy=False)
        except zmq.Again:
            continue
    push.close(linger=0)
    context.term()


def _redis_raw_producer(spec: Spec, stream: str, index: int, stop: Any) -> None:
    import redis

    r = redis.Redis.from_url(spec.redis_url)
    fields = dict(zip(FIELDS, encode_group(make_group(spec, f"p{index}")), strict=True))
    sent = 0
    while not stop.is_set():
        if sent % 8 == 0 and r.xlen(stream) >= spec.max_groups:
            time.sleep(0.0005)  # the same bound as max_groups: wait for the consumer
            continue
        r.xadd(stream, fields)
        sent += 1
    r.close()


# --- brokers (own processes) ---------------------------------------------------------------

def _zmq_broker(spec: Spec, address_queue: Any, stop: Any) -> None:
    from buffers.zmq_broker import ZmqBroker

    spill = f"{spec.spill_dir}/bench-{uuid.uuid4().hex[:8]}.spill" if spec.spill_dir else ""
    config = BufferConfig(zmq=ZmqBufferConfig(port=0, spill_path=spill, io_threads=spec.io_threads),
                          max_staleness=1000, max_groups=spec.max_groups, reclaim_idle_s=600.0)
    broker = ZmqBroker(config, groups_per_step=GATE_OPEN, run_id="")
    address_queue.put(broker.bind())
    try:
        broker.serve(stop)
    finally:
        broker.close()
        if spill:
            Path(spill).unlink()


def _zmq_proxy(front: str, back: str, io_threads: int) -> None:
    import zmq

    context = zmq.Context(io_threads)
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.RCVHWM, HWM)
    pull.bind(front)
    push.bind(back)
    zmq.proxy(pull, push)  # until this process is terminated


# --- one row -------------------------------------------------------------------------------

Row = tuple[float, dict[str, float]]  # groups/s, and the CPU each role used (cores)


def _cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """User + system CPU time of process ``pid``, all its threads (``/proc/<pid>/stat``), or
    only its main thread (``/proc/<pid>/task/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or no procfs: counts as nothing
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The CPU each role's processes used over the counted window, in cores (1.0 = one
    core busy all the time): tells which process limits a row (a Python process near 1.0
    is bound by its interpreter; all of them together near ``os.cpu_count()``, by the
    machine)."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = roles
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    def _now(self) -> dict[str, float]:
        """``role`` → CPU seconds; a role ending in ``-main`` counts main threads only."""
        return {role: sum(_cpu_seconds(pid, role.endswith("-main")) for pid in pids)
                for role, pids in self.roles.items()}

    def start(self) -> None:
        self._start, self._t0 = self._now(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self._t0
        return {role: (used - self._start[role]) / elapsed
                for role, used in self._now().items()}


def measure(take: Callable[[], int], seconds: float, meter: CpuMeter | None = None
            ) -> tuple[float, float]:
    """Groups per second the consumer received over ``seconds``, after a warm-up that lasts
    until data flows (spawned processes start slowly on a busy machine) plus WARMUP_S."""
    start, flowing = time.perf_counter(), 0
    give_up = start + START_TIMEOUT_S
    while flowing == 0 or time.perf_counter() - start < WARMUP_S:
        flowing += take()
        if not flowing:
            start = time.perf_counter()
            if start > give_up:
                raise RuntimeError(f"no data within {START_TIMEOUT_S:.0f}s: producers failed")
    count, start = 0, time.perf_counter()
    if meter is not None:
        meter.start()
    while (elapsed := time.perf_counter() - start) < seconds:
        count += take()
    return count / elapsed, elapsed


def run_row(ctx: Any, target: Callable[..., None], args_of: Callable[[int], tuple],
            producers: int, take: Callable[[], int], seconds: float,
            server: int | None = None) -> Row:
    """One measurement; ``server``: the pid of the broker, proxy or redis-server between
    the producers and this process (the consumer), for the CPU column."""
    stop = ctx.Event()
    procs = [ctx.Process(target=target, args=(*args_of(i), stop), daemon=True)
             for i in range(producers)]
    for p in procs:
        p.start()
    meter = CpuMeter({"producers": [p.pid for p in procs],
                      "server": [server] if server else [],
                      "server-main": [server] if server else [], "consumer": [os.getpid()]})
    try:
        rate, _ = measure(take, seconds, meter)
        cpu = meter.stop()
    finally:
        stop.set()
        deadline = time.monotonic() + 5.0
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            take()  # keep draining so producers blocked on a full buffer see the stop
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
                p.join()
    return rate, cpu


def _backend_take(consumer: Any, spec: Spec) -> Callable[[], int]:
    """The consumer of a backend row: a learner that takes a batch and acks it at once, the
    ack riding on the next request sent (``get_batch(ack=...)``, one round trip), with
    ``--take-depth`` requests in flight (:class:`bench.inflight.TakeAhead`; Redis: one)."""
    from bench.inflight import TakeAhead

    ahead = TakeAhead(consumer, "learner", spec.batch, spec.take_depth, timeout_s=0.2)
    previous = None
    version = 0

    def take() -> int:
        nonlocal previous, version
        batch = ahead.take(version, ack=previous)
        previous = batch  # after a timeout (None) the ack went with a request anyway
        if batch is None:
            return 0
        version += 1
        return len(batch.groups)

    return take


def bench_zmq(ctx: Any, spec: Spec, producers: int, seconds: float) -> Row:
    from buffers.zmq_client import ZmqBufferClient

    queue, stop = ctx.Queue(), ctx.Event()
    broker = ctx.Process(target=_zmq_broker, args=(spec, queue, stop), daemon=True)
    broker.start()
    address = queue.get(timeout=30)
    consumer = ZmqBufferClient(address, timeout_s=30)
    try:
        return run_row(ctx, _backend_producer, lambda i: (spec, _BoundClient(address), i),
                       producers, _backend_take(consumer, spec), seconds, broker.pid)
    finally:
        consumer.close()
        stop.set()
        broker.join(timeout=5)


class _BoundClient:
    """A picklable client factory for producer processes (``spawn`` pickles the target)."""

    def __init__(self, address: str, namespace: str = "", spec: Spec | None = None) -> None:
        self.address, self.namespace, self.spec = address, namespace, spec

    def __call__(self) -> Any:
        if self.spec is not None:
            return _redis_backend_client(self.spec, self.namespace)
        return _zmq_backend_client(self.address)


def bench_zmq_raw(ctx: Any, spec: Spec, producers: int, seconds: float, hops: int,
                  packed: bool) -> Row:
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, HWM)
    front, proxy = _raw_endpoints(ctx, pull, hops, spec.io_threads)

    def take() -> int:
        count = 0
        while count < spec.batch and pull.poll(200):
            pull.recv_multipart(copy=False)
            count += 1
        return count

    try:
        return run_row(ctx, _zmq_raw_producer, lambda i: (spec, front, packed, i), producers,
                       take, seconds, proxy.pid if proxy is not None else None)
    finally:
        pull.close(linger=0)
        context.term()
        if proxy is not None:
            proxy.terminate()
            proxy.join()


def _raw_endpoints(ctx: Any, pull: Any, hops: int, io_threads: int) -> tuple[str, Any]:
    """Where raw producers push: ``pull`` itself (1 hop), or a zmq.proxy process (2 hops)."""
    if hops == 1:
        return f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}", None
    front, back = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(2))
    proxy = ctx.Process(target=_zmq_proxy, args=(front, back, io_threads), daemon=True)
    proxy.start()
    pull.connect(back)
    return front, proxy


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_pid(spec: Spec) -> int | None:
    """redis-server's pid where it runs on this machine (its CPU column), else None."""
    import redis

    r = redis.Redis.from_url(spec.redis_url)
    try:
        pid = int(r.info("server")["process_id"])
    finally:
        r.close()
    return pid if Path(f"/proc/{pid}").exists() else None


def bench_redis(ctx: Any, spec: Spec, producers: int, seconds: float) -> Row:
    import redis

    namespace = f"asyncrl-bench:{uuid.uuid4().hex[:8]}"
    consumer = _redis_backend_client(spec, namespace)
    try:
        return run_row(ctx, _backend_producer,
                       lambda i: (spec, _BoundClient("", namespace, spec), i), producers,
                       _backend_take(consumer, spec), seconds, _redis_pid(spec))
    finally:
        consumer.close()
        r = redis.Redis.from_url(spec.redis_url)
        keys = list(r.scan_iter(match=f"{namespace}*"))
        if keys:
            r.delete(*keys)
        r.close()


def bench_redis_raw(ctx: Any, spec: Spec, producers: int, seconds: float) -> Row:
    import redis

    r = redis.Redis.from_url(spec.redis_url)
    stream = f"asyncrl-bench-raw:{uuid.uuid4().hex[:8]}"
    r.xgroup_create(stream, "g", id="$", mkstream=True)

    def take() -> int:
        reply = r.xreadgroup("g", "c", {stream: ">"}, count=spec.batch, block=200)
        if not reply:
            return 0
        ids = [entry_id for entry_id, _ in reply[0][1]]
        pipe = r.pipeline(transaction=False)
        pipe.xack(stream, "g", *ids)
        pipe.xdel(stream, *ids)
        pipe.execute()
        return len(ids)

    try:
        return run_row(ctx, _redis_raw_producer, lambda i: (spec, stream, i), producers, take,
                       seconds, _redis_pid(spec))
    finally:
        r.delete(stream)
        r.close()


def _redis_raw_kv_producer(spec: Spec, queue: str, index: int, stop: Any) -> None:
    import redis

    from buffers.packing import pack_group

    r = redis.Redis.from_url(spec.redis_url)
    payload = pack_group(encode_group(make_group(spec, f"p{index}")))
    sent = 0
    while not stop.is_set():
        if sent % 8 == 0 and r.llen(queue) >= spec.max_groups:
            time.sleep(0.0005)  # the same bound as max_groups: wait for the consumer
            continue
        key = f"{queue}:{index}:{sent}"
        r.pipeline(transaction=False).set(key, payload).rpush(queue, key).execute()
        sent += 1
    r.close()


def bench_redis_raw_kv(ctx: Any, spec: Spec, producers: int, seconds: float) -> Row:
    import redis

    r = redis.Redis.from_url(spec.redis_url)
    queue = f"asyncrl-bench-kv:{uuid.uuid4().hex[:8]}"

    def take() -> int:
        keys = r.lpop(queue, spec.batch)
        if not keys:  # wait for one without spinning, as XREADGROUP BLOCK does
            first = r.blpop([queue], timeout=0.2)
            if first is None:
                return 0
            keys = [first[1], *(r.lpop(queue, spec.batch - 1) or [])]
        r.pipeline(transaction=False).mget(keys).delete(*keys).execute()
        return len(keys)

    try:
        return run_row(ctx, _redis_raw_kv_producer, lambda i: (spec, queue, i), producers, take,
                       seconds, _redis_pid(spec))
    finally:
        r.delete(queue, *r.scan_iter(match=f"{queue}:*"))
        r.close()


# --- the table -----------------------------------------------------------------------------

def redis_available(spec: Spec) -> tuple[bool, bool]:
    """(raw Redis reachable, asyncrl Redis backend importable)."""
    try:
        import redis
    except ImportError as exc:  # a machine without redis-py still runs the ZMQ rows
        logger.warning("redis rows skipped: %s", exc)
        return False, False

    try:
        redis.Redis.from_url(spec.redis_url, socket_connect_timeout=1).ping()
    except (redis.RedisError, OSError) as exc:  # skip those rows, and say why
        logger.warning("redis at %s not reachable: %s", spec.redis_url, exc)
        return False, False
    try:
        from buffers.redis_buffer import RedisBufferClient  # noqa: F401
    except ImportError as exc:
        logger.warning("redis backend not available: %s", exc)
        return True, False
    return True, True


ROWS = ("zmq-raw", "zmq-raw-packed", "zmq-raw-2hop", "zmq", "zmq-put-many", "zmq-spill",
        "redis-raw", "redis-raw-kv", "redis", "redis-put-many")
ZMQ_RAW = ("zmq-raw", "zmq-raw-packed")
RAW_OF = {"zmq-raw-2hop": ZMQ_RAW, "zmq": ZMQ_RAW, "zmq-put-many": ZMQ_RAW,
          "zmq-spill": ZMQ_RAW, "redis-raw-kv": ("redis-raw",), "redis": ("redis-raw",),
          "redis-put-many": ("redis-raw",)}
KV_RATIO = ("redis", "redis-put-many")  # also shown against redis-raw-kv
TWO_HOP_RATIO = ("zmq", "zmq-put-many", "zmq-spill")



def _ratio(value: float) -> str:
    """Two decimals, or one significant digit below 0.01: a slow row on a loaded machine read
    0.00, as if it had moved nothing."""
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.1g}"

def runner(name: str, ctx: Any, spec: Spec, producers: int, args: argparse.Namespace
           ) -> Callable[[], Row]:
    seconds = args.seconds
    return {
        "zmq-raw": lambda: bench_zmq_raw(ctx, spec, producers, seconds, 1, packed=False),
        "zmq-raw-packed": lambda: bench_zmq_raw(ctx, spec, producers, seconds, 1, packed=True),
        "zmq-raw-2hop": lambda: bench_zmq_raw(ctx, spec, producers, seconds, 2, packed=True),
        "zmq": lambda: bench_zmq(ctx, spec, producers, seconds),
        "zmq-put-many": lambda: bench_zmq(ctx, replace(spec, put_many=spec.chunk), producers,
                                          seconds),
        "zmq-spill": lambda: bench_zmq(ctx, replace(spec, put_many=spec.chunk,
                                                    spill_dir=args.spill_dir), producers, seconds),
        "redis-raw": lambda: bench_redis_raw(ctx, spec, producers, seconds),
        "redis-raw-kv": lambda: bench_redis_raw_kv(ctx, spec, producers, seconds),
        "redis": lambda: bench_redis(ctx, spec, producers, seconds),
        "redis-put-many": lambda: bench_redis(ctx, replace(spec, put_many=spec.chunk), producers,
                                              seconds),
    }[name]


def run_config(ctx: Any, spec: Spec, producers: int, args: argparse.Namespace) -> None:
    """Every row of one (size, producers) cell, repeats interleaved; prints the medians."""
    size = group_bytes(spec)
    label = f"{spec.samples}×{spec.tokens} ({size / 1e6:.2f} MB)"
    raw_redis, redis_backend = redis_available(spec)
    missing = {"redis-raw": not raw_redis, "redis-raw-kv": not raw_redis,
               "redis": not redis_backend,
               "redis-put-many": not redis_backend,
               "zmq-spill": not args.spill_dir}
    names = [n for n in ROWS if (not args.only or n in args.only) and not missing.get(n)]
    samples: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            rate, cpu = runner(name, ctx, spec, producers, args)()
            samples[name].append(rate)
            cpus[name].append(cpu)
    rates = {n: statistics.median(v) for n, v in samples.items()}
    for name in ROWS:
        if args.only and name not in args.only:
            continue
        if missing.get(name):
            what = {"redis": "redis backend", "redis-put-many": "redis backend",
                    "redis-raw": "redis server", "redis-raw-kv": "redis server"}.get(name)
            if what is None:
                continue  # zmq-spill without --spill-dir: not asked for
            print(f"| {label} | {producers} | {name} | {what} not available | | | | |")
            continue
        raws = [rates[r] for r in RAW_OF.get(name, ()) if r in rates]
        ratio = _ratio(rates[name] / max(raws)) if raws else ""
        second = rates.get("zmq-raw-2hop") if name in TWO_HOP_RATIO else \
            rates.get("redis-raw-kv") if name in KV_RATIO else None
        ratio_2hop = _ratio(rates[name] / second) if second else ""
        spread = f"{min(samples[name]):,.0f}–{max(samples[name]):,.0f}"
        cores = {role: f"{statistics.median(c[role] for c in cpus[name]):.2f}"
                 if any(c[role] for c in cpus[name]) else "–" for role in cpus[name][0]}
        if cores["server"] != "–":  # its main thread: where a Python broker's work is done
            cores["server"] += f" ({cores['server-main']})"
        cpu = " / ".join(cores[role] for role in ("producers", "server", "consumer"))
        print(f"| {label} | {producers} | {name} | {rates[name]:,.0f} ({spread}) | "
              f"{rates[name] * size / 1e6:,.0f} | {ratio} | {ratio_2hop} | {cpu} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per row")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (median shown)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192],
                        help="tokens per sample")
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--batch", type=int, default=8, help="groups per get_batch")
    parser.add_argument("--put-many", type=int, default=Spec.chunk,
                        help="groups per put_many call in the *-put-many rows")
    parser.add_argument("--gate-poll-s", type=float, default=Spec.gate_poll_s,
                        help="a producer refused a grant (the buffer is full) asks again "
                             "after this long (a rollout worker: 0.02 s)")
    parser.add_argument("--max-groups", type=int, default=64, help="buffer bound (groups)")
    parser.add_argument("--take-depth", type=int, default=1,
                        help="the consumer's get_batch requests in flight (zmq rows; "
                             "bench/inflight.py)")
    parser.add_argument("--put-depth", type=int, default=1,
                        help="each producer's put_many calls in flight (put-many rows; "
                             "bench/inflight.py)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--only", nargs="+", choices=ROWS, help="a subset of the rows")
    parser.add_argument("--spill-dir", default="",
                        help="also run zmq-spill: put_many with the broker's spill file here")
    parser.add_argument("--io-threads", type=int, default=Spec.io_threads,
                        help="ZMQ I/O threads of the broker (buffer.zmq.io_threads) and of the "
                             "raw 2-hop proxy")
    parser.add_argument("--default-malloc", action="store_true",
                        help="do not keep large buffers in the heap (glibc defaults)")
    args = parser.parse_args()
    if not args.default_malloc:
        from buffers.malloc_tuning import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_large_buffers

        keep_large_buffers()  # this process; spawned ones read the same from the environment
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ctx = mp.get_context("spawn")
    print(f"Settings: max_groups {args.max_groups}, batch {args.batch}, put_many of "
          f"{args.put_many} with {args.put_depth} call(s) in flight per producer, "
          f"{args.take_depth} batch request(s) in flight, {args.seconds:g} s x "
          f"{args.repeats} per row, {os.cpu_count()} CPUs\n")
    print("| group | producers | backend | groups/s (min–max) | MB/s | vs raw | "
          "vs 2-hop / kv | CPU cores: producers / server (main thread) / consumer |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for tokens in args.tokens:
        for producers in args.producers:
            spec = Spec(tokens, args.samples, args.batch, args.max_groups, args.redis_url,
                        io_threads=args.io_threads, chunk=args.put_many,
                        gate_poll_s=args.gate_poll_s, take_depth=args.take_depth,
                        put_depth=args.put_depth)
            run_config(ctx, spec, producers, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
