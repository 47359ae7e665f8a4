"""Token ids for a trace request: each block id becomes `block_size` pseudo-random tokens.

Token `j` of block `b` is `splitmix64(b * block_size + j) mod vocab`, so equal ids give
equal tokens in every process and every run, distinct ids give unrelated tokens, and the
trace's prefix sharing survives exactly into the keys the index and the engines compute.
The last block is cut to the request's input length.

The default vocabulary is 256 ("byte tokens"): the emulated engines' built-in byte
tokenizer accepts exactly these ids, and CPython shares the int objects 0-255, so the
simulator's caches and cache_aware's radix tree hold 8 bytes per token instead of 36
(the whole Mooncake trace is 145 M prompt tokens). With 256 symbols two different
512-token blocks still collide with probability 2^-4096; the one visible effect is that a
radix tree matching token by token may run a token or two into a diverging block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from bench.replay.config import DEFAULT_VOCAB

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = x * _GAMMA + _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def expand(
    hash_ids: Sequence[int], input_length: int, block_size: int, vocab: int = DEFAULT_VOCAB
) -> list[int]:
    """The request's `input_length` token ids."""
    if vocab < 2 or vocab > 2**32:
        raise ValueError("vocab must be in [2, 2^32]")
    if len(hash_ids) * block_size < input_length:
        raise ValueError(f"{len(hash_ids)} blocks of {block_size} cannot hold {input_length}")
    ids = np.asarray(hash_ids, dtype=np.uint64)
    positions = np.arange(block_size, dtype=np.uint64)
    seeds = ids[:, None] * np.uint64(block_size) + positions[None, :]
    tokens = _splitmix64(seeds.ravel()[:input_length]) % np.uint64(vocab)
    out: list[int] = tokens.tolist()
    return out
