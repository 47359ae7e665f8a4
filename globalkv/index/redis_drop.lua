-- Drop a hidden generation's entries from some block keys (one chunk of its reverse
-- data). Safe to repeat: a key already dropped is skipped.
-- ARGV: generation, then block key names.
-- A field's value is its share of the key's "#" (see redis_scripts.fingerprints), so
-- taking it out takes its value off "#"; it is passed on as the string it was read as
-- (a Lua number would be formatted with too few digits).

local gen = ARGV[1]
for i = 2, #ARGV do
  local key = ARGV[i]
  local value = redis.call('HGET', key, gen)
  if value then
    redis.call('HDEL', key, gen)
    if redis.call('HLEN', key) <= 1 then
      redis.call('DEL', key)
    else
      redis.call('HINCRBY', key, '#', '-' .. value)
    end
  end
end
return 'ok'
