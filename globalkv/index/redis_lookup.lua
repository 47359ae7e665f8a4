-- One lookup's walk on one Redis (or one cluster master): the segments of the chain it is
-- given (each of blocks in one hash slot, in chain order) are walked as one run of blocks,
-- and for each generation holding the first of them it reports how many of those blocks
-- it holds contiguously from there and under which tier masks. On one Redis that is the
-- whole chain; on a cluster the segments of one master, with other masters' segments
-- between them, and the caller joins the masters' runs (see redis_reads.py): a generation
-- counts on a later segment only while it held every block before it.
--
-- A generation's field holds a 48-bit hash of (generation, mask) with the mask in its low
-- 3 bits, and "#" the sum of the fields (see redis_scripts.fingerprints). So the walk
-- reads one small field per block, and between consecutive blocks walked:
-- - an equal "#" means the same holders in the same tiers: nothing to do;
-- - a "#" lower by exactly the value of one generation still running means that one
--   generation's run ended (confirmed with HEXISTS): drop it, read nothing else;
-- - anything else (a mask changed, several runs ended, other holders came or went):
--   read the hash and compare the generations still running.
-- The cost is O(blocks + other changes x holders): 64 pods whose runs end one by one cost
-- 64 small reads, not 64 reads of up to 64 fields; a master's segments cost one read of
-- the holders, not one each.
--
-- KEYS[1]: a key of the first segment (so a cluster routes the call to its master).
-- ARGV[1]: the name of the live-generations hash when it is on this Redis, else "".
-- ARGV[2..]: per segment, the name its keys start with (up to its hash tag, included) and
--       its keys as 16 hex digits each, first block first. Block i's key name is that
--       name .. (its 16 digits): see globalkv/index/redis_keys.py.
-- Returns {rows, live}: rows a flat {generation, n, mask_1, blocks_1, ..., mask_n,
-- blocks_n, ...}, one (mask, blocks) pair per run of equal masks (a mask may come back);
-- live the HGETALL of ARGV[1], read after the walk (absent when ARGV[1] is "").

local call, sub = redis.call, string.sub

-- "#" exactly, as hi * 1e8 + lo: a sum of many fields can pass 2^53, a double's limit.
local function limbs(s)
  local cut = #s - 8
  if cut <= 0 then
    return 0, tonumber(s)
  end
  return tonumber(sub(s, 1, cut)), tonumber(sub(s, cut + 1))
end

-- The segments (`parts`: {head, chain} each) walked as one run: their rows, as returned.
local function walk(parts)
  local n = 0
  for p = 1, #parts do
    n = n + #parts[p][2] / 16
  end
  local first = call('HGETALL', parts[1][1] .. sub(parts[1][2], 1, 16))
  local out = {}
  -- Parallel arrays over the generations whose run goes on; `by_value` finds one by
  -- the number its field holds.
  local gens, values, since, runs, by_value = {}, {}, {}, {}, {}
  local fingerprint = '0'
  for j = 1, #first, 2 do
    if first[j] == '#' then
      fingerprint = first[j + 1]
    else
      local k = #gens + 1
      gens[k], values[k], since[k] = first[j], first[j + 1], 1
      by_value[tonumber(first[j + 1])] = k
    end
  end
  if #gens == 0 then
    return out
  end

  -- A generation's run under one value ended before block `at` (the mask changed): kept
  -- in `runs`, which most generations never need.
  local function close(j, at)
    local r = runs[j]
    if not r then
      r = {}
      runs[j] = r
    end
    r[#r + 1] = tonumber(values[j]) % 8
    r[#r + 1] = at - since[j]
  end

  local function finish(j, at)
    local r = runs[j]
    out[#out + 1] = tonumber(gens[j])
    if r then
      out[#out + 1] = #r / 2 + 1
      for _, v in ipairs(r) do
        out[#out + 1] = v
      end
    else
      out[#out + 1] = 1
    end
    out[#out + 1] = tonumber(values[j]) % 8
    out[#out + 1] = at - since[j]
  end

  -- Generation j's run ended: move the last one into its place.
  local function forget(j)
    local last = #gens
    by_value[tonumber(values[j])] = nil
    if j ~= last then
      gens[j], values[j], since[j], runs[j] = gens[last], values[last], since[last], runs[last]
      by_value[tonumber(values[j])] = j
    end
    gens[last], values[last], since[last], runs[last] = nil, nil, nil, nil
  end

  -- Compare every running generation with block i's hash.
  local function reread(key, i)
    local now = {}
    local h = call('HGETALL', key)
    for j = 1, #h, 2 do
      now[h[j]] = h[j + 1]
    end
    for j = #gens, 1, -1 do
      local value = now[gens[j]]
      if not value then
        finish(j, i)
        forget(j)
      elseif value ~= values[j] then
        close(j, i)
        by_value[tonumber(values[j])] = nil
        values[j], since[j] = value, i
        by_value[tonumber(value)] = j
      end
    end
  end

  local hi, lo = limbs(fingerprint)
  local stop, i = n + 1, 1
  for p = 1, #parts do
    local head, chain = parts[p][1], parts[p][2]
    for b = (p == 1 and 2 or 1), #chain / 16 do
      i = i + 1
      local key = head .. sub(chain, 16 * b - 15, 16 * b)
      local f = call('HGET', key, '#')
      if not f then
        stop = i
        break
      end
      if f ~= fingerprint then
        local f_hi, f_lo = limbs(f)
        local j = by_value[(hi - f_hi) * 1e8 + (lo - f_lo)]
        if j and call('HEXISTS', key, gens[j]) == 0 then
          finish(j, i)
          forget(j)
        else
          reread(key, i)
        end
        fingerprint, hi, lo = f, f_hi, f_lo
        if #gens == 0 then
          stop = i
          break
        end
      end
    end
    if stop <= n then
      break
    end
  end
  for j = 1, #gens do
    finish(j, stop)
  end
  return out
end

local parts = {}
for a = 2, #ARGV, 2 do
  parts[#parts + 1] = {ARGV[a], ARGV[a + 1]}
end
local rows = walk(parts)
if ARGV[1] == '' then
  return {rows}
end
return {rows, call('HGETALL', ARGV[1])}
