-- A removed pod's sources retired (redis_log.retire_pod).
-- KEYS: sources, live, dead. ARGV: a pod. Retires the generation each of the pod's sources
-- has now (read here, so a writer's generation switch cannot slip in between); returns the
-- source names.
local retired = {}
local names = redis.call('HGETALL', KEYS[1])
for i = 1, #names, 2 do
  local name, gen = names[i], names[i + 1]
  if string.sub(name, 1, #ARGV[1] + 1) == ARGV[1] .. '@' and
     string.match(string.sub(name, #ARGV[1] + 2), '^%d+$') then
    redis.call('HDEL', KEYS[1], name)
    redis.call('HDEL', KEYS[2], gen)
    redis.call('SADD', KEYS[3], gen)
    retired[#retired + 1] = name
  end
end
return retired
