"""Gateway replicas: each prefill's load and the pending prompts shared through Redis."""
