"""From engines' KV-event sockets to the index, in seq order per source.

`service.IngestService` (configured by `config.IngestConfig`) assembles the parts:
`followed` holds the pods followed and one `worker.SourceWorker` per (pod, DP rank),
`following` adds and removes pods and starts their sources, `subscribers` feed the workers
from a SUB connected to each engine, `bound` from one bound SUB (with `discovery` for pods
that appear there); every batch crosses `border` once, into `Received`; `sequencer` decides
what a seq means (next, gap, first sight, engine restart), `replay` fetches missing
batches, `writes` carries a worker's writes through the index's failures, `recovery`
rebuilds what the index lost, and `podsync` follows the pod registry
others write to. `leases` and `ownership` share the pods among indexer replicas.
"""
