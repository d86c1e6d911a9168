"""Lua of the Redis buffer's data plane: the gate, puts, takes, drops and acks.

Payloads never pass through Lua: a producer stages each group's packed bytes under its own
key with a plain ``SET`` and the put script only files the key in the index; a take claims
index entries and the consumer reads the payloads they name with a plain ``MGET``. (When the
scripts carried the payloads, every byte was copied into a Lua string and back: ``EVALSHA``
of a put took 4x a plain ``XADD`` of the same bytes.)

Each body runs after :data:`buffers.redis_scripts.PRELUDE` (key names ``K_*``, the gate
parameters, and helpers such as ``touch``, ``reap``, ``gate_update`` and ``remove``); see
:mod:`buffers.redis_scripts` for the key layout. Kept as plain strings so that Redis, not
Python, is where each rule runs atomically.
"""

from __future__ import annotations

ACQUIRE = """
local producer, want, engine_version = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
touch(producer, now)
reap(now)
local version, granted = num(K_STATE, 'version'), 0
if run_status() == 'running' and version - engine_version <= S then
  local room = MAX_GROUPS - redis.call('XLEN', K_INDEX) - in_flight_total()
  granted = math.max(0, math.min(want, allowance(), room))
  if granted > 0 then add_in_flight(producer, granted) end
end
gate_update(now)
return {granted, version, run_status()}
"""

RELEASE = """
local now = now_ms()
touch(ARGV[5], now)
add_in_flight(ARGV[5], -tonumber(ARGV[6]))
gate_update(now)
return 1
"""

PUT_MANY = """
-- KEYS[13..]: the payload keys the client staged (SET ... PX) in the same pipeline.
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
    table.insert(results, {0, reason})
  else
    redis.call('PERSIST', key)
    local id = redis.call('XADD', K_INDEX, '*', 'minv', minv, 'p', producer, 'k', key)
    redis.call('HINCRBY', K_STATE, 'accepted', 1)
    add_in_flight(producer, -1)
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
-- QUEUE's entries and those idle on another consumer for reclaim_idle_ms (presumed dead);
-- stale ones are dropped, and the `need` with the earliest deadline are claimed, in that
-- order: oldest version first, then arrival, each producer's groups in their order (a
-- group's key is the newest version among its producer's candidates up to it), exactly as
-- the ZMQ broker serves. Returns {lost held ids, dropped, entries, tail id, stats, acked}.
local consumer, need = ARGV[5], tonumber(ARGV[6])
local learner_version, reclaim_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local n_held = tonumber(ARGV[9])
ensure_group()
local acked = ack_entries(10 + n_held)
local function stale(minv) return minv >= 0 and learner_version - minv > S end

local lost = {}
for i = 10, 9 + n_held do  -- held ids stay ours only if nobody reclaimed them; keep them fresh
  local p = redis.call('XPENDING', K_INDEX, GROUP, ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= consumer then table.insert(lost, ARGV[i])
  else redis.call('XCLAIM', K_INDEX, GROUP, consumer, 0, ARGV[i], 'JUSTID') end
end

redis.call('XREADGROUP', 'GROUP', GROUP, QUEUE, 'STREAMS', K_INDEX, '>')
-- Every entry now waits in QUEUE's pending list or is delivered to a learner (a few batches
-- each): read the learners' lists, and take the rest of the index to be QUEUE's when the
-- counts agree (an entry acked elsewhere but not deleted is in no list; then ask QUEUE's).
local delivered, reclaimable, n_queued, n_delivered = {}, {}, 0, 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', K_INDEX, GROUP)) do
  local f = {}
  for i = 1, #c - 1, 2 do f[c[i]] = c[i + 1] end
  if f['name'] == QUEUE then n_queued = f['pending']
  elseif f['pending'] > 0 then
    for _, p in ipairs(redis.call('XPENDING', K_INDEX, GROUP, '-', '+', f['pending'],
                                  f['name'])) do
      delivered[p[1]], n_delivered = true, n_delivered + 1
      if f['name'] ~= consumer and p[3] >= reclaim_ms then reclaimable[p[1]] = true end
    end
  end
end
local queued = nil  -- nil: every entry not delivered is QUEUE's
if n_queued + n_delivered ~= redis.call('XLEN', K_INDEX) then
  queued = {}
  if n_queued > 0 then
    for _, p in ipairs(redis.call('XPENDING', K_INDEX, GROUP, '-', '+', n_queued, QUEUE)) do
      queued[p[1]] = true
    end
  end
end

-- One pass in arrival order: drop the stale candidates, key the fresh ones (the newest
-- version among their producer's fresh candidates so far) and keep the `need` best.
local function better(a, b)
  if a.key ~= b.key then return a.key < b.key end
  return a.place < b.place
end
local dropped, n_fresh, newest, best = 0, 0, {}, {}
if n_queued > 0 or next(reclaimable) then
  for _, e in ipairs(redis.call('XRANGE', K_INDEX, '-', '+')) do
    local id, f = e[1], e[2]
    if reclaimable[id] or not (delivered[id] or (queued and not queued[id])) then
      local minv, p = nil, nil
      if f[1] == 'minv' and f[3] == 'p' then minv, p = f[2], f[4]  -- as the put script writes
      else
        for i = 1, #f - 1, 2 do
          if f[i] == 'minv' then minv = f[i + 1] elseif f[i] == 'p' then p = f[i + 1] end
        end
      end
      minv, p = tonumber(minv or '') or -1, p or ''
      if stale(minv) then dropped = dropped + remove(id)
      else
        n_fresh = n_fresh + 1
        local key = newest[p]
        if key == nil or minv > key then key = minv end
        newest[p] = key
        local c = {id = id, key = key, place = n_fresh}
        if need > 0 and (#best < need or better(c, best[#best])) then
          local i = #best + 1
          while i > 1 and better(c, best[i - 1]) do best[i] = best[i - 1]; i = i - 1 end
          best[i] = c
          if #best > need then best[#best] = nil end
        end
      end
    end
  end
end
redis.call('HINCRBY', K_STATE, 'dropped_stale', dropped)

local entries = {}
if n_fresh >= need and need > 0 then
  local first, again = {}, {}  -- from QUEUE (a first delivery) / from a presumed-dead consumer
  for i = 1, need do
    if reclaimable[best[i].id] then table.insert(again, best[i].id)
    else table.insert(first, best[i].id) end
  end
  local claimed = {}
  local function claim(ids, options)
    for i = 1, #ids, 500 do
      local call = {'XCLAIM', K_INDEX, GROUP, consumer, 0}
      for j = i, math.min(i + 499, #ids) do table.insert(call, ids[j]) end
      for _, o in ipairs(options) do table.insert(call, o) end
      for _, e in ipairs(redis.call(unpack(call))) do claimed[e[1]] = e end
    end
  end
  claim(first, {'RETRYCOUNT', '1'})  -- QUEUE's delivery was not one: the count stays 1
  claim(again, {})
  redis.call('HINCRBY', K_STATE, 'redelivered', #again)
  for i = 1, need do
    if claimed[best[i].id] then table.insert(entries, claimed[best[i].id]) end
  end
end
local tail = redis.call('XREVRANGE', K_INDEX, '+', '-', 'COUNT', 1)
local stats = {redis.call('XLEN', K_INDEX), num(K_STATE, 'accepted'), in_flight_total(),
               num(K_STATE, 'consumed'), num(K_STATE, 'dropped_stale'),
               num(K_STATE, 'version'), run_status()}
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
-- ARGV: consumer, then ids. Resets the idle time of the entries this consumer still owns
-- (XCLAIM to itself, min-idle 0, JUSTID: delivery count unchanged); an entry another
-- consumer reclaimed is left alone. Returns how many are still owned.
local consumer, n = ARGV[5], 0
for i = 6, #ARGV do
  local p = redis.call('XPENDING', K_INDEX, GROUP, ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == consumer then
    redis.call('XCLAIM', K_INDEX, GROUP, consumer, 0, ARGV[i], 'JUSTID')
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
