"""What the emulated model "generates": a fixed text, cycled, in the configured tokenizer.

Output only has to be well formed and deterministic: real ids of the tokenizer that decode
to readable text, never the EOS id, the same for the prefill (its first token) and the
decode (the rest), so a disaggregated answer equals a colocated one.
"""

from __future__ import annotations

from itertools import cycle, islice

from globalkv.tokenize import Tokenizer

_TEXT = (
    " The quick brown fox jumps over the lazy dog while the prefill computes and the"
    " decode streams tokens one by one."
)


class ReplyWriter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        ids = [
            token
            for token in tokenizer.encode(_TEXT)
            if token != tokenizer.eos_token_id and tokenizer.decode([token])
        ]
        if not ids:
            raise ValueError(f"tokenizer {tokenizer.name!r} encodes no visible reply text")
        self._ids = ids
        self._tokenizer = tokenizer

    def tokens(self, count: int) -> list[int]:
        return list(islice(cycle(self._ids), count))

    def text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)
