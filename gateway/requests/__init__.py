"""What a request is, read the same by every entry point: its body validated just enough to
route (`bodies`: the prompt, its tokens, a batch), the KV-cache namespace it lands in
(`namespace`: model, LoRA adapter, cache salt), what choosing reads of it (`query`) and the
request as it is served, from the reader to the legs (`request`)."""
