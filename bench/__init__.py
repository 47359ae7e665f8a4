"""Benchmarks and the trace-replay evaluation of routing policies."""
