"""Routing quality on request traces: `globalkv bench replay`.

A Mooncake-format trace is replayed against the gateway's own routing policies, either in
a discrete-event simulation of prefill and decode pods (whose caches are the emulated
engine's `PagedKVCache`, feeding the real `MemoryIndex` through the real event
translation), or through a live stack of processes. Nothing outside `bench/` imports it.
"""
