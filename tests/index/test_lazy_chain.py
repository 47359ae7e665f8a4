"""Key chains hashed as they are read: the same keys, and no key past the last held block."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from globalkv import keys as keys_module
from globalkv.index.base import Index
from globalkv.keys import KeyChain, chain_keys, request_chain, request_keys, root_key
from globalkv.lookup import IndexLookup
from tests.index.conftest import Backend
from tests.index.events import BS, NS, P0, P1, Feeder, depths, scores, store, tokens


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.integers(1, 9),
    parent=st.integers(0, 2**64 - 1),
)
def test_a_chain_is_the_list_chain_keys_gives(
    tokens: list[int], block_size: int, parent: int
) -> None:
    expected = chain_keys(parent, tokens, block_size)  # type: ignore[arg-type]
    chain = KeyChain(parent, tokens, block_size)  # type: ignore[arg-type]
    assert len(chain) == len(expected)
    assert list(chain.hashed()) == expected
    assert list(chain) == expected
    assert chain[1:3] == expected[1:3]
    if expected:
        assert chain[-1] == expected[-1]


def test_request_chain_is_request_keys() -> None:
    t = list(range(100))
    chain = request_chain(t, 4, "m", "lora", "salt")
    assert list(chain) == request_keys(t, 4, "m", "lora", "salt")
    assert len(request_chain([1, 2, 3], 4, "m")) == 0


def test_every_token_is_checked_at_once() -> None:
    with pytest.raises(ValueError, match="token ids"):
        KeyChain(root_key("m"), [*range(1000), 2**32], 4)
    with pytest.raises(ValueError, match="block_size"):
        KeyChain(root_key("m"), [1], 0)


class _CountingDigest:
    """Stands in for the xxhash module inside globalkv.keys and counts key hashes."""

    def __init__(self) -> None:
        self.calls = 0

    def xxh3_64_intdigest(self, data: bytes) -> int:
        self.calls += 1
        return xxhash.xxh3_64_intdigest(data)


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> _CountingDigest:
    counting = _CountingDigest()
    monkeypatch.setattr(keys_module, "xxhash", counting)
    return counting


async def test_the_memory_walk_hashes_no_key_past_the_last_held_block(
    digests: _CountingDigest,
) -> None:
    index = Backend("memory").make(BS)
    feed = Feeder(index)
    t = tokens(200)
    await feed(P0, store(range(1, 11), t[: 10 * BS]))
    await feed(P1, store(range(1, 4), t[: 3 * BS]))
    digests.calls = 0
    hits = await index.lookup(KeyChain(NS, t, BS))
    assert depths(hits) == {P0: 10, P1: 3}
    assert digests.calls == 11  # the ten held blocks and the first one nobody holds
    digests.calls = 0
    assert await index.lookup(KeyChain(NS, tokens(200, start=10_000), BS)) == []
    assert digests.calls == 1


async def test_lookups_of_lazy_and_listed_chains_agree(backend: Backend) -> None:
    index: Index = backend.make(BS)
    feed = Feeder(index)
    t = tokens(40)
    for i, source in enumerate((P0, P1)):
        held = 10 * (i + 1)
        await feed(source, store(range(1, held + 1), t[: held * BS]))
    for prompt in (t, t[: 15 * BS], tokens(5, start=999), t[: BS - 1]):
        lazy = await IndexLookup(index).lookup("m", prompt)
        listed = await index.lookup(request_keys(prompt, BS, "m"))
        assert [(p.pod, p.hit_blocks, p.score) for p in lazy.pods] == [
            (h.source.pod, h.blocks, h.score) for h in listed
        ]
        assert lazy.blocks == len(prompt) // BS
    assert scores(await index.lookup(request_chain(t, BS, "m"))) == {P0: 10.0, P1: 20.0}
