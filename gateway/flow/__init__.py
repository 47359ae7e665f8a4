"""What holds a request back before it is sent: sglang-router's FIFO admission (`admission`:
an exact concurrency limit, a rate) or, with `--flow-control`, per-tenant queues in
priority bands released on the prefills' headroom (docs/flow-control.md)."""
