"""What a request is, read the same by every entry point: its body validated just enough to
route (`bodies`: the prompt, its tokens, a batch) and the KV-cache namespace it lands in
(`namespace`: model, LoRA adapter, cache salt)."""
