"""The Lua copy of the staleness rule and the ZMQ broker answer as ``asyncrl/staleness.py`` does.

The Redis scripts cannot call Python, so ``buffers.redis_scripts.PRELUDE`` restates the rule
in named functions (``staleness``, ``is_stale``, ``stale_cutoff``, ``queued_stale``,
``engine_may_start``, ``allowance``) that the take and acquire scripts use. One script per
(max_staleness, groups_per_step) runs them, as the PRELUDE is loaded for every script (its
keys, its gate parameters in ``ARGV[1..4]``), over a grid of learner versions, oldest token
versions (``NO_VERSION`` included) and gate counters, on a real ``redis-server``; every answer
must be the Python one. The ZMQ broker's state (its drop sweep through the queue, the
staleness it delivers at, its allowance) is checked on the same grid.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections import Counter

import pytest
import redis

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import NO_VERSION, StalenessGate, staleness
from buffers.redis_scripts import PRELUDE, RedisKeys
from buffers.zmq_state import BrokerState, QueuedGroup

pytestmark = pytest.mark.timeout(60)

GATES = list(itertools.product(range(0, 5), range(1, 4)))  # (max_staleness, groups_per_step)
VERSIONS = list(range(0, 9))  # learner (or engine) versions
OLDEST = list(range(NO_VERSION, 9))  # a group's oldest token version; also engine versions
COUNTS = [(accepted, dropped, in_flight) for accepted in range(0, 45, 4)
          for dropped in (0, 3) if dropped <= accepted for in_flight in (0, 1, 4)]

PROBE = """
-- ARGV[5..7]: versions, oldest versions, (accepted, dropped, in flight) triples, as JSON.
local versions, oldest = cjson.decode(ARGV[5]), cjson.decode(ARGV[6])
local counts = cjson.decode(ARGV[7])
local function bit(b) if b then return 1 end return 0 end
local ages, stale, cutoffs, starts, queued, allowed = {}, {}, {}, {}, {}, {}
for _, v in ipairs(versions) do
  table.insert(cutoffs, stale_cutoff(v))
  for _, o in ipairs(oldest) do
    table.insert(ages, staleness(v, o))
    table.insert(stale, bit(is_stale(v, o)))
    table.insert(starts, bit(engine_may_start(v, o)))
  end
end
for i, o in ipairs(oldest) do enqueue('p', fmt(i) .. '-0', o) end
for _, v in ipairs(versions) do
  local dropped = {}
  for _, m in ipairs(queued_stale(v)) do table.insert(dropped, qparse(m).minv) end
  table.insert(queued, dropped)
end
for _, v in ipairs(versions) do
  for _, c in ipairs(counts) do
    redis.call('HSET', K_STATE, 'version', fmt(v), 'accepted', fmt(c[1]),
               'dropped_stale', fmt(c[2]))
    redis.call('DEL', K_INFLIGHT)
    add_in_flight('a', c[3] - math.floor(c[3] / 2))  -- the total is summed over producers
    add_in_flight('b', math.floor(c[3] / 2))
    table.insert(allowed, allowance())
  end
end
return {ages, stale, cutoffs, starts, queued, allowed}
"""


def expected(gate: StalenessGate) -> list[list]:
    """What the probe must return, from ``asyncrl.staleness`` alone."""
    pairs = list(itertools.product(VERSIONS, OLDEST))
    return [[staleness(v, o) for v, o in pairs],
            [int(not gate.is_fresh(v, o)) for v, o in pairs],
            [gate.stale_below(v) for v in VERSIONS],
            [int(gate.engine_may_start(v, o)) for v, o in pairs],
            [[o for o in OLDEST if not gate.is_fresh(v, o)] for v in VERSIONS],
            [gate.allowance(v, a - d, f) for v in VERSIONS for a, d, f in COUNTS]]


def test_lua_prelude_agrees_with_python(redis_server) -> None:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    keys = RedisKeys(f"asyncrl:parity:{uuid.uuid4().hex}")
    probe = client.register_script(PRELUDE + PROBE)
    grid = [json.dumps(VERSIONS), json.dumps(OLDEST), json.dumps(COUNTS)]
    try:
        for s, gps in GATES:
            got = probe(keys=keys.all(), args=[s, gps, 1000, 30_000, *grid])
            want = expected(StalenessGate(s, gps))
            got[4] = [sorted(versions) for versions in got[4]]  # ZRANGEBYSCORE: by score
            for name, lua, py in zip(("staleness", "is_stale", "stale_cutoff",
                                      "engine_may_start", "queued_stale", "allowance"),
                                     got, want):
                assert lua == py, (name, s, gps)
    finally:
        client.delete(*keys.all())
        client.close()


def zmq_state(s: int, gps: int) -> BrokerState:
    return BrokerState(BufferConfig(type="zmq", max_staleness=s), gps)


@pytest.mark.parametrize(("s", "gps"), GATES)
def test_zmq_broker_agrees_with_python(s: int, gps: int) -> None:
    gate = StalenessGate(s, gps)
    for v in VERSIONS:
        state = zmq_state(s, gps)
        for o in OLDEST:
            assert state.accept("p", QueuedGroup([], o, 0)) == ""
        assert state.take("learner", len(OLDEST) + 1, v) is None  # drops, then too few
        fresh = [o for o in OLDEST if gate.is_fresh(v, o)]
        assert state.pop_dropped("learner") == len(OLDEST) - len(fresh), (s, v)
        served = state.take("learner", len(fresh), v) or []
        assert sorted(g.min_version for g in served) == fresh, (s, v)
        assert all(g.delivered_staleness == staleness(v, g.min_version) for g in served)
    state = zmq_state(s, gps)
    for v, (a, d, f) in itertools.product(VERSIONS, COUNTS):
        state.version, state.accepted, state.dropped_stale = v, a, d
        state.in_flight = Counter({"a": f - f // 2, "b": f // 2})
        assert state.allowance() == gate.allowance(v, a - d, f), (s, v, a, d, f)


# --- pace (buffer.staleness_mode = "pace") -------------------------------------------------

PACE_PROBE = """
-- ARGV[5..6]: [[version, [[oldest, groups], ...] queued, [...] in flight], ...] and grant
-- operations, as JSON.
local cases, ops = cjson.decode(ARGV[5]), cjson.decode(ARGV[6])
local allowed, holds, totals = {}, {}, {}
local function counts(pairs_)
  local out = {}
  for _, pair in ipairs(pairs_) do out[pair[1]] = (out[pair[1]] or 0) + pair[2] end
  return out
end
for _, case in ipairs(cases) do
  local queued, in_flight = counts(case[2]), counts(case[3])
  table.insert(allowed, pace_allows(case[1], queued) and 1 or 0)
  table.insert(holds, pace_holds(case[1], queued, in_flight) and 1 or 0)
end
for _, op in ipairs(ops) do
  local kind, p, x = op[1], op[2], op[3]
  if kind == 'grant' then
    add_in_flight(p, op[4])
    grant(p, x, op[4])
  elseif kind == 'settle' then
    add_in_flight(p, -1)
    settle_grant(p, x)
    trim_grants(p)
  else
    add_in_flight(p, -x)
    release_grants(p, x)
    trim_grants(p)
  end
  local flat, now = redis.call('HGETALL', K_INFLIGHTV), {}
  for i = 1, #flat, 2 do table.insert(now, flat[i] .. '=' .. flat[i + 1]) end
  table.sort(now)
  table.insert(totals, table.concat(now, ','))
end
return {allowed, holds, totals}
"""


def pace_cases() -> list[tuple[int, dict[int, int], dict[int, int]]]:
    """(learner version, queued groups by version, groups in flight by version)."""
    import random

    rng = random.Random(0)

    def counts() -> dict[int, int]:
        return {v: rng.randrange(0, 4)
                for v in rng.sample(range(NO_VERSION, 8), rng.randrange(0, 5))}

    return [(rng.randrange(0, 7), counts(), counts()) for _ in range(300)]


PACE_OPS = [("grant", "a", 0, 3), ("grant", "b", 1, 2), ("settle", "a", 2), ("grant", "a", 2, 2),
            ("settle", "a", 0), ("release", "b", 1), ("settle", "b", -1), ("settle", "a", 5),
            ("release", "a", 5), ("grant", "b", 3, 1), ("settle", "b", 3)]


def python_grants() -> list[str]:
    from buffers.inflight_versions import InFlightVersions

    record, in_flight, out = InFlightVersions(), Counter(), []
    for kind, p, x, *n in PACE_OPS:
        if kind == "grant":
            in_flight[p] += n[0]
            record.grant(p, x, n[0])
        else:
            in_flight[p] = max(0, in_flight[p] - (1 if kind == "settle" else x))
            record.settle(p, x) if kind == "settle" else record.release(p, x)
            record.keep_at_most(p, in_flight[p])
        out.append(",".join(sorted(f"{v}|{q}={c}" for q in record.producers()
                                   for v, c in record._by_producer[q].items())))
    return out


def test_lua_pace_agrees_with_python(redis_server) -> None:
    from asyncrl.staleness import pace_allows, pace_holds

    client = redis.Redis(host="127.0.0.1", port=redis_server.port, decode_responses=True)
    keys = RedisKeys(f"asyncrl:parity:{uuid.uuid4().hex}")
    probe = client.register_script(PRELUDE + PACE_PROBE)
    cases = pace_cases()
    args = [json.dumps([[v, list(map(list, queued.items())), list(map(list, flying.items()))]
                        for v, queued, flying in cases]),
            json.dumps([list(op) for op in PACE_OPS])]
    try:
        for s, gps in GATES:
            client.delete(*keys.all())
            allowed, holds, totals = probe(keys=keys.all(), args=[s, gps, 1000, 30_000, *args])
            assert allowed == [int(pace_allows(v, s, gps, queued)) for v, queued, _ in cases], \
                (s, gps)
            assert holds == [int(pace_holds(v, s, gps, queued, flying))
                             for v, queued, flying in cases], (s, gps)
            assert sum(holds) > 0, (s, gps)   # the grid has waits to agree on
            assert totals == python_grants(), (s, gps)
    finally:
        client.delete(*keys.all())
        client.close()
