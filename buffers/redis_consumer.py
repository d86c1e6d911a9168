"""The learner side of the Redis buffer: takes, payload reads, drops, acks and renewals.

A take is one script on the index stream (claims and reads entries of a few bytes each, drops
stale ones, and acks the previous batch when ``get_batch`` carries it), then one plain
``MGET`` of the payloads the entries name: payloads never pass through Lua. Every entry is
validated here (:func:`~buffers.redis_entries.decode_entry`); a bad one is discarded with a
counted reason. A batch is all or nothing (see :mod:`buffers.redis_buffer`); only an entry
rejected when decoded leaves a partial batch, held here and topped up by the next take.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import StalenessGate
from asyncrl.wire import Rejections, TrajectoryGroup, WireError
from buffers.protocol import Batch
from buffers.redis_connect import Client
from buffers.redis_entries import decode_entry, entry_fields
from buffers.redis_scripts import GROUP, RedisKeys
from buffers.redis_status import batch_stats
from buffers.redis_stop import StopGuard

logger = logging.getLogger(__name__)

Run = Callable[..., Any]  # runs a named script with the client's keys and parameters


class RedisConsumer:
    """Per-consumer state of one client: held entries, drops to report, served stalenesses."""

    def __init__(self, client: Client, run: Run, keys: RedisKeys, config: BufferConfig,
                 gate: StalenessGate, rejections: Rejections, stop: StopGuard) -> None:
        self._redis, self._run, self._keys, self._stop = client, run, keys, stop
        self._config, self._gate, self._rejections = config, gate, rejections
        self._names: dict[str, str] = {}
        self._held: dict[str, list[tuple[str, TrajectoryGroup]]] = {}
        self._dropped: Counter[str] = Counter()
        self._served: dict[str, int] = {}  # receipt -> staleness when served, until acked
        self._wake_s = max(0.01, min(1.0, config.reclaim_idle_s / 4,
                                     config.request_timeout_s / 2))

    def name(self, consumer: str) -> str:
        """Unique per client (``consumer-pid-random``, see :mod:`buffers.redis_buffer`); its
        prefix (:meth:`learner`) is the learner process's, whatever client it uses."""
        if consumer not in self._names:
            self._names[consumer] = f"{self.learner(consumer)}{uuid.uuid4().hex[:6]}"
        return self._names[consumer]

    @staticmethod
    def learner(consumer: str) -> str:
        """What the names of every client of ``consumer`` in this process begin with. A
        renewal holds what any of them took: the learner's prefetcher takes a batch on a
        client of its own, and the training loop renews it on another while the step
        computes. Renewed by this client's name alone, it was not renewed at all, and the
        prefetcher's next take reclaimed it during a long step (a take reclaims idle
        entries whoever holds them: the caller's own too, see TAKE)."""
        return f"{consumer}-{os.getpid()}-"

    def get_batch(self, consumer: str, count: int, learner_version: int, timeout_s: float,
                  ack: Batch | None = None) -> Batch | None:
        if not 1 <= count <= self._config.max_groups:
            raise ValueError(f"count {count} must be in [1, max_groups="
                             f"{self._config.max_groups}]")
        held = self._held.setdefault(consumer, [])
        deadline = time.monotonic() + max(0.0, timeout_s)
        acks = self._ack_args(ack)
        while True:
            self._drop_stale_held(consumer, learner_version)
            tail, stats, acked = self._take(consumer, count - len(held), learner_version, acks)
            if acks:
                self._check_acked(consumer, acked, len(acks) // 2)
                acks = []
            if len(held) >= count:
                return self._serve(consumer, count, learner_version, stats)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._redis.xread({self._keys.index: tail}, count=1,
                              block=self._stop.block_ms(min(remaining, self._wake_s)))

    def ack(self, consumer: str, batch: Batch) -> None:
        acks = self._ack_args(batch)
        if acks:
            self._check_acked(consumer, int(self._run("ack", *acks)), len(acks) // 2)

    def renew(self, consumer: str, batch: Batch) -> int:
        if not batch.receipts:
            return 0
        return int(self._run("renew", self.learner(consumer), *batch.receipts))

    def tidy(self) -> None:
        """Forget consumers that hold nothing (their pending entries must stay reclaimable)."""
        for name in self._names.values():
            if not self._redis.xpending_range(self._keys.index, GROUP, "-", "+", 1, name):
                self._redis.xgroup_delconsumer(self._keys.index, GROUP, name)

    def _ack_args(self, batch: Batch | None) -> list[Any]:
        args: list[Any] = []
        for receipt in batch.receipts if batch is not None else ():
            args += [receipt, self._served.pop(receipt, 0)]
        return args

    @staticmethod
    def _check_acked(consumer: str, acked: int, sent: int) -> None:
        if acked < sent:
            logger.warning("%s: %d of %d groups were already acked (reclaimed and trained "
                           "elsewhere: at-least-once)", consumer, sent - acked, sent)

    def _take(self, consumer: str, need: int, learner_version: int,
              acks: list[Any]) -> tuple[bytes, list, int]:
        """One take script, then the payloads; valid entries join the consumer's held list."""
        held = self._held[consumer]
        held_ids = [entry_id for entry_id, _ in held]
        lost, dropped, entries, tail, stats, acked = self._run(
            "take", self.name(consumer), max(0, need), learner_version,
            int(self._config.reclaim_idle_s * 1000), len(held_ids), *held_ids, *acks)
        if lost:
            logger.warning("%d held groups were reclaimed by another consumer", len(lost))
            gone = {i.decode() for i in lost}
            held[:] = [(i, g) for i, g in held if i not in gone]
        self._dropped[consumer] += int(dropped)
        if entries:
            self._read_payloads(held, entries)
        return tail, stats, int(acked)

    def _read_payloads(self, held: list[tuple[str, TrajectoryGroup]], entries: list) -> None:
        parsed = [(raw_id.decode(), entry_fields(fields)) for raw_id, fields in entries]
        keys = [fields.get(b"k", b"").decode(errors="replace") for _, fields in parsed]
        wanted = sorted({key for key in keys if self._keys.is_payload(key)})
        payloads = dict(zip(wanted, self._redis.mget(wanted))) if wanted else {}
        for (entry_id, fields), key in zip(parsed, keys, strict=True):
            try:
                if key not in payloads:
                    raise WireError("frames", f"entry names {key!r}, not a payload key")
                held.append((entry_id, decode_entry(fields, payloads[key],
                                                    self._config.max_message_bytes)))
            except WireError as exc:
                self._rejections.add(exc, f"stream entry {entry_id}")
                self._run("discard", "reject", exc.reason, entry_id)

    def _drop_stale_held(self, consumer: str, learner_version: int) -> None:
        held = self._held[consumer]
        stale = [i for i, g in held if not self._gate.is_fresh(learner_version, g.min_version())]
        if stale:
            self._dropped[consumer] += int(self._run("discard", "stale", "", *stale))
            held[:] = [(i, g) for i, g in held if i not in stale]

    def _serve(self, consumer: str, count: int, learner_version: int, stats: list) -> Batch:
        held = self._held[consumer]
        served, held[:] = held[:count], held[count:]  # in the order the take chose them
        for entry_id, group in served:
            self._served[entry_id] = group.staleness(learner_version)
        return Batch(groups=[g for _, g in served], dropped_stale=self._dropped.pop(consumer, 0),
                     stats=batch_stats(stats), receipts=[i for i, _ in served])
