-- A master's copies of a pod's fencing token (redis_fences.py).
-- KEYS: one copy key. ARGV: the token, its TTL s, then the other copy keys of this master
-- (any slot: the client routes by KEYS[1] alone). Writes each copy the token outranks.
local function counter(token)
  return tonumber(string.sub(token, 1, (string.find(token, ':', 1, true) or 1) - 1)) or 0
end
local new, token = counter(ARGV[1]), ARGV[1]
local barrier = string.sub(token, -1) == ':'
local function put(key)
  local copy = redis.call('GET', key)
  if copy then
    local at = counter(copy)
    if at > new or (at == new and barrier and copy ~= token) then
      return
    end
  end
  redis.call('SET', key, token, 'EX', ARGV[2])
end
put(KEYS[1])
for i = 3, #ARGV do
  put(ARGV[i])
end
return 1
