"""Reading a spill file back (:mod:`buffers.zmq_spill` has the format): what a restart restores.

The last STATE record gives the counters; every later PUT with a new seq counts one accepted,
every ACKED/DROP one consumed/dropped, and the live groups (PUT minus ACKED/DROP) come back
queued in seq order. A torn or corrupt tail (a crash mid-write) fails its length or checksum:
replay stops there and truncates the file to the last good record, so appends continue from a
clean point.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson

from asyncrl.config.schema import SPILL_AUTO, SPILL_NAME
from buffers.zmq_spill import (
    ACKED,
    CHECKSUMS,
    COMPACT_MIN_BYTES,
    DELIVER,
    DROP,
    FRAME_LEN,
    HEADER,
    KEY,
    MAGIC,
    PUT,
    PUT_HEAD,
    REMOVED,
    STATE,
    Checksum,
    Recovered,
    SpillError,
    SpillLog,
    open_locked,
    parse_deliver,
    write_all,
)

if TYPE_CHECKING:
    from buffers.zmq_state import BrokerState

logger = logging.getLogger(__name__)


def spill_file(setting: str, run_dir: Path | None) -> Path | None:
    """Where a broker journals (``buffer.zmq.spill_path``): ``auto`` is the run directory's
    ``buffer.spill`` and needs one (a broker built without a run, as tests and benchmarks do,
    keeps memory only); empty is memory only; anything else is the path."""
    if setting == SPILL_AUTO:
        return run_dir / SPILL_NAME if run_dir is not None else None
    return Path(setting) if setting else None


def open_spill(path: str | Path, compact_min_bytes: int = COMPACT_MIN_BYTES
               ) -> tuple[SpillLog, Recovered | None]:
    """Lock ``path``, replay it if it holds records (None when it is new), open for append."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_locked(path, os.O_CREAT)
    try:
        recovered, magic = None, MAGIC
        if os.fstat(fd).st_size > len(MAGIC):
            recovered, magic = _replay(path)
        elif not any(m.startswith(path.read_bytes()) for m in CHECKSUMS):  # our torn creation?
            raise SpillError(f"{path} exists and is not an asyncrl spill file")
        else:
            os.ftruncate(fd, 0)
            write_all(fd, [MAGIC])
    except BaseException:
        os.close(fd)
        raise
    log = SpillLog(path, fd, compact_min_bytes, checksum=CHECKSUMS[magic])
    if recovered is not None:
        log.account(recovered)
    return log, recovered


def snapshot_of(state: BrokerState) -> dict[str, Any]:
    """What a STATE record holds: everything but the groups and keys (own records)."""
    return {"epoch": state.epoch, "run_id": state.run_id, "next_seq": state.next_seq,
            "version": state.version, "run_status": state.run_status,
            "accepted": state.accepted, "consumed": state.consumed,
            "dropped_stale": state.dropped_stale, "redelivered": state.redelivered,
            "rejected": dict(state.rejections.counts),
            "staleness_hist": {str(k): n for k, n in state.staleness_hist.items()}}


def restore(state: BrokerState, recovered: Recovered) -> None:
    """Put what a replay found into a fresh state: counters, keys, unacked groups queued."""
    from buffers.zmq_state import QueuedGroup  # zmq_state imports this module

    saved = recovered.state
    if state.run_id and saved.get("run_id") and saved["run_id"] != state.run_id:
        raise SpillError(f"spill file is of run {saved['run_id']!r}, not {state.run_id!r}")
    state.epoch = str(saved.get("epoch", state.epoch))
    for name in ("next_seq", "version", "accepted", "consumed", "dropped_stale",
                 "redelivered"):
        setattr(state, name, int(saved.get(name, getattr(state, name))))
    state.run_status = str(saved.get("run_status", state.run_status))
    state.rejections.counts.update(saved.get("rejected", {}))
    state.staleness_hist.update({int(k): n for k, n in saved.get("staleness_hist", {}).items()})
    state.keys.values.update(recovered.keys)
    now = state.clock()
    for seq in sorted(recovered.groups):
        min_version, frames = recovered.groups[seq]
        group = QueuedGroup(frames, min_version, sum(f.nbytes for f in frames), seq=seq)
        if seq in recovered.delivered:  # its consumer may still train on it: await its ack
            group.consumer, group.delivered_staleness = recovered.delivered[seq]
            group.delivered_at = now
            state.pending[seq] = group
        else:
            state.queue.append(group)
            state.requeued.add(seq)  # a file written before DELIVER records: may be held
    state.held_bytes = sum(g.nbytes for g in (*state.queue, *state.pending.values()))
    logger.info("restored %d unacked groups at version %d (accepted %d, consumed %d): %d "
                "queued, %d delivered and awaiting their acks", len(recovered.groups),
                state.version, state.accepted, state.consumed, len(state.queue),
                len(state.pending))


def _replay(path: Path) -> tuple[Recovered, bytes]:
    """The records of ``path`` and its MAGIC (which says how its records are checksummed)."""
    with path.open("rb") as f:
        magic = f.read(len(MAGIC))
        checksum = CHECKSUMS.get(magic)
        if checksum is None:
            raise SpillError(f"{path} exists and is not an asyncrl spill file")
        recovered = Recovered(state={})
        size, good = path.stat().st_size, len(MAGIC)
        while (record := _read_record(f, size - good, checksum)) is not None:
            kind, body = record
            try:
                _apply(recovered, kind, body)
            except (ValueError, struct.error, KeyError, TypeError):
                logger.warning("spill %s: undecodable record at byte %d, ignoring the tail",
                               path, good)
                break
            good += HEADER.size + len(body)
    if good < size:
        logger.warning("spill %s: torn or corrupt tail at byte %d of %d: truncated",
                       path, good, size)
        os.truncate(path, good)
    logger.info("spill %s replayed: %d live groups, %d keys", path, len(recovered.groups),
                len(recovered.keys))
    return recovered, magic


def _read_record(f: BinaryIO, remaining: int, checksum: Checksum
                 ) -> tuple[int, memoryview] | None:
    header = f.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    length, crc, kind = HEADER.unpack(header)
    if length > remaining - HEADER.size:  # never allocate what a garbage length says
        return None
    body = memoryview(f.read(length))
    if len(body) < length or checksum(kind, [body]) != crc:
        return None
    return kind, body


def _apply(recovered: Recovered, kind: int, body: memoryview) -> None:
    state = recovered.state
    if kind == STATE:
        state.clear()
        state.update(orjson.loads(body))
    elif kind == KEY:
        record = orjson.loads(body)
        recovered.keys[record["key"]] = (int(record["seq"]), record["value"])
    elif kind == PUT:
        seq, min_version, frames = _parse_put(body)
        recovered.groups[seq] = (min_version, frames)
        if seq >= state.get("next_seq", 0):
            state["next_seq"] = seq + 1
            state["accepted"] = state.get("accepted", 0) + 1
    elif kind in (ACKED, DROP):
        _apply_removed(recovered, kind, body)
    elif kind == DELIVER:
        consumer, items = parse_deliver(body)
        for seq, staleness in items:
            if consumer and seq in recovered.groups:
                recovered.delivered[seq] = (consumer, staleness)
            else:
                recovered.delivered.pop(seq, None)
    else:
        raise ValueError(f"unknown record type {kind}")


def _apply_removed(recovered: Recovered, kind: int, body: memoryview) -> None:
    state = recovered.state
    hist: Counter[str] = Counter(state.get("staleness_hist", {}))
    for seq, staleness in REMOVED.iter_unpack(body):
        recovered.groups.pop(seq, None)
        recovered.delivered.pop(seq, None)
        if kind == ACKED:
            state["consumed"] = state.get("consumed", 0) + 1
            hist[str(staleness)] += 1
        else:
            state["dropped_stale"] = state.get("dropped_stale", 0) + 1
    state["staleness_hist"] = dict(hist)


def _parse_put(body: memoryview) -> tuple[int, int, list[memoryview]]:
    seq, min_version, count = PUT_HEAD.unpack_from(body)
    offset = PUT_HEAD.size
    lengths = [FRAME_LEN.unpack_from(body, offset + 4 * i)[0] for i in range(count)]
    offset += 4 * count
    frames = []
    for length in lengths:
        frames.append(body[offset:offset + length])
        offset += length
    if offset != len(body):
        raise ValueError("PUT record frame lengths do not add up")
    return seq, min_version, frames
