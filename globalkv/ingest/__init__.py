"""From engines' KV-event sockets to the index, in seq order per source.

`service.IngestService` (configured by `config.IngestConfig`) follows pods (`followed`:
by id and bound topic, with their honest state) and owns one `worker.SourceWorker` per
(pod, DP rank); subscribers (`subscribers`) feed them from a SUB connected to each engine
or from one bound SUB; `sequencer` decides what a seq means (next, gap, first sight,
engine restart), `replay` fetches missing batches, and `podsync` follows the pod registry
others write to.
"""
