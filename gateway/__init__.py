"""The PD gateway: choose a prefill/decode pair, inject bootstrap fields, dual-dispatch."""
