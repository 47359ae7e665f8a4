"""`kv@<pod>@<model>`: llm-d's ZMQ topic for KV events, which names the pod and its model.

An engine publishes under it, the indexer's bound SUB recognises the pod by it, and the
gateway takes a prefill's pod id from it; all three read and write it here.
"""

from __future__ import annotations


def kv_topic(pod: str, model: str) -> str:
    """The topic an engine of `pod` serving `model` publishes its KV events under."""
    return f"kv@{pod}@{model}"


def parse_topic(topic: str) -> tuple[str, str] | None:
    """`kv@<pod>@<model>` → (pod, model); None for topics of another shape.

    The model is everything after the second `@`, so a model name may hold `@` itself.
    """
    parts = topic.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv" or not parts[1]:
        return None
    return parts[1], parts[2]
