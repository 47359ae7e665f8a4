-- A lease granted below the masters' fence copies, released (redis_fences.py).
-- KEYS: the lease, its fence hash. ARGV: the writer's token, the copies' counter. While the
-- lease is the writer's: the counter raised to the copies', the lease released (1).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if tonumber(ARGV[2]) > tonumber(redis.call('HGET', KEYS[2], 'n') or '0') then
  redis.call('HSET', KEYS[2], 'n', ARGV[2])
end
redis.call('DEL', KEYS[1])
return 1
