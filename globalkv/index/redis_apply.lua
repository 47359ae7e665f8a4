-- Apply one source batch: on one Redis atomically, every write of the batch or none; on a
-- cluster as one call per master holding its block keys, then this call with the checks.
-- Refuses to write, returning 'lost', when the dataset marker is not the writer's (Redis
-- restarted empty or was flushed), 'stale' when the source's generation or batch
-- count is not what the writer holds (Redis lost recent writes, or two writers), and
-- 'fenced' when the writer's fencing token is not the pod's current one (its lease was
-- taken over: ingest/leases.py).
-- Block writes are idempotent (a field already holding its value is skipped, "#" moves by
-- the field's change), so a block call repeated after a lost reply changes nothing.
--
-- ARGV (built by redis_batch.apply_args; names from globalkv/index/redis_keys.py):
--   1     'blocks' (only the block writes below, for one cluster master) or 'batch'
--   for 'blocks': 2 generation, 3 n, 4 the n block keys joined by newlines, 5 their new
--         field values (0 = no longer held) joined by commas, 6 the writer's checkpoint
--         counter on this call's slot, 7 its time to live, 8 this master's copy of the
--         pod's fence ('' = not fenced: redis_fences.py), 9 the writer's token; returns
--         the counter's new value, or without writing 'fenced:<the copy's counter>'
--         (it is above the token's: a newer lease) or 'recopy' (the copy is missing, older or
--         a barrier: the writer checks its lease and copies its token again)
--   for 'batch':
--   2-6   marker key, the writer's marker token, sources hash, live hash, dead set
--   7     source name
--   8     generation the writer holds: a number, '' (none yet) or '*' (a reset: any)
--   9     batches the writer applied to it ('' = do not check)
--   10    generation to switch to ('' = keep; the old one is retired: hidden, then dropped)
--   11    info key of the generation held; 12, 13: info and log keys written
--   14, 15  the pod's fence key ('' = not fenced) and the writer's token
--   then  n, the n block keys, their values as for 'blocks' (n = 0 on a cluster)
--   then  '1' when the log entries below replace the log (a snapshot), else '0'
--   then  n, n x log entry to append (binary records of engine blocks stored or deleted)
--   then  the info hash's field/value pairs

local call, find, sub, format = redis.call, string.find, string.sub, string.format

-- Field values are below 2^48, so their difference is exact in a double; '%d' writes it
-- in full (tostring would round it to 14 digits).
local function write_blocks(gen, n, names, values)
  local at_name, at_value = 1, 1
  for _ = 1, n do
    local stop = find(names, '\n', at_name, true) or #names + 1
    local key = sub(names, at_name, stop - 1)
    at_name = stop + 1
    stop = find(values, ',', at_value, true) or #values + 1
    local value = sub(values, at_value, stop - 1)
    at_value = stop + 1
    local current = call('HGET', key, gen)
    if value == '0' then
      if current then
        call('HDEL', key, gen)
        if call('HLEN', key) <= 1 then
          call('DEL', key)
        else
          call('HINCRBY', key, '#', '-' .. current)
        end
      end
    elseif current ~= value then
      call('HSET', key, gen, value)
      call('HINCRBY', key, '#', format('%d', tonumber(value) - tonumber(current or '0')))
    end
  end
end

-- A fencing token's counter: the digits before its ':'.
local function counter(token)
  return tonumber(sub(token, 1, (find(token, ':', 1, true) or 1) - 1)) or 0
end

if ARGV[1] == 'blocks' then
  if ARGV[8] ~= '' then
    local copy = call('GET', ARGV[8])
    if copy ~= ARGV[9] then
      if copy and counter(copy) > counter(ARGV[9]) then
        return format('fenced:%d', counter(copy))
      end
      return 'recopy'
    end
  end
  write_blocks(ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5])
  local count = call('INCR', ARGV[6])
  call('EXPIRE', ARGV[6], ARGV[7])
  return count
end

local marker_key, token, sources_key, live_key, dead_key = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local name, gen, version, target = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local old_info_key, info_key, log_key = ARGV[11], ARGV[12], ARGV[13]

if redis.call('GET', marker_key) ~= token then
  return 'lost'
end
if ARGV[14] ~= '' and redis.call('HGET', ARGV[14], 'token') ~= ARGV[15] then
  return 'fenced'
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

local i = 16
write_blocks(gen, tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2])
i = i + 3

local unpack = unpack or table.unpack
if ARGV[i] == '1' then
  call('DEL', log_key)  -- the entries below are a snapshot of the whole state
end
local n = tonumber(ARGV[i + 1])
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
