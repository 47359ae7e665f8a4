-- Apply one source batch atomically: every write of the batch, or none.
-- Refuses to write, returning 'lost', when the dataset marker is not the writer's (Redis
-- restarted empty or was flushed), and 'stale' when the source's generation or batch
-- count is not what the writer holds (Redis lost recent writes, or two writers).
--
-- ARGV (built by redis_batch.apply_args; names from globalkv/index/redis_keys.py):
--   1-5   marker key, the writer's marker token, sources hash, live hash, dead set
--   6     source name
--   7     generation the writer holds: a number, '' (none yet) or '*' (a reset: any)
--   8     batches the writer applied to it ('' = do not check)
--   9     generation to switch to ('' = keep; the old one is retired: hidden, then dropped)
--   10    info key of the generation held; 11, 12: info and log keys written
--   then  n, then the n block keys joined by newlines, their new field values (0 = no
--         longer held) and their fingerprint deltas, both joined by commas
--   then  '1' when the log entries below replace the log (a snapshot), else '0'
--   then  n, n x log entry to append (binary records of engine blocks stored or deleted)
--   then  the info hash's field/value pairs

local marker_key, token, sources_key, live_key, dead_key = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local name, gen, version, target = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local old_info_key, info_key, log_key = ARGV[10], ARGV[11], ARGV[12]

if redis.call('GET', marker_key) ~= token then
  return 'lost'
end
local current = redis.call('HGET', sources_key, name)
if gen == '*' then
  gen = current or ''  -- a reset retires whatever generation the source has
elseif gen == '' then
  if current then
    return 'stale'
  end
elseif current ~= gen or redis.call('HGET', old_info_key, 'v') ~= version then
  return 'stale'
end

local batches = tonumber(version)
if target ~= '' then
  redis.call('HSET', sources_key, name, target)
  if gen ~= '' then
    redis.call('HDEL', live_key, gen)
    redis.call('SADD', dead_key, gen)
  end
  redis.call('HSET', live_key, target, name)
  gen = target
  batches = 0
end

local call, find, sub = redis.call, string.find, string.sub
local i = 13
local n = tonumber(ARGV[i])
local names, values, deltas = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
i = i + 4
local at_name, at_value, at_delta = 1, 1, 1
for _ = 1, n do
  local stop = find(names, '\n', at_name, true) or #names + 1
  local key = sub(names, at_name, stop - 1)
  at_name = stop + 1
  stop = find(values, ',', at_value, true) or #values + 1
  local value = sub(values, at_value, stop - 1)
  at_value = stop + 1
  stop = find(deltas, ',', at_delta, true) or #deltas + 1
  local delta = sub(deltas, at_delta, stop - 1)
  at_delta = stop + 1
  if value == '0' then
    call('HDEL', key, gen)
    if call('HLEN', key) <= 1 then
      call('DEL', key)
    else
      call('HINCRBY', key, '#', delta)
    end
  else
    call('HSET', key, gen, value)
    call('HINCRBY', key, '#', delta)
  end
end

local unpack = unpack or table.unpack
if ARGV[i] == '1' then
  call('DEL', log_key)  -- the entries below are a snapshot of the whole state
end
n = tonumber(ARGV[i + 1])
i = i + 2
local CHUNK = 1000
local stop = i + n
while i < stop do
  local last = math.min(i + CHUNK, stop) - 1
  call('RPUSH', log_key, unpack(ARGV, i, last))
  i = last + 1
end

call('HSET', info_key, 'v', batches + 1, unpack(ARGV, i, #ARGV))
return 'ok'
