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
-- batch's ack). All or nothing: claims/reads only when `need` fresh groups can be had right
-- now, so consumers never strand partial batches. Works on the index alone: entries are a
-- few bytes, the client reads the payloads they name afterwards (MGET), outside Lua.
-- Returns {lost held ids, dropped, entries, tail id, stats, acked}.
local consumer, need = ARGV[5], tonumber(ARGV[6])
local learner_version, reclaim_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local n_held = tonumber(ARGV[9])
ensure_group()
local acked = ack_entries(10 + n_held)
local function stale(minv) return minv >= 0 and learner_version - minv > S end
local function index_minv(id)
  local e = redis.call('XRANGE', K_INDEX, id, id)
  if #e == 0 then return -1 end
  return tonumber(e[1][2][2]) or -1
end

local lost = {}
for i = 10, 9 + n_held do  -- held ids stay ours only if nobody reclaimed them; keep them fresh
  local p = redis.call('XPENDING', K_INDEX, GROUP, ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= consumer then table.insert(lost, ARGV[i])
  else redis.call('XCLAIM', K_INDEX, GROUP, consumer, 0, ARGV[i], 'JUSTID') end
end

local dropped, claim, start = 0, {}, '-'
while #claim < need do  -- pending on other consumers for too long: theirs is presumed dead
  local page = redis.call('XPENDING', K_INDEX, GROUP, 'IDLE', reclaim_ms, start, '+', need)
  if #page == 0 then break end
  for _, e in ipairs(page) do
    if e[2] ~= consumer and #claim < need then
      if stale(index_minv(e[1])) then dropped = dropped + remove(e[1])
      else table.insert(claim, e[1]) end
    end
  end
  start = '(' .. page[#page][1]
end

local ldi = '0-0'
for _, g in ipairs(redis.call('XINFO', 'GROUPS', K_INDEX)) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == GROUP then ldi = f['last-delivered-id'] end
end
local unread, cursor = 0, '(' .. ldi
while #claim + unread < need do
  local page = redis.call('XRANGE', K_INDEX, cursor, '+', 'COUNT', need - #claim - unread)
  if #page == 0 then break end
  for _, e in ipairs(page) do
    if stale(tonumber(e[2][2]) or -1) then dropped = dropped + remove(e[1])
    else unread = unread + 1 end
  end
  cursor = '(' .. page[#page][1]
end
redis.call('HINCRBY', K_STATE, 'dropped_stale', dropped)

local entries = {}
if #claim + unread >= need then
  for i = 1, #claim, 500 do
    local ids = {unpack(claim, i, math.min(i + 499, #claim))}
    for _, e in ipairs(redis.call('XCLAIM', K_INDEX, GROUP, consumer, reclaim_ms,
                                  unpack(ids))) do table.insert(entries, e) end
  end
  redis.call('HINCRBY', K_STATE, 'redelivered', #entries)
  if unread > 0 then
    local r = redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', unread,
                         'STREAMS', K_INDEX, '>')
    if r then for _, e in ipairs(r[1][2]) do table.insert(entries, e) end end
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
