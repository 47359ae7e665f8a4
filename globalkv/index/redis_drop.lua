-- Drop a hidden generation's entries from some block keys (one chunk of its reverse
-- data). Safe to repeat: a key already dropped is skipped.
-- ARGV: generation, then the negated fingerprint contributions of masks 1..7, then
-- block key names.

local gen = ARGV[1]
local undo = {}
for mask = 1, 7 do
  undo[tostring(mask)] = ARGV[1 + mask]
end
for i = 9, #ARGV do
  local key = ARGV[i]
  local mask = redis.call('HGET', key, gen)
  if mask then
    redis.call('HDEL', key, gen)
    if redis.call('HLEN', key) <= 1 then
      redis.call('DEL', key)
    else
      redis.call('HINCRBY', key, '#', undo[mask])
    end
  end
end
return 'ok'
