"""KV-cache events as vLLM and SGLang put them on the wire (`docs/protocols.md` §4).

One package per protocol, data first, one module per role: `events` (the types every
shape decodes into, and the one error), `decode` (every batch and event shape the peers
have shipped), `encode` (what the engine emulator publishes), `frames` (the ZMQ frame
layouts: live `[topic, seq, payload]` and both replay layouts). The indexer reads with
decode + frames, the emulator writes with encode + frames; both import from here.

Hashes leave decoding as `EngineHash` (unsigned 64-bit): signed ints are masked, the
32-byte digests of `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` keep their last 8 bytes, which
equals vLLM's own int export. Every malformed input raises `WireError`, whose `reason` is
a short fixed word fit for a metric label; ingest counts and drops.
"""

from globalkv.wire.decode import decode_batch
from globalkv.wire.encode import FLAVORS, Flavor, encode_batch
from globalkv.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    WireError,
)
from globalkv.wire.frames import (
    END_SEQ,
    Frame,
    ReplayLayout,
    live_frames,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end,
    replay_reply,
    replay_request,
)

__all__ = [
    "END_SEQ",
    "FLAVORS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "Flavor",
    "Frame",
    "ReplayLayout",
    "WireError",
    "decode_batch",
    "encode_batch",
    "live_frames",
    "pack_seq",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end",
    "replay_reply",
    "replay_request",
]
