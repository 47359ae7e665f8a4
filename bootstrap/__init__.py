"""Per-Prefill-instance KV producer directory, SGLang-compatible, and its clients."""
