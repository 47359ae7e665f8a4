-- One lookup: walk a chain's block keys (all in one hash slot) in order and report,
-- per generation holding the first block, how many blocks it holds contiguously and
-- under which tier masks. Stops where no generation continues.
--
-- Each block hash carries "#", a fingerprint of its (generation, mask) fields kept by
-- the writer. Adjacent blocks with equal fingerprints have the same holders in the same
-- tiers, so the walk reads one small field per block and the full hash only where the
-- holders change: the cost is O(blocks + changes x holders), not O(blocks x holders).
--
-- KEYS[1]: the chain's first block key (so a cluster routes the call to its slot).
-- ARGV[1]: the name every key of the chain starts with (up to its hash tag, included);
-- ARGV[2]: the chain's keys as 16 hex digits each, first block first. Block i's key name
--          is ARGV[1] .. (its 16 digits): see globalkv/index/redis_keys.py.
-- Returns: flat {generation, n, mask_1, blocks_1, ..., mask_n, blocks_n, ...}, one
-- (mask, blocks) pair per run of equal masks (a mask may come back).
-- Liveness of generations is checked by the caller (the live hash is in another slot).

local head, chain = ARGV[1], ARGV[2]
local n = #chain / 16

local first = redis.call('HGETALL', KEYS[1])
if #first == 0 then
  return {}
end

-- Parallel arrays over the generations whose run goes on.
local gens, masks, since, runs = {}, {}, {}, {}
local fingerprint = false
for j = 1, #first, 2 do
  if first[j] == '#' then
    fingerprint = first[j + 1]
  else
    gens[#gens + 1] = first[j]
    masks[#masks + 1] = first[j + 1]
    since[#since + 1] = 1
    runs[#runs + 1] = {}
  end
end
local out = {}

-- A generation's run under one mask ended before block `at`.
local function close(j, at)
  local r = runs[j]
  r[#r + 1] = tonumber(masks[j])
  r[#r + 1] = at - since[j]
end

local function finish(j, at)
  close(j, at)
  out[#out + 1] = tonumber(gens[j])
  out[#out + 1] = #runs[j] / 2
  for _, v in ipairs(runs[j]) do
    out[#out + 1] = v
  end
end

local function current(key)
  local now = {}
  local h = redis.call('HGETALL', key)
  for j = 1, #h, 2 do
    now[h[j]] = h[j + 1]
  end
  local values = {}
  for j = 1, #gens do
    values[j] = now[gens[j]]
  end
  return values
end

local stop = n + 1
for i = 2, n do
  local key = head .. string.sub(chain, 16 * i - 15, 16 * i)
  local f = redis.call('HGET', key, '#')
  if not f then
    stop = i
    break
  end
  if f ~= fingerprint then
    fingerprint = f
    local values = current(key)
    local kept = 0
    for j = 1, #gens do
      local mask = values[j]
      if mask then
        if mask ~= masks[j] then
          close(j, i)
          masks[j] = mask
          since[j] = i
        end
        kept = kept + 1
        gens[kept], masks[kept], since[kept], runs[kept] = gens[j], masks[j], since[j], runs[j]
      else
        finish(j, i)
      end
    end
    for j = #gens, kept + 1, -1 do
      gens[j], masks[j], since[j], runs[j] = nil, nil, nil, nil
    end
    if kept == 0 then
      stop = i
      break
    end
  end
end
for j = 1, #gens do
  finish(j, stop)
end
return out
