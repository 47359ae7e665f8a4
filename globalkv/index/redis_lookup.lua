-- One lookup: walk a chain's block keys (all in one hash slot) in order and report,
-- per generation holding the first block, how many blocks it holds contiguously and
-- under which tier masks. Stops where no generation continues.
--
-- Each block hash carries "#", a fingerprint of its (generation, mask) fields kept by
-- the writer. Adjacent blocks with equal fingerprints have the same holders in the same
-- tiers, so the walk reads one small field per block and the full hash only where the
-- holders change: the cost is O(blocks + changes x holders), not O(blocks x holders).
--
-- KEYS: the chain's block keys, first block first.
-- Returns: flat {generation, n, mask_1, blocks_1, ..., mask_n, blocks_n, ...}.
-- Liveness of generations is checked by the caller (the live hash is in another slot).

local first = redis.call('HGETALL', KEYS[1])
if #first == 0 then
  return {}
end

local masks = {}   -- generation -> its mask at the current block, while contiguous
local counts = {}  -- generation -> {mask -> blocks}
local holders = 0
local fingerprint = false
for j = 1, #first, 2 do
  local field = first[j]
  if field == '#' then
    fingerprint = first[j + 1]
  else
    masks[field] = tonumber(first[j + 1])
    counts[field] = {}
    holders = holders + 1
  end
end

local run = 1  -- blocks walked since the masks last changed
local function flush()
  for gen, mask in pairs(masks) do
    local c = counts[gen]
    c[mask] = (c[mask] or 0) + run
  end
  run = 0
end

for i = 2, #KEYS do
  local f = redis.call('HGET', KEYS[i], '#')
  if not f then
    break
  end
  if f ~= fingerprint then
    flush()
    local now = {}
    local h = redis.call('HGETALL', KEYS[i])
    for j = 1, #h, 2 do
      now[h[j]] = h[j + 1]
    end
    for gen in pairs(masks) do
      local mask = now[gen]
      if mask then
        masks[gen] = tonumber(mask)
      else
        masks[gen] = nil
        holders = holders - 1
      end
    end
    if holders == 0 then
      break
    end
    fingerprint = f
  end
  run = run + 1
end
flush()

local out = {}
for gen, c in pairs(counts) do
  local pairs_out = {}
  for mask, blocks in pairs(c) do
    pairs_out[#pairs_out + 1] = mask
    pairs_out[#pairs_out + 1] = blocks
  end
  out[#out + 1] = tonumber(gen)
  out[#out + 1] = #pairs_out / 2
  for _, v in ipairs(pairs_out) do
    out[#out + 1] = v
  end
end
return out
