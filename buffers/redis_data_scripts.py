"""Lua of the Redis buffer's data plane: the gate, puts, takes, drops and acks.

Payloads never pass through Lua: a producer stages each group's packed bytes under its own
key with a plain ``SET`` and the put script only files the key in the index; a take claims
index entries and the consumer reads the payloads they name with a plain ``MGET``. (When the
scripts carried the payloads, every byte was copied into a Lua string and back: ``EVALSHA``
of a put took 4x a plain ``XADD`` of the same bytes.)

Each body runs after :data:`buffers.redis_scripts.PRELUDE` (key names ``K_*``, the gate
parameters, helpers such as ``touch``, ``reap``, ``gate_update`` and ``remove``, and the
staleness rule of :mod:`asyncrl.staleness` restated in Lua: ``is_stale``, ``queued_stale``,
``engine_may_start``, ``allowance``); see :mod:`buffers.redis_scripts` for the key layout.
Kept as plain strings so that Redis, not Python, is where each rule runs atomically.
"""

from __future__ import annotations

ACQUIRE = """
local producer, want, engine_version = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
touch(producer, now)
reap(now)
local version, granted = num(K_STATE, 'version'), 0
if run_status() == 'running' and engine_may_start(version, engine_version) then
  local room = MAX_GROUPS - redis.call('XLEN', K_INDEX) - in_flight_total()
  granted = math.max(0, math.min(want, allowance(), room))
  if granted > 0 then
    add_in_flight(producer, granted)
    grant(producer, engine_version, granted)
  end
end
gate_update(now)
return {granted, version, run_status()}
"""

RELEASE = """
local now = now_ms()
touch(ARGV[5], now)
add_in_flight(ARGV[5], -tonumber(ARGV[6]))
release_grants(ARGV[5], tonumber(ARGV[6]))
trim_grants(ARGV[5])
gate_update(now)
return 1
"""

PUT_MANY = """
-- KEYS[N_FIXED_KEYS + 1..]: the payload keys the client staged (SET ... PX) in the same pipeline.
-- ARGV: producer, staged ttl ms, then 4 per group: reason ('' unless the client already
-- rejected it), minv, run_id, its payload key's position in KEYS[13..] (0: none). Groups
-- are handled in order, each exactly as a single put: a rejection is counted, uses its slot
-- up and deletes its payload; an accepted group gets an index entry and its payload is kept
-- (PERSIST). Stops at the first valid group that finds the buffer full (backpressure: never
-- trim): its result is {0, 'full'}, its and the rest's payloads stay staged (their expiry is
-- pushed back) for the client to retry with the keys alone. A payload already kept (no
-- expiry) was filed by an earlier run of the same call, sent again after a lost connection:
-- it is answered as accepted and filed once. Payloads never enter Lua.
-- Returns one {1, id} | {0, reason} per group handled.
local producer, ttl = ARGV[5], ARGV[6]
local now = now_ms()
touch(producer, now)
local run_id = redis.call('HGET', K_STATE, 'run_id') or ''
local running = run_status() == 'running'
local results = {}
for i = 7, #ARGV, 4 do
  local reason, minv, group_run = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local key = KEYS[N_FIXED_KEYS + tonumber(ARGV[i + 3])]  -- nil for position 0
  if reason == '' and (not running or (run_id ~= '' and group_run ~= '' and
                                       group_run ~= run_id)) then reason = 'run' end
  if reason == '' and (not key or not is_payload_key(key)) then reason = 'frames' end
  local left = reason == '' and redis.call('PTTL', key) or -2  -- -1: kept, -2: gone
  local full = reason == '' and left ~= -1 and redis.call('XLEN', K_INDEX) >= MAX_GROUPS
  if not full and reason == '' and left == -2 then reason = 'expired' end
  if reason == '' and left == -1 then
    table.insert(results, {1, key})  -- filed by an earlier run of this same call (a retry)
  elseif full then
    redis.call('HINCRBY', K_STATE, 'put_full', 1)
    for j = i, #ARGV, 4 do  -- still staged (not kept): they wait for the retry
      local rest = KEYS[N_FIXED_KEYS + tonumber(ARGV[j + 3])]
      if rest and is_payload_key(rest) and redis.call('PTTL', rest) > 0 then
        redis.call('PEXPIRE', rest, ttl)
      end
    end
    table.insert(results, {0, 'full'})
    break
  elseif reason ~= '' then
    if key and is_payload_key(key) then redis.call('DEL', key) end
    redis.call('HINCRBY', K_REJECTED, reason, 1)
    add_in_flight(producer, -1)
    release_grants(producer, 1)
    trim_grants(producer)
    table.insert(results, {0, reason})
  else
    redis.call('PERSIST', key)
    local id = redis.call('XADD', K_INDEX, '*', 'minv', minv, 'p', producer, 'k', key)
    redis.call('HINCRBY', K_STATE, 'accepted', 1)
    add_in_flight(producer, -1)
    settle_grant(producer, tonumber(minv) or -1)
    trim_grants(producer)
    table.insert(results, {1, id})
  end
end
gate_update(now)
return results
"""

TAKE = """
-- ARGV: consumer, need, learner_version, reclaim_idle_ms, n held, then the n ids this
-- consumer holds, then (id, staleness) pairs to ack first (a get_batch carrying the previous
-- batch's ack). All or nothing: claims only when `need` fresh groups can be had right now,
-- so consumers never strand partial batches. Works on the index alone: entries are a few
-- bytes, the client reads the payloads they name afterwards (MGET), outside Lua.
--
-- Unread entries wait in the pending list of the reserved consumer QUEUE: XREADGROUP can
-- only hand out a stream's entries in arrival order, XCLAIM any of them. The candidates are
-- the queue's entries and those idle for reclaim_idle_ms on any consumer, the caller too: a
-- live learner renews what it holds (its held ids just above), so an idle entry is a dead
-- one's, or the caller's own from a run of this script whose reply was lost (redis-py sends
-- it again: that first batch is unknown to the client). Stale ones are dropped, and the
-- `need` with the earliest deadline are claimed, in that order: oldest version first, then
-- arrival, each producer's groups in their order (a group's key is the newest version among
-- its producer's candidates up to it), exactly as the ZMQ broker serves. Keys grow along
-- each producer's candidates, so the `need` smallest are a merge of the producers' heads,
-- read from the queue's sorted sets (PRELUDE): the take costs O((producers + need) log
-- queue) plus what the consumers hold, whatever the queue holds. (Reading the whole index
-- instead cost 8 ms of Redis at 4,096 queued.)
-- Returns {lost held ids, dropped, entries, tail id, stats, acked}.
-- pace (buffer.staleness_mode): the finished groups left once `picked` is served, queued
-- ones and the reclaimable ones (again_of), by oldest version; only versions up to
-- learner_version can fail pace_allows.
local function pace_queued(learner_version, again_of, picked)
  local left = {}
  local function add(v, n) left[v] = (left[v] or 0) + n end
  local old = redis.call('ZRANGEBYSCORE', K_QUEUEV, 0, learner_version, 'WITHSCORES')
  for i = 2, #old, 2 do add(tonumber(old[i]), 1) end
  for _, list in pairs(again_of) do
    for _, c in ipairs(list) do add(c.minv, 1) end
  end
  for _, c in ipairs(picked) do add(c.minv, -1) end
  return left
end
local function pace_in_flight()  -- the groups in flight, by the version they were granted at
  local left, flat = {}, redis.call('HGETALL', K_INFLIGHTV)
  for i = 1, #flat, 2 do
    local v = split_grant(flat[i])
    left[v] = (left[v] or 0) + tonumber(flat[i + 1])
  end
  return left
end
local function oldest_by_version(need, again_of)
  -- The `need` candidates of smallest (oldest version, arrival), whoever put them: the order
  -- pace falls back to (the ZMQ twin: GroupQueue.oldest_by_version). K_QUEUEV sorts one
  -- version's members by producer, not arrival, so every member up to the need-th one's
  -- version is read. Versionless members (minv < 0, rare) are only in K_QUEUE; they sort
  -- first, as in the twin.
  local candidates = {}
  if redis.call('ZCARD', K_QUEUE) > redis.call('ZCARD', K_QUEUEV) then
    for _, m in ipairs(redis.call('ZRANGE', K_QUEUE, 0, -1)) do
      local c = qparse(m)
      if c.minv < 0 then table.insert(candidates, c) end
    end
  end
  local nth = redis.call('ZRANGEBYSCORE', K_QUEUEV, '-inf', '+inf', 'WITHSCORES',
                         'LIMIT', need - 1, 1)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', K_QUEUEV, '-inf', nth[2] or '+inf')) do
    table.insert(candidates, qparse(m))
  end
  for _, list in pairs(again_of) do
    for _, c in ipairs(list) do table.insert(candidates, c) end
  end
  table.sort(candidates, function(x, y)
    if x.minv ~= y.minv then return x.minv < y.minv end
    return x.order < y.order
  end)
  local out = {}
  for i = 1, math.min(need, #candidates) do out[i] = candidates[i] end
  return out
end
local function pace_clock(held)  -- seconds takes were held by pace, as the gate's closed time
  local since, now = redis.call('HGET', K_STATE, 'pace_held_since'), now_ms()
  if held and not since then redis.call('HSET', K_STATE, 'pace_held_since', fmt(now))
  elseif since and not held then
    redis.call('HINCRBY', K_STATE, 'pace_held_ms', fmt(now - tonumber(since)))
    redis.call('HDEL', K_STATE, 'pace_held_since')
  end
end

local consumer, need = ARGV[5], tonumber(ARGV[6])
local learner_version, reclaim_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local n_held = tonumber(ARGV[9])
ensure_group()
local acked = ack_entries(10 + n_held)

local lost = {}
for i = 10, 9 + n_held do  -- held ids stay ours only if nobody reclaimed them; keep them fresh
  local p = redis.call('XPENDING', K_INDEX, GROUP, ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= consumer then table.insert(lost, ARGV[i])
  else redis.call('XCLAIM', K_INDEX, GROUP, consumer, 0, ARGV[i], 'JUSTID') end
end

-- The entries put since the last take join the queue: QUEUE's pending list, and the sorted
-- sets that order it (filed here, not by the put script, so that an entry written past the
-- put script is served too). Every entry now waits there or is delivered to a learner (a
-- few batches each). The sets name exactly QUEUE's list unless an entry was acked or
-- deleted behind the scripts' back: then they hold more, and are rebuilt from the list.
local read = redis.call('XREADGROUP', 'GROUP', GROUP, QUEUE, 'STREAMS', K_INDEX, '>')
for _, e in ipairs(read and read[1][2] or {}) do
  local minv, p = entry_facts(e[2])
  enqueue(p, e[1], minv)
end
local reclaimable, n_queued = {}, 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', K_INDEX, GROUP)) do
  local f = {}
  for i = 1, #c - 1, 2 do f[c[i]] = c[i + 1] end
  if f['name'] == QUEUE then n_queued = f['pending']
  elseif f['pending'] > 0 then
    for _, p in ipairs(redis.call('XPENDING', K_INDEX, GROUP, '-', '+', f['pending'],
                                  f['name'])) do
      if p[3] >= reclaim_ms then table.insert(reclaimable, p[1]) end
    end
  end
end
if redis.call('ZCARD', K_QUEUE) ~= n_queued then
  redis.call('DEL', K_QUEUE, K_QUEUEV)
  if n_queued > 0 then
    for _, p in ipairs(redis.call('XPENDING', K_INDEX, GROUP, '-', '+', n_queued, QUEUE)) do
      local f = read_entry(p[1])
      if f then
        local minv, producer = entry_facts(f)
        enqueue(producer, p[1], minv)
      else
        redis.call('XACK', K_INDEX, GROUP, p[1])  -- its entry was deleted: nothing to serve
      end
    end
  end
end

-- Drop the stale candidates; the fresh reclaimable ones join their producer's candidates.
local dropped, n_fresh, again_of = 0, 0, {}
for _, m in ipairs(queued_stale(learner_version)) do
  unqueue(m)  -- remove() does too, but only while the entry is there
  dropped = dropped + remove(qparse(m).id)
end
for _, id in ipairs(reclaimable) do
  local f = read_entry(id)
  if f then
    local minv, p = entry_facts(f)
    if is_stale(learner_version, minv) then dropped = dropped + remove(id)
    else
      n_fresh = n_fresh + 1
      again_of[p] = again_of[p] or {}
      table.insert(again_of[p], {order = id_order(id), id = id, minv = minv, again = true})
    end
  end
end
redis.call('HINCRBY', K_STATE, 'dropped_stale', dropped)
n_fresh = n_fresh + redis.call('ZCARD', K_QUEUE)

local entries = {}
if n_fresh >= need and need > 0 then
  -- One candidate list per producer: its reclaimable entries and its queued ones, merged
  -- by arrival. A heap of the producers by (key of their head, arrival) yields the order.
  local function queued_head(s)  -- the producer's first queued member not yet picked
    local r = redis.call('ZRANGEBYLEX', K_QUEUE, '(' .. s.prefix, '(' .. s.prefix .. ':',
                         'LIMIT', s.skip, 1)
    return r[1] and qparse(r[1]) or nil
  end
  local function head(s)
    local a, b = s.again[s.next_again], s.queued
    if a and (not b or a.order < b.order) then return a end
    return b
  end
  local function before(x, y)
    if x.key ~= y.key then return x.key < y.key end
    return x.c.order < y.c.order
  end
  local heap = {}
  local function push(item)
    local i = #heap + 1
    heap[i] = item
    while i > 1 and before(heap[i], heap[math.floor(i / 2)]) do
      local up = math.floor(i / 2)
      heap[i], heap[up] = heap[up], heap[i]
      i = up
    end
  end
  local function pop()
    local top, last = heap[1], table.remove(heap)
    if #heap > 0 then
      heap[1] = last
      local i = 1
      while true do
        local l, r, m = 2 * i, 2 * i + 1, i
        if l <= #heap and before(heap[l], heap[m]) then m = l end
        if r <= #heap and before(heap[r], heap[m]) then m = r end
        if m == i then break end
        heap[i], heap[m] = heap[m], heap[i]
        i = m
      end
    end
    return top
  end
  local producers, lower = {}, '-'
  -- Each producer's first queued member, then on past the producer: its members are its
  -- prefix and digits, all below prefix .. ':', and every other producer's lie beyond.
  while true do
    local r = redis.call('ZRANGEBYLEX', K_QUEUE, lower, '+', 'LIMIT', 0, 1)
    if #r == 0 then break end
    local c = qparse(r[1])
    producers[c.p] = {p = c.p, prefix = producer_prefix(c.p), queued = c, skip = 0}
    lower = '(' .. producers[c.p].prefix .. ':'
  end
  for p in pairs(again_of) do
    producers[p] = producers[p] or {p = p, prefix = producer_prefix(p), skip = 0}
  end
  for p, s in pairs(producers) do
    s.again, s.next_again = again_of[p] or {}, 1
    table.sort(s.again, function(x, y) return x.order < y.order end)
    local c = head(s)
    if c then push({key = c.minv, c = c, s = s}) end
  end
  local picked = {}  -- chosen first, claimed only if pace lets the learner have them
  while #picked < need and #heap > 0 do
    local top = pop()
    local s, c = top.s, top.c
    table.insert(picked, c)
    if c.again then s.next_again = s.next_again + 1
    else
      s.skip = s.skip + 1
      s.queued = queued_head(s)
    end
    local following = head(s)
    if following then
      push({key = math.max(top.key, following.minv), c = following, s = s})
    end
  end
  local held = false
  if redis.call('HGET', K_STATE, 'staleness_mode') == 'pace' then
    -- Each producer's order if it leaves no group alive to go stale; else the oldest by
    -- version, unless waiting for the groups in flight could save one (pace_holds; the ZMQ
    -- twin is BrokerState._pace_take). A queue that alone holds more old groups than the
    -- learner can train in time is served: waiting saves none (holding it was a hang).
    local in_flight = pace_in_flight()
    held = not pace_allows(learner_version,
                           pace_sum(pace_queued(learner_version, again_of, picked), in_flight))
    if held then
      local alternative = oldest_by_version(need, again_of)
      held = #alternative < need or pace_holds(learner_version,
        pace_queued(learner_version, again_of, alternative), in_flight)
      if not held then picked = alternative end
    end
    pace_clock(held)
  end
  local n_again = 0
  for _, c in ipairs(held and {} or picked) do
    local claimed
    if c.again then
      claimed = redis.call('XCLAIM', K_INDEX, GROUP, consumer, 0, c.id)
      n_again = n_again + #claimed
    else  -- QUEUE's delivery was not one: the count stays 1
      claimed = redis.call('XCLAIM', K_INDEX, GROUP, consumer, 0, c.id, 'RETRYCOUNT', 1)
      unqueue(c.m)
    end
    if claimed[1] then table.insert(entries, claimed[1]) end  -- else deleted behind our back
  end
  redis.call('HINCRBY', K_STATE, 'redelivered', n_again)
end
local tail = redis.call('XREVRANGE', K_INDEX, '+', '-', 'COUNT', 1)
local since = redis.call('HGET', K_STATE, 'pace_held_since')
local pace_ms = num(K_STATE, 'pace_held_ms') + (since and now_ms() - tonumber(since) or 0)
local stats = {redis.call('XLEN', K_INDEX), num(K_STATE, 'accepted'), in_flight_total(),
               num(K_STATE, 'consumed'), num(K_STATE, 'dropped_stale'),
               num(K_STATE, 'version'), run_status(), pace_ms}
return {lost, dropped, entries, tail[1] and tail[1][1] or '0-0', stats, acked}
"""

DISCARD = """
-- ARGV: kind ('stale' | 'reject'), reason, ids. Entries a consumer refuses after reading;
-- counted only if still there (another consumer may have settled them meanwhile).
local n = 0
for i = 7, #ARGV do n = n + remove(ARGV[i]) end
if ARGV[5] == 'stale' then redis.call('HINCRBY', K_STATE, 'dropped_stale', n)
elseif n > 0 then redis.call('HINCRBY', K_REJECTED, ARGV[6], n) end
return n
"""

RENEW = """
-- ARGV: the learner's prefix, then ids. Resets the idle time of the entries still owned by
-- a consumer named with that prefix, any client of the same learner process (one takes, the
-- other trains: RedisConsumer.name), keeping the owner (XCLAIM to it, min-idle 0, JUSTID:
-- delivery count unchanged); an entry another consumer reclaimed is left alone. Returns how
-- many are still owned.
local prefix, n = ARGV[5], 0
for i = 6, #ARGV do
  local p = redis.call('XPENDING', K_INDEX, GROUP, ARGV[i], ARGV[i], 1)
  if #p == 1 and string.sub(p[1][2], 1, #prefix) == prefix then
    redis.call('XCLAIM', K_INDEX, GROUP, p[1][2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

ACK = """
-- ARGV: (id, staleness) pairs. Counts only entries still pending, so a duplicate ack (or
-- one racing a reclaim) never counts a group twice.
return ack_entries(5)
"""
