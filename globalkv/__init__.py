"""The cluster-wide KV index: event wire format, block keys, index backends, ingest, API."""
