"""Prompts of an exact token length, as the engines tokenize them (the gateway's own
tokenizer on the same directory: the tests check that vLLM agrees)."""

from __future__ import annotations

import random

from globalkv.tokenize import Tokenizer
from tests.real_engines.model import WORDS


class Prompts:
    def __init__(self, tokenizer: Tokenizer, seed: int = 1) -> None:
        self.tokenizer = tokenizer
        self._rng = random.Random(seed)

    def tokens(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def new(self, length: int) -> str:
        """A fresh prompt of `length` tokens (its BOS included), its first words random
        enough that no two share a block."""
        for _ in range(100):
            words: list[str] = []
            while len(self.tokens(" ".join(words))) < length:
                words.append(self._rng.choice(WORDS))
            prompt = " ".join(words)
            if len(self.tokens(prompt)) == length:
                return prompt
        raise AssertionError(f"no prompt of {length} tokens in 100 tries")
