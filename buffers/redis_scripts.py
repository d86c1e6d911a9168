"""Key layout and Lua scripts of the Redis buffer: every rule that moves two counters together.

Why Lua: the gate (``accepted + in_flight`` against ``(V + s + 1) × gps``), a put (stream entry
+ ``accepted`` + the producer's ``in_flight``) and a take (claim + read + drop) must each be
one atomic step across several keys, and they need Redis' own clock (``TIME``) so that the
clocks of different machines never decide whether a member is alive.

Key layout under a namespace ``ns`` (``buffer.redis.namespace`` or ``asyncrl:<run_id>``):

=================  =======  ==================================================================
``ns:state``       hash     version, accepted, consumed, dropped_stale, run_status, run_id,
                            started (ms), gate_closed_ms, gate_closed_since, redelivered,
                            reaped, put_full, discarded_at_done (groups never consumed,
                            discarded when the run was marked done)
``ns:inflight``    hash     producer → groups granted and not yet put/released (> 0 only)
``ns:seen``        hash     member → last seen (Redis ms); alive while within the heartbeat
                            timeout
``ns:roles``       hash     member → role
``ns:info``        hash     member → orjson of its last heartbeat info
``ns:index``       stream   one entry per accepted group: minv (oldest token version), p
                            (producer), k (its payload key); consumer group ``learners``,
                            whose consumer ``~queued`` holds the entries no learner has
                            taken yet (the take chooses among them by deadline). Acked,
                            dropped and rejected entries are deleted, so XLEN is the depth
                            (queued + delivered)
``ns:g:<hex>``     string   one group's payload: the 5 wire frames packed
                            (:func:`buffers.packing.pack_group`). Staged by the producer
                            with an expiry (gone if it dies before the put script), kept
                            (PERSIST) when the group is accepted, deleted with its entry;
                            all of them when the run is marked done (the index too)
``ns:rejected``    hash     reason → count
``ns:hist``        hash     staleness at consumption → count
``ns:kv``          hash     key → orjson value (rendezvous, announcements, run/status)
``ns:kvseq``       hash     key → sequence number (starts above the clock in µs)
``ns:notify``      stream   one entry per set_key (field k), capped: wakes get_key long-polls
``ns:queue``       zset     one member per entry in ``~queued``'s pending list, all scored 0
                            and read in lex order: the producer (its length first), the id
                            zero-padded, the id, minv; so one producer's entries are one
                            range, in arrival order (the take merges the producers' heads)
``ns:queuev``      zset     the same members scored by minv (stale ones are one range)
``ns:inflightv``   hash     ``<version>|<producer>`` → groups in flight granted at that engine
                            version (``buffers.inflight_versions``, restated in Lua: what
                            ``buffer.staleness_mode = "pace"`` waits on)
=================  =======  ==================================================================

Every script receives all keys (``KEYS``, in :data:`KEY_NAMES` order; the put script also
the payload keys it files, after them) and the gate parameters
as ``ARGV[1..4]`` = max_staleness, groups_per_step, max_groups, heartbeat_timeout_ms; its own
arguments start at ``ARGV[5]``. On a Redis Cluster the namespace carries a ``{hash tag}``
(:func:`buffers.redis_connect.run_namespace` adds one): payload keys carry it too, so the
keys that scripts delete by the name an index entry gives (acks, drops) are in the same slot
as the declared ones (the contract suite runs on a three-node cluster).
The data-plane scripts (gate, put, take, ack) live in :mod:`buffers.redis_data_scripts`;
the shared Lua helpers (:data:`PRELUDE`) and the control-plane scripts here.
"""

from __future__ import annotations

from dataclasses import dataclass

from buffers.protocol import DONE
from buffers.redis_data_scripts import ACK, ACQUIRE, DISCARD, PUT_MANY, RELEASE, RENEW, TAKE

GROUP = "learners"
QUEUE = "~queued"  # the consumer whose pending list holds the unread entries (see TAKE)
KEY_NAMES = ("state", "inflight", "seen", "roles", "info", "index", "rejected",
             "hist", "kv", "kvseq", "notify", "queue", "queuev", "inflightv")
PAYLOAD_INFIX = ":g:"  # payload keys are f"{namespace}{PAYLOAD_INFIX}{hex}"
LEGACY_KEY_NAMES = ("groups",)  # the payload stream of earlier versions: reset deletes it
NOTIFY_MAXLEN = 1000  # notifications only wake waiters; trimming them loses no data


@dataclass(frozen=True)
class RedisKeys:
    """The key names of one run."""

    namespace: str

    def __getattr__(self, name: str) -> str:
        if name in KEY_NAMES:
            return f"{self.namespace}:{name}"
        raise AttributeError(name)

    def all(self) -> list[str]:
        return [f"{self.namespace}:{name}" for name in KEY_NAMES]

    def payload(self, tag: str) -> str:
        return f"{self.namespace}{PAYLOAD_INFIX}{tag}"

    def is_payload(self, key: str) -> bool:
        """A consumer reads and deletes only keys of this shape (an index entry written by
        someone else may name any key)."""
        prefix = f"{self.namespace}{PAYLOAD_INFIX}"
        return key.startswith(prefix) and len(key) > len(prefix)


PRELUDE = """
local N_FIXED_KEYS = """ + str(len(KEY_NAMES)) + """
local K_STATE, K_INFLIGHT, K_SEEN, K_ROLES, K_INFO, K_INDEX, K_REJECTED, K_HIST,
      K_KV, K_KVSEQ, K_NOTIFY, K_QUEUE, K_QUEUEV, K_INFLIGHTV = unpack(KEYS, 1, N_FIXED_KEYS)
local PAYLOAD_PREFIX = string.sub(K_STATE, 1, -#'state' - 2) .. '""" + PAYLOAD_INFIX + """'
local S, GPS = tonumber(ARGV[1]), tonumber(ARGV[2])
local MAX_GROUPS, HB_MS = tonumber(ARGV[3]), tonumber(ARGV[4])
local GROUP, QUEUE = '""" + GROUP + """', '""" + QUEUE + """'

local function fmt(n) return string.format('%d', n) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function num(key, field) return tonumber(redis.call('HGET', key, field) or '0') or 0 end
local function run_status() return redis.call('HGET', K_STATE, 'run_status') or 'running' end
local function touch(member, now)
  redis.call('HSET', K_SEEN, member, fmt(now))
  redis.call('HSETNX', K_ROLES, member, 'producer')
end
local function in_flight_total()
  local n = 0
  for _, v in ipairs(redis.call('HVALS', K_INFLIGHT)) do n = n + tonumber(v) end
  return n
end
local function add_in_flight(producer, delta)
  local n = num(K_INFLIGHT, producer) + delta
  if n > 0 then redis.call('HSET', K_INFLIGHT, producer, fmt(n))
  else redis.call('HDEL', K_INFLIGHT, producer) end
end

-- The versions the groups in flight were granted at: buffers/inflight_versions.py restated
-- (pace waits on them). K_INFLIGHTV: '<version>|<producer>' -> groups. A put settles the
-- producer's newest grant at or below the group's oldest version (else its oldest grant), a
-- release or rejection its newest grants; the record never holds more than K_INFLIGHT counts.
local function grant_field(producer, v) return fmt(v) .. '|' .. producer end
local function split_grant(field)
  local v, p = string.match(field, '^(%-?%d+)|(.*)$')
  return tonumber(v), p
end
local function grants_of(producer)  -- {version -> groups}
  local out, flat = {}, redis.call('HGETALL', K_INFLIGHTV)
  for i = 1, #flat, 2 do
    local v, p = split_grant(flat[i])
    if p == producer then out[v] = tonumber(flat[i + 1]) end
  end
  return out
end
local function grant(producer, v, n)
  if n > 0 then redis.call('HINCRBY', K_INFLIGHTV, grant_field(producer, v), n) end
end
local function take_grant(producer, grants, v)
  grants[v] = grants[v] - 1
  if grants[v] <= 0 then
    grants[v] = nil
    redis.call('HDEL', K_INFLIGHTV, grant_field(producer, v))
  else redis.call('HINCRBY', K_INFLIGHTV, grant_field(producer, v), -1) end
end
local function extreme_grant(grants, newest, at_most)  -- nil if none
  local best = nil
  for v in pairs(grants) do
    if (at_most == nil or v <= at_most) and
       (best == nil or (newest and v > best) or (not newest and v < best)) then best = v end
  end
  return best
end
local function release_grants(producer, n)
  local grants = grants_of(producer)
  for _ = 1, n do
    local v = extreme_grant(grants, true, nil)
    if v == nil then return end
    take_grant(producer, grants, v)
  end
end
local function settle_grant(producer, oldest)
  local grants = grants_of(producer)
  local v = extreme_grant(grants, true, oldest) or extreme_grant(grants, false, nil)
  if v ~= nil then take_grant(producer, grants, v) end
end
local function trim_grants(producer)  -- no more grants than the gate counts in flight
  local n = 0
  for _, c in pairs(grants_of(producer)) do n = n + c end
  if n > num(K_INFLIGHT, producer) then release_grants(producer, n - num(K_INFLIGHT, producer)) end
end
local function reap(now)  -- silent producers' in-flight groups go back to the gate
  local flat, dead = redis.call('HGETALL', K_INFLIGHT), nil
  for i = 1, #flat, 2 do
    if now - num(K_SEEN, flat[i]) > HB_MS then
      redis.call('HDEL', K_INFLIGHT, flat[i])
      redis.call('HINCRBY', K_STATE, 'reaped', tonumber(flat[i + 1]))
      dead = dead or {}
      dead[flat[i]] = true
    end
  end
  if dead then  -- and their grants with them
    for _, field in ipairs(redis.call('HKEYS', K_INFLIGHTV)) do
      local _, p = split_grant(field)
      if dead[p] then redis.call('HDEL', K_INFLIGHTV, field) end
    end
  end
end

-- The staleness rule of asyncrl/staleness.py, which Lua cannot call, restated (is_stale is
-- not is_fresh, stale_cutoff is stale_below) and checked against it by
-- tests/buffers/test_staleness_parity.py. minv is a group's oldest token version; a negative
-- one (NO_VERSION) means no generated token: its staleness is 0 and it is never stale.
local function staleness(learner_version, minv)
  if minv >= 0 then return learner_version - minv end
  return 0
end
local function is_stale(learner_version, minv) return staleness(learner_version, minv) > S end
local function stale_cutoff(learner_version)  -- stale: 0 <= minv < stale_cutoff
  return learner_version - S
end
local function engine_may_start(version, engine_version) return version - engine_version <= S end
local function pace_allows(version, left)  -- left: {oldest version -> groups}; see staleness.py
  local versions = {}
  for v, n in pairs(left) do if v >= 0 and n > 0 then table.insert(versions, v) end end
  table.sort(versions)
  local cumulative, i = 0, 1
  for k = 0, S do
    while i <= #versions and versions[i] <= version + k - S do
      cumulative = cumulative + left[versions[i]]
      i = i + 1
    end
    if cumulative > k * GPS then return false end
  end
  return true
end
local function pace_sum(queued, in_flight)  -- {version -> groups} of both
  local both = {}
  for v, n in pairs(queued) do both[v] = (both[v] or 0) + n end
  for v, n in pairs(in_flight) do both[v] = (both[v] or 0) + n end
  return both
end
-- Wait only if the groups in flight are part of what would go stale: the queue alone failing
-- cannot be helped by waiting (see staleness.py).
local function pace_holds(version, queued, in_flight)
  return not pace_allows(version, pace_sum(queued, in_flight)) and pace_allows(version, queued)
end
local function capacity(version) return (version + S + 1) * GPS end
local function allowance()  -- a group dropped as stale gives its slot back
  local live = num(K_STATE, 'accepted') - num(K_STATE, 'dropped_stale')
  return math.max(0, capacity(num(K_STATE, 'version')) - live - in_flight_total())
end

local function gate_update(now)  -- closed time accrues between the calls that see it closed
  local closed = run_status() == 'running' and allowance() == 0
  local since = redis.call('HGET', K_STATE, 'gate_closed_since')
  if closed and not since then
    redis.call('HSET', K_STATE, 'gate_closed_since', fmt(now))
  elseif since and not closed then
    redis.call('HINCRBY', K_STATE, 'gate_closed_ms', fmt(now - tonumber(since)))
    redis.call('HDEL', K_STATE, 'gate_closed_since')
  end
end
local function take_over(version, consumed)
  -- A namespace that consumed fewer groups than a learner did (reset, or Redis lost it)
  -- takes those steps over, so the gate admits what it would have; true if it did.
  local deficit = consumed - num(K_STATE, 'consumed')
  if deficit <= 0 then return false end
  redis.call('HINCRBY', K_STATE, 'accepted', fmt(deficit))
  redis.call('HINCRBY', K_STATE, 'consumed', fmt(deficit))
  if version > num(K_STATE, 'version') then
    redis.call('HSET', K_STATE, 'version', fmt(version))
  end
  return true
end
local function ensure_group()  -- after a restart without persistence, start empty
  if redis.call('EXISTS', K_INDEX) == 0 then
    redis.call('XGROUP', 'CREATE', K_INDEX, GROUP, '0', 'MKSTREAM')
    return
  end
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', K_INDEX)) do
    for i = 1, #g, 2 do
      if g[i] == 'name' and g[i + 1] == GROUP then return end
    end
  end
  redis.call('XGROUP', 'CREATE', K_INDEX, GROUP, '0')
end
local function is_payload_key(key)  -- an entry may name any key: touch only payload keys
  return #key > #PAYLOAD_PREFIX and string.sub(key, 1, #PAYLOAD_PREFIX) == PAYLOAD_PREFIX
end
local function drop_payload_of(f)  -- delete the payload an entry's fields name, if any
  for i = 1, #f - 1, 2 do
    if f[i] == 'k' and is_payload_key(f[i + 1]) then redis.call('DEL', f[i + 1]) end
  end
end
local function entry_facts(f)  -- an index entry's (oldest version or -1, producer or '')
  local minv, p = nil, nil
  if f[1] == 'minv' and f[3] == 'p' then minv, p = f[2], f[4]  -- as the put script writes
  else
    for i = 1, #f - 1, 2 do
      if f[i] == 'minv' then minv = f[i + 1] elseif f[i] == 'p' then p = f[i + 1] end
    end
  end
  local v = tonumber(minv or '')
  if not v or v ~= v or v == math.huge or v == -math.huge then v = -1 end  -- nan, inf: none
  return v, p or ''
end

-- The queue: the entries no learner has taken yet, kept in the order a take serves them
-- from (see TAKE). K_QUEUE is a sorted set read by lex order, one member per entry:
-- producer (length first, so one producer's members are one range), its id zero-padded
-- (arrival order), then the id and oldest version. K_QUEUEV holds the same members scored
-- by oldest version (stale ones are a range).
local function pad(s, n) return string.rep('0', n - #s) .. s end
local function id_order(id)  -- ids compare as strings in arrival order
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return pad(ms or '', 20) .. '-' .. pad(seq or '', 20)
end
local function producer_prefix(p) return string.format('%010d', #p) .. p end
local function qmember(p, id, minv)
  return producer_prefix(p) .. id_order(id) .. ' ' .. id .. ' ' .. tostring(minv)
end
local function qparse(m)  -- member -> {p, order, id, minv, m}
  local n = tonumber(string.sub(m, 1, 10))
  local order, id, minv = string.match(string.sub(m, 11 + n), '^(%S+) (%S+) (%S+)$')
  return {p = string.sub(m, 11, 10 + n), order = order, id = id, minv = tonumber(minv), m = m}
end
local function enqueue(p, id, minv)
  local m = qmember(p, id, minv)
  redis.call('ZADD', K_QUEUE, 0, m)
  if minv >= 0 then redis.call('ZADD', K_QUEUEV, minv, m) end
end
local function unqueue(m)  -- m leaves the queue if it is there
  redis.call('ZREM', K_QUEUE, m)
  redis.call('ZREM', K_QUEUEV, m)
end
local function queued_stale(learner_version)  -- the queued members stale at learner_version
  local cutoff = stale_cutoff(learner_version)
  if cutoff <= 0 then return {} end
  return redis.call('ZRANGEBYSCORE', K_QUEUEV, 0, cutoff - 1)
end
local function read_entry(id)  -- an index entry's fields, or nil if it is gone
  local e = redis.call('XRANGE', K_INDEX, id, id)
  return e[1] and e[1][2]
end
local function forget(id)  -- an entry about to go: its payload and its place in the queue
  local f = read_entry(id)
  if not f then return end
  drop_payload_of(f)
  local minv, p = entry_facts(f)
  unqueue(qmember(p, id, minv))
end
local function remove(id)  -- settled (or never delivered): entry and payload gone; 1 if it was
  forget(id)
  redis.call('XACK', K_INDEX, GROUP, id)
  return redis.call('XDEL', K_INDEX, id)
end
local function ack_entries(first)  -- ARGV[first..]: (id, staleness) pairs; only pending count
  local n = 0
  for i = first, #ARGV - 1, 2 do
    if redis.call('XACK', K_INDEX, GROUP, ARGV[i]) == 1 then
      forget(ARGV[i])
      redis.call('XDEL', K_INDEX, ARGV[i])
      redis.call('HINCRBY', K_HIST, ARGV[i + 1], 1)
      n = n + 1
    end
  end
  if n > 0 then redis.call('HINCRBY', K_STATE, 'consumed', n) end
  return n
end
"""

INIT = """
local now = now_ms()
redis.call('HSETNX', K_STATE, 'run_status', 'running')
redis.call('HSETNX', K_STATE, 'version', '0')
redis.call('HSETNX', K_STATE, 'started', fmt(now))
redis.call('HSETNX', K_STATE, 'run_id', ARGV[5])
redis.call('HSET', K_STATE, 'staleness_mode', ARGV[6])  -- the take reads it (pace)
ensure_group()
return redis.call('HGET', K_STATE, 'run_id')
"""

PUBLISH_VERSION = """
local version, current = tonumber(ARGV[5]), num(K_STATE, 'version')
if version < current then
  return redis.error_reply('version ' .. ARGV[5] .. ' is behind ' .. fmt(current))
end
if current == 0 and version > 1 and num(K_STATE, 'consumed') == 0 then
  -- No progress here, yet a learner past its first step: this namespace lost its state while
  -- the learner trained (Redis restarted without persistence, a reset). It takes the steps
  -- over as a resume would (see the ZMQ twin, BrokerState.publish_version).
  take_over(version, version * GPS)
end
redis.call('HSET', K_STATE, 'version', ARGV[5])
gate_update(now_ms())
return version
"""

RESTORE_PROGRESS = """
-- ARGV: version, consumed of the resumed learner (see take_over); idempotent.
if take_over(tonumber(ARGV[5]), tonumber(ARGV[6])) then gate_update(now_ms()) end
return num(K_STATE, 'version')
"""

HEARTBEAT = """
-- ARGV: member, role ('' keeps the known one), orjson info.
local now = now_ms()
touch(ARGV[5], now)
if ARGV[6] ~= '' then redis.call('HSET', K_ROLES, ARGV[5], ARGV[6]) end
redis.call('HSET', K_INFO, ARGV[5], ARGV[7])
reap(now)
gate_update(now)
return {num(K_STATE, 'version'), run_status()}
"""

SET_KEY = """
-- ARGV: key, orjson value, new run status ('' unless key is run/status). A key's first
-- number is above the clock in microseconds: above any number a Redis that lost the key
-- (restarted without persistence) had issued, so a waiter's newer_than stays meaningful.
-- Marking the run done discards its unconsumed groups in the same step (see
-- discard_unconsumed). Returns {seq, groups discarded}.
local function discard_unconsumed()
  -- A finished run trains on nothing more, and from now on the put script refuses every
  -- group (and deletes its staged payload): the entries left in the index, unread or
  -- delivered and never acked, are dead weight in a shared Redis. Their payloads go and the
  -- index starts over empty; the counters, members, keys and histograms stay for
  -- `asyncrl status`. Bounded by max_groups (the put script never files more).
  local n = 0
  for _, e in ipairs(redis.call('XRANGE', K_INDEX, '-', '+')) do
    drop_payload_of(e[2])
    n = n + 1
  end
  redis.call('DEL', K_INDEX, K_QUEUE, K_QUEUEV)
  ensure_group()
  if n > 0 then redis.call('HINCRBY', K_STATE, 'discarded_at_done', n) end
  return n
end
if redis.call('HEXISTS', K_KVSEQ, ARGV[5]) == 0 then
  local t = redis.call('TIME')
  redis.call('HSET', K_KVSEQ, ARGV[5], fmt(tonumber(t[1]) * 1000000 + tonumber(t[2])))
end
local seq = redis.call('HINCRBY', K_KVSEQ, ARGV[5], 1)
redis.call('HSET', K_KV, ARGV[5], ARGV[6])
local discarded = 0
if ARGV[7] ~= '' then
  redis.call('HSET', K_STATE, 'run_status', ARGV[7])
  if ARGV[7] == '""" + DONE + """' then discarded = discard_unconsumed() end
  gate_update(now_ms())
end
redis.call('XADD', K_NOTIFY, 'MAXLEN', '~', '""" + str(NOTIFY_MAXLEN) + """', '*', 'k', ARGV[5])
return {seq, discarded}
"""

REAP = """
ensure_group()
local now = now_ms()
reap(now)
gate_update(now)
return 1
"""

SCRIPTS = {"init": INIT, "acquire": ACQUIRE, "release": RELEASE, "put_many": PUT_MANY,
           "take": TAKE, "discard": DISCARD, "ack": ACK, "renew": RENEW,
           "publish_version": PUBLISH_VERSION, "restore_progress": RESTORE_PROGRESS,
           "heartbeat": HEARTBEAT, "set_key": SET_KEY, "reap": REAP}
"""Script name → body; each runs as ``PRELUDE + body``."""
