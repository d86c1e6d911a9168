"""Turns the raw Redis snapshot of a run into the status dict every backend reports.

The keys match :meth:`buffers.zmq_state.BrokerState.status`, so the monitor and
``asyncrl status`` read both backends alike; Redis adds ``pending`` (delivered, not yet
acked), ``redelivered``, ``reaped`` (in-flight groups given back for silent producers),
``put_full`` (puts that found the buffer full), ``discarded_at_done`` (groups never consumed,
discarded when the run was marked done) and ``namespace``. Times come from Redis'
clock (``TIME``), never from this machine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import StalenessGate
from buffers.protocol import RUNNING
from buffers.redis_scripts import QUEUE


def _text(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def _ints(raw: dict[bytes, bytes]) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in raw.items()}


def batch_stats(raw: Sequence[Any]) -> dict[str, Any]:
    """The take script's stats list, named like the ZMQ broker's batch stats."""
    depth, accepted, in_flight, consumed, dropped, version, status, pace_ms = raw
    return {"depth": int(depth), "accepted": int(accepted), "in_flight": int(in_flight),
            "consumed": int(consumed), "dropped_stale": int(dropped), "version": int(version),
            "run_status": status.decode() if isinstance(status, bytes) else str(status),
            "pace_held_s": int(pace_ms) / 1000}


def _members(seen: dict[str, int], roles: dict[str, str], info: dict[bytes, bytes],
             in_flight: dict[str, int], now_ms: int, timeout_ms: float) -> dict[str, Any]:
    infos = {k.decode(): orjson.loads(v) for k, v in info.items()}
    return {name: {"role": roles.get(name, "producer"), "alive": now_ms - last <= timeout_ms,
                   "last_seen_s_ago": (now_ms - last) / 1000, "in_flight": in_flight.get(name, 0),
                   "info": infos.get(name, {})}
            for name, last in sorted(seen.items())}


def _delivered(pending: dict[str, Any] | list[Any] | None) -> int:
    """Entries delivered to a learner and not yet acked: the XPENDING summary without the
    unread entries that wait in the pending list of :data:`~buffers.redis_scripts.QUEUE`.
    The summary is parsed by redis-py, or (in a cluster transaction, which skips its reply
    parsers) Redis' own reply: ``[count, min, max, [[consumer, count], ...]]``."""
    if not pending:
        return 0
    if isinstance(pending, list):
        total, consumers = pending[0], [(name, n) for name, n in pending[3] or ()]
    else:
        total, consumers = pending["pending"], [(c["name"], c["pending"])
                                                for c in pending.get("consumers") or ()]
    waiting = sum(int(n) for name, n in consumers if name in (QUEUE, QUEUE.encode()))
    return int(total) - waiting


def assemble_status(snapshot: Sequence[Any], gate: StalenessGate, config: BufferConfig,
                    namespace: str) -> dict[str, Any]:
    """``snapshot``: HGETALL of state, inflight, seen, roles, info, rejected, hist; HKEYS of
    kvseq; XLEN of groups; XPENDING summary; TIME — read in one MULTI."""
    state_raw, inflight, seen, roles, info, rejected, hist, keys, depth, pending, now = snapshot
    state = _text(state_raw)
    now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
    version, accepted = int(state.get("version", 0)), int(state.get("accepted", 0))
    in_flight = _ints(inflight)
    dropped = int(state.get("dropped_stale", 0))  # a dropped group gave its slot back
    allowance = gate.allowance(version, accepted - dropped, sum(in_flight.values()))
    run_status = state.get("run_status", RUNNING)
    closed_ms = int(state.get("gate_closed_ms", 0))
    if "gate_closed_since" in state:
        closed_ms += now_ms - int(state["gate_closed_since"])
    pace_ms = int(state.get("pace_held_ms", 0))
    if "pace_held_since" in state:
        pace_ms += now_ms - int(state["pace_held_since"])
    return {
        "depth": int(depth), "accepted": accepted, "in_flight": sum(in_flight.values()),
        "consumed": int(state.get("consumed", 0)),
        "dropped_stale": dropped, "version": version,
        "run_status": run_status, "run_id": state.get("run_id", ""),
        "max_staleness": gate.max_staleness, "groups_per_step": gate.groups_per_step,
        "max_groups": config.max_groups, "rejected": _ints(rejected),
        "gate_open": run_status == RUNNING and allowance > 0, "gate_allowance": allowance,
        "gate_closed_s": closed_ms / 1000,
        "staleness_mode": config.staleness_mode, "pace_held_s": pace_ms / 1000,
        "staleness_hist": {str(k): n for k, n in sorted(_ints(hist).items(),
                                                        key=lambda kv: int(kv[0]))},
        "members": _members(_ints(seen), _text(roles), info, in_flight, now_ms,
                            config.heartbeat_timeout_s * 1000),
        "uptime_s": (now_ms - int(state.get("started", now_ms))) / 1000,
        "keys": sorted(k.decode() for k in keys),
        "pending": _delivered(pending),
        "redelivered": int(state.get("redelivered", 0)), "reaped": int(state.get("reaped", 0)),
        "put_full": int(state.get("put_full", 0)),
        "discarded_at_done": int(state.get("discarded_at_done", 0)), "namespace": namespace,
    }
