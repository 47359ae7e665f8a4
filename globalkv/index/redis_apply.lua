-- Apply one source batch atomically: every write of the batch, or none.
-- Refuses to write, returning 'lost', when the dataset marker is not the writer's (Redis
-- restarted empty or was flushed), and 'stale' when the source's generation or batch
-- count is not what the writer holds (Redis lost recent writes, or two writers).
--
-- ARGV (built by RedisIndex._apply_args; names from globalkv/index/redis_keys.py):
--   1-5   marker key, the writer's marker token, sources hash, live hash, dead set
--   6     source name
--   7     generation the writer holds: a number, '' (none yet) or '*' (a reset: any)
--   8     batches the writer applied to it ('' = do not check)
--   9     generation to switch to ('' = keep; the old one is retired: hidden, then dropped)
--   10    info key of the generation held; 11, 12: info and blocks keys written
--   then  n, n x (block key, new tier mask or 0, fingerprint delta)
--   then  n, n x (engine hash, packed engine block) to store
--   then  n, n x engine hash to delete
--   then  the info hash's field/value pairs

local marker_key, token, sources_key, live_key, dead_key = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local name, gen, version, target = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local old_info_key, info_key, blocks_key = ARGV[10], ARGV[11], ARGV[12]

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

local i = 13
local n = tonumber(ARGV[i])
i = i + 1
for _ = 1, n do
  local key, mask, delta = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if mask == '0' then
    redis.call('HDEL', key, gen)
    if redis.call('HLEN', key) <= 1 then
      redis.call('DEL', key)
    else
      redis.call('HINCRBY', key, '#', delta)
    end
  else
    redis.call('HSET', key, gen, mask)
    redis.call('HINCRBY', key, '#', delta)
  end
end

local unpack = unpack or table.unpack
local CHUNK = 1000
n = tonumber(ARGV[i])
i = i + 1
local stop = i + 2 * n
while i < stop do
  local last = math.min(i + 2 * CHUNK, stop) - 1
  redis.call('HSET', blocks_key, unpack(ARGV, i, last))
  i = last + 1
end

n = tonumber(ARGV[i])
i = i + 1
stop = i + n
while i < stop do
  local last = math.min(i + CHUNK, stop) - 1
  redis.call('HDEL', blocks_key, unpack(ARGV, i, last))
  i = last + 1
end

redis.call('HSET', info_key, 'v', batches + 1, unpack(ARGV, i, #ARGV))
return 'ok'
