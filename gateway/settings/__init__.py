"""What the gateway, the endpoint picker and the sidecar are told: one typed configuration
(`config`, built of `workers`, `routing`, `edge` and `flow` settings), the flags it is read
from (`flags`: sglang-router's, and `peer_flags`: the peers' flags taken or refused, one
line each), and what `--check` says of it (`checks`)."""
