"""Append-only spill file: a ZMQ broker restart loses nothing accepted and unacknowledged.

Why a log and not a snapshot: a put must be durable *before* the producer hears "accepted",
and appending the frames it arrived in is the cheapest write that achieves it (one
``writev``, no re-encoding). Acks and drops append a few bytes; the broker state is the replay.

File layout: ``MAGIC``, then records ``[u32 body length][u32 checksum(type + body)][u8 type]
[body]``. The checksum is the low 32 bits of XXH3-64 (``v2`` files): every byte of every put is
hashed on the broker's thread before the producer hears "accepted", and CRC-32 (``v1`` files,
still read and appended to until their first compaction rewrites them as ``v2``) ran at ~4
GB/s, 200 µs for an 8k-token group, against XXH3's ~60 GB/s. It guards against torn and
corrupt tails, not adversaries: 32 bits of either are plenty for that.

=======  ======================================================================================
PUT      ``<u64 seq><i64 min_version><u16 n>`` + ``n × <u32 frame length>`` + the raw frames
ACKED    ``n × <u64 seq><i32 staleness>`` (acked after the step; staleness feeds the histogram)
DROP     ``n × <u64 seq><i32 staleness>`` (dropped as stale)
STATE    orjson snapshot: epoch, next_seq, version, run_status and the counters
KEY      orjson ``{"key", "seq", "value"}``
DELIVER  ``<u16 n>`` + consumer (n bytes, UTF-8) + ``n' × <u64 seq><i32 staleness>``: delivered
         to that consumer; an empty consumer means back in the queue (reclaimed)
=======  ======================================================================================

Why deliveries are journaled: a learner outlives a broker restart holding the batch it is
training on (and, prefetching, asks for the next one at once). Replayed as queued, that batch
was the oldest in the queue and went straight back to the same learner: trained twice, and the
gate's slot arithmetic one step off for the rest of the run (the quickstart, its broker
SIGKILLed at step 25, then dropped 16 stale groups a step). Replayed as delivered, it waits for
its consumer's ack like any delivery, and is redelivered only after ``reclaim_idle_s``.

Replay (:mod:`buffers.zmq_replay`) rebuilds the state from these records; a torn or corrupt
tail (crash mid-write) fails its length or checksum and is cut off.

Durability: every record is written with ``os.writev`` straight to the kernel before the
broker replies, so a crash of the broker process (SIGKILL included) loses nothing it
acknowledged. ``fsync`` is batched (:data:`FSYNC_INTERVAL_S`, asked for by the broker loop), so
a power loss or kernel crash may lose the last fraction of a second of puts and acks. It runs
on a thread of its own: flushing a fraction of a second of 8k-token groups took 15 ms per
34 MB on the test VM's disk, about as long as writing them, and the broker's thread serves
requests meanwhile (``os.fsync`` releases the GIL). ``close`` syncs on the caller's thread.

Compaction: when the file is larger than ``2 ×`` its live records (and past a floor), the live
records are rewritten to ``<path>.compact``, fsynced and atomically renamed over the file.
It runs inline in the broker loop: about one disk write of the live data.

A write that fails (disk full, EIO) is cut back off the file, and then:

- a PUT raises, and the broker refuses that group (reason ``spill``, counted with the other
  rejections): a producer must never hear "accepted" for a group a restart would not bring
  back, and being told, it may go on (the next put may fit);
- any other record (ACKED, DROP, DELIVER, STATE, KEY) is logged (the first few, then every
  :data:`LOG_WRITE_ERROR_EVERY`-th), counted (``write_errors``, in the broker's status) and
  not raised: the change it records is already made in memory and stays made, so the broker
  goes on serving. What is lost is only that change's durability across a restart, which
  at-least-once delivery covers: an ack or drop lost is a group redelivered, a delivery lost
  is a group served from the queue again, a STATE or KEY lost is an older value replayed,
  and the next one of each written brings the file up to date. Raising instead failed
  requests whose change had been applied (an ack answered with an error), and killed the
  broker's thread when the write came from its housekeeping (a parked put admitted, a stale
  drop, a reclaim).

A failed fsync (on its thread) is raised on the broker's thread, which answers the requests
it had parked and stops: the kernel may have dropped pages already acknowledged, and no later
write can say which.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"asyncrl-spill\x00v2"  # what new files (and compactions) are written as
MAGIC_V1 = b"asyncrl-spill\x00v1"  # CRC-32 records: still read, and appended to
PUT, ACKED, DROP, STATE, KEY, DELIVER = 1, 2, 3, 4, 5, 6
FSYNC_INTERVAL_S = 0.2
COMPACT_MIN_BYTES = 64 << 20
LOG_WRITE_ERRORS = 5  # failed writes logged one by one; then one in LOG_WRITE_ERROR_EVERY
LOG_WRITE_ERROR_EVERY = 1000
HEADER = struct.Struct("<IIB")
PUT_HEAD = struct.Struct("<QqH")
FRAME_LEN = struct.Struct("<I")
REMOVED = struct.Struct("<Qi")
NAME_LEN = struct.Struct("<H")

Buf = Any  # anything with the buffer protocol: bytes, memoryview, zmq.Frame


class SpillError(RuntimeError):
    """The spill file is not one of ours: refuse to start rather than overwrite it."""


@dataclass
class Recovered:
    """What a replay found: counters (the last STATE plus later records), keys, live groups."""

    state: dict[str, Any]
    keys: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    groups: dict[int, tuple[int, list[memoryview]]] = field(default_factory=dict)
    delivered: dict[int, tuple[str, int]] = field(default_factory=dict)  # seq: consumer, stale


Checksum = Callable[[int, Sequence[Buf]], int]  # (record type, body parts) -> u32


def crc_of(kind: int, parts: Sequence[Buf]) -> int:
    """A ``v1`` record's checksum: CRC-32 of the type byte and the body."""
    crc = zlib.crc32(bytes((kind,)))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def xxh_of(kind: int, parts: Sequence[Buf]) -> int:
    """A ``v2`` record's checksum: XXH3-64 of the type byte and the body, low 32 bits."""
    digest = xxhash.xxh3_64(bytes((kind,)))
    for part in parts:
        digest.update(part)
    return digest.intdigest() & 0xFFFFFFFF


CHECKSUMS: dict[bytes, Checksum] = {MAGIC: xxh_of, MAGIC_V1: crc_of}


def _record(kind: int, parts: Sequence[Buf], checksum: Checksum = xxh_of) -> list[Buf]:
    size = sum(memoryview(p).nbytes for p in parts)
    return [HEADER.pack(size, checksum(kind, parts), kind), *parts]


def _put_parts(seq: int, min_version: int, frames: Sequence[Buf]) -> list[Buf]:
    lengths = b"".join(FRAME_LEN.pack(memoryview(f).nbytes) for f in frames)
    return [PUT_HEAD.pack(seq, min_version, len(frames)) + lengths, *frames]


def _put_size(frames: Sequence[Buf]) -> int:
    """Bytes of a PUT record, without building it (replay accounts every live group)."""
    return (HEADER.size + PUT_HEAD.size + FRAME_LEN.size * len(frames)
            + sum(memoryview(f).nbytes for f in frames))


def write_all(fd: int, parts: list[Buf]) -> int:
    """``writev`` until every byte is written (regular files rarely write short, but may)."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return total


class SpillLog:
    """The append side; :func:`buffers.zmq_replay.open_spill` creates it (after a replay)."""

    def __init__(self, path: Path, fd: int, compact_min_bytes: int = COMPACT_MIN_BYTES,
                 checksum: Checksum = xxh_of) -> None:
        self.path = path
        self.checksum = checksum  # the file's own (its MAGIC's): records appended match it
        self.compact_min_bytes = compact_min_bytes
        self.file_bytes = os.fstat(fd).st_size
        self.compactions = 0
        self.write_errors = 0  # records other than PUT that could not be written
        self._fd = fd
        self._live: dict[int, int] = {}  # seq -> PUT record size
        self._keys: dict[str, int] = {}  # key -> KEY record size
        self._live_bytes = 0
        self._state_bytes = 0
        self._dirty = False
        self._synced_at = time.monotonic()
        # The fsync thread: _lock keeps the fd from being swapped (compaction) or closed
        # while it syncs; an error it meets is raised on the broker's next sync_if_due.
        self._lock = threading.Lock()
        self._sync_wanted = threading.Event()
        self._closing = False
        self._sync_error: OSError | None = None
        self._syncer = threading.Thread(target=self._sync_loop, name="spill-fsync", daemon=True)
        self._syncer.start()

    def account(self, recovered: Recovered) -> None:
        """Know the sizes of the live records a replay found (for compaction)."""
        for seq, (_, frames) in recovered.groups.items():
            self._live[seq] = _put_size(frames)
        self._live_bytes = sum(self._live.values())
        for key, (seq, value) in recovered.keys.items():
            self._keys[key] = len(_key_body(key, seq, value)) + HEADER.size
        self._state_bytes = len(orjson.dumps(recovered.state)) + HEADER.size

    # --- appends --------------------------------------------------------------------------

    def _append(self, kind: int, parts: list[Buf]) -> int:
        """Append one record; a failed write (disk full) is cut back off, so that the file
        never holds a torn record in its middle (replay would stop there)."""
        try:
            size = write_all(self._fd, _record(kind, parts, self.checksum))
        except OSError:
            os.ftruncate(self._fd, self.file_bytes)
            raise
        self.file_bytes += size
        self._dirty = True
        return size

    def _append_or_count(self, kind: int, parts: list[Buf]) -> int | None:
        """Append a record other than PUT; a failed write is logged and counted, not raised
        (see the module docstring). Its size, or None."""
        try:
            return self._append(kind, parts)
        except OSError as exc:
            self.write_errors += 1
            if (self.write_errors <= LOG_WRITE_ERRORS
                    or self.write_errors % LOG_WRITE_ERROR_EVERY == 0):
                logger.error("spill %s: a record of type %d could not be written (%d so far): "
                             "%s; the broker goes on, that change is not durable", self.path,
                             kind, self.write_errors, exc)
            return None

    def put(self, seq: int, min_version: int, frames: Sequence[Buf]) -> None:
        """Raises a failed write (the caller refuses the group)."""
        size = self._append(PUT, _put_parts(seq, min_version, frames))
        self._live[seq] = size
        self._live_bytes += size

    def removed(self, kind: int, items: Sequence[tuple[int, int]]) -> None:
        """``items`` = (seq, staleness) of groups acked (ACKED) or dropped as stale (DROP)."""
        if not items:
            return
        self._append_or_count(kind, [b"".join(REMOVED.pack(seq, st) for seq, st in items)])
        for seq, _ in items:  # gone from memory either way: a compaction leaves them out
            self._live_bytes -= self._live.pop(seq, 0)

    def delivered(self, consumer: str, items: Sequence[tuple[int, int]]) -> None:
        """``items`` = (seq, staleness) of groups delivered to ``consumer`` ("" = requeued)."""
        if items:
            self._append_or_count(DELIVER, [_deliver_body(consumer, items)])

    def state(self, snapshot: dict[str, Any]) -> None:
        body = orjson.dumps(snapshot)
        self._append_or_count(STATE, [body])
        self._state_bytes = HEADER.size + len(body)  # what a compaction writes

    def key(self, key: str, seq: int, value: dict[str, Any]) -> None:
        body = _key_body(key, seq, value)
        self._append_or_count(KEY, [body])
        self._keys[key] = HEADER.size + len(body)

    # --- upkeep ---------------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        return len(MAGIC) + self._live_bytes + self._state_bytes + sum(self._keys.values())

    def sync_if_due(self) -> None:
        """Ask the fsync thread for a sync at most every :data:`FSYNC_INTERVAL_S` (the broker
        loop calls this often); raises the error of a sync that failed since the last call."""
        if self._sync_error is not None:
            error, self._sync_error = self._sync_error, None
            raise error
        now = time.monotonic()
        if self._dirty and now - self._synced_at >= FSYNC_INTERVAL_S:
            self._dirty = False
            self._synced_at = now
            self._sync_wanted.set()

    def _sync_loop(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            with self._lock:
                if self._closing:
                    return
                try:
                    os.fsync(self._fd)
                except OSError as exc:  # disk gone: the broker's thread raises it
                    logger.error("spill %s: fsync failed: %s", self.path, exc)
                    self._sync_error = exc

    def needs_compaction(self) -> bool:
        return self.file_bytes >= max(self.compact_min_bytes, 2 * self.live_bytes)

    def compact(self, snapshot: dict[str, Any], keys: Iterable[tuple[str, int, dict[str, Any]]],
                groups: Iterable[tuple[int, int, Sequence[Buf]]],
                deliveries: Iterable[tuple[str, Sequence[tuple[int, int]]]] = ()) -> None:
        """Rewrite only the live records (state, keys, groups in seq order, then who holds
        the delivered ones), atomically. A failure before the rename (disk full, the
        ``.compact`` file locked) is logged and leaves the current file in use: compaction
        only saves space. Once renamed, the new file is the one appended to, whatever
        happens next: the old one is unlinked, and a record written there would be lost."""
        before = self.file_bytes
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = -1
        try:
            fd = open_locked(tmp, os.O_CREAT | os.O_TRUNC)
            size = _write_live(fd, snapshot, keys, groups, deliveries)
            os.fsync(fd)
            os.replace(tmp, self.path)
        except (OSError, SpillError) as exc:
            if fd >= 0:  # ours: gone (a .compact file locked by someone else is not)
                os.close(fd)
                tmp.unlink(missing_ok=True)
            logger.error("spill %s: compaction failed, keeping the file as it is: %s",
                         self.path, exc)
            return
        with self._lock:  # not while the fsync thread syncs the old fd
            old, self._fd = self._fd, fd
        self.file_bytes, self._dirty, self.checksum = size, False, xxh_of
        self.compactions += 1
        os.close(old)
        logger.info("spill %s compacted: %d -> %d bytes", self.path, before, size)
        try:
            _fsync_dir(self.path.parent)
        except OSError as exc:  # the rename is done, only not yet durable against power loss
            logger.error("spill %s: compacted, but syncing its directory failed (a power loss "
                         "may bring the old file back): %s", self.path, exc)

    def close(self) -> None:
        """Stop the fsync thread, then fsync here (always: a sync it was asked for may not
        have run) and close."""
        if self._fd < 0:
            return
        with self._lock:
            self._closing = True
        self._sync_wanted.set()
        self._syncer.join()
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1


def _write_live(fd: int, snapshot: dict[str, Any],
                keys: Iterable[tuple[str, int, dict[str, Any]]],
                groups: Iterable[tuple[int, int, Sequence[Buf]]],
                deliveries: Iterable[tuple[str, Sequence[tuple[int, int]]]]) -> int:
    """Write a compacted file's records to ``fd`` (a v1 file becomes v2 here); its size."""
    size = write_all(fd, [MAGIC])
    size += write_all(fd, _record(STATE, [orjson.dumps(snapshot)]))
    for key, seq, value in keys:
        size += write_all(fd, _record(KEY, [_key_body(key, seq, value)]))
    for seq, min_version, frames in sorted(groups, key=lambda g: g[0]):
        size += write_all(fd, _record(PUT, _put_parts(seq, min_version, frames)))
    for consumer, items in deliveries:
        size += write_all(fd, _record(DELIVER, [_deliver_body(consumer, items)]))
    return size


def _deliver_body(consumer: str, items: Sequence[tuple[int, int]]) -> bytes:
    name = consumer.encode()
    return NAME_LEN.pack(len(name)) + name + b"".join(REMOVED.pack(seq, st) for seq, st in items)


def parse_deliver(body: memoryview) -> tuple[str, list[tuple[int, int]]]:
    (length,) = NAME_LEN.unpack_from(body)
    name = bytes(body[NAME_LEN.size:NAME_LEN.size + length]).decode()
    items = body[NAME_LEN.size + length:]
    if len(items) % REMOVED.size:
        raise ValueError("DELIVER record items do not add up")
    return name, list(REMOVED.iter_unpack(items))


def _key_body(key: str, seq: int, value: dict[str, Any]) -> bytes:
    return orjson.dumps({"key": key, "seq": seq, "value": value})


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_locked(path: Path, flags: int) -> int:
    """Open for append under an exclusive ``flock`` (the kernel drops it even on SIGKILL),
    so a second broker cannot interleave records into a live file."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpillError(f"{path} is in use by another broker") from None
    return fd
