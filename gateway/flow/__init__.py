"""Flow control: per-tenant queues in priority bands, released on headroom
(docs/flow-control.md)."""
