"""The rank-mapping table of PROTOCOLS §1.5, checked against SGLang 0.5.23's formulas."""

from __future__ import annotations

from typing import Any

import pytest

from bootstrap.mapping import DecodeTopology, IncompatibleTopology, target_ranks
from bootstrap.protocol import Topology


def prefill(tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, **flags: Any) -> Topology:
    return Topology(
        attn_tp_size=tp,
        attn_cp_size=cp,
        dp_size=dp,
        pp_size=pp,
        page_size=64,
        kv_cache_dtype="auto",
        follow_bootstrap_room=True,
        **flags,
    )


# (prefill, decode) -> (tp_rank, tp_ranks, cp_ranks, pp_ranks, dummies, dst_info, responses)
CASES: list[tuple[str, Topology, DecodeTopology, tuple[Any, ...]]] = [
    ("D==T", prefill(tp=4), DecodeTopology(4, 2), (2, (2,), (0,), (0,), set(), 1, 1)),
    ("D==T=1", prefill(), DecodeTopology(1, 0), (0, (0,), (0,), (0,), set(), 1, 1)),
    ("D>T", prefill(tp=2), DecodeTopology(8, 5), (1, (1,), (0,), (0,), set(), 4, 1)),
    ("D>T first", prefill(tp=2), DecodeTopology(8, 3), (0, (0,), (0,), (0,), set(), 4, 1)),
    ("D<T", prefill(tp=8), DecodeTopology(2, 1), (4, (4, 5, 6, 7), (0,), (0,), set(), 1, 4)),
    (
        "D<T MLA",
        prefill(tp=8),
        DecodeTopology(2, 1, mla=True),
        (4, (4, 5, 6, 7), (0,), (0,), {5, 6, 7}, 1, 1),
    ),
    ("CP>1", prefill(cp=4), DecodeTopology(1, 0), (0, (0,), (0,), (0,), set(), 1, 1)),
    (
        "CP>1 all ranks",
        prefill(cp=4),
        DecodeTopology(1, 0, pull_all_cp_ranks=True),
        (0, (0,), (0, 1, 2, 3), (0,), set(), 1, 4),
    ),
    (
        "CP>1 DSA layer split",
        prefill(cp=2, enable_dsa_cache_layer_split=True),
        DecodeTopology(1, 0),
        (0, (0,), (0, 1), (0,), set(), 1, 2),
    ),
    (
        "CP>1 sharded",
        prefill(cp=2, enable_kv_cache_sharding=True),
        DecodeTopology(1, 0),
        (0, (0,), (0, 1), (0,), set(), 1, 2),
    ),
    ("PP vs PP 1", prefill(pp=3), DecodeTopology(1, 0), (0, (0,), (0,), (0, 1, 2), set(), 1, 3)),
    (
        "PP equal",
        prefill(pp=2),
        DecodeTopology(1, 0, pp_size=2, pp_rank=1),
        (0, (0,), (0,), (1,), set(), 1, 1),
    ),
    (
        "MLA sharded",
        prefill(tp=4, enable_kv_cache_sharding=True),
        DecodeTopology(4, 1, mla=True),
        (None, (0, 1, 2, 3), (0,), (0,), set(), 4, 4),
    ),
    (
        "sharding ignored without MLA",
        prefill(tp=4, enable_kv_cache_sharding=True),
        DecodeTopology(4, 1),
        (1, (1,), (0,), (0,), set(), 1, 1),
    ),
    (
        "D<T, CP all, PP vs 1",
        prefill(tp=4, cp=2, pp=2, enable_dsa_cache_layer_split=True),
        DecodeTopology(2, 1),
        (2, (2, 3), (0, 1), (0, 1), set(), 1, 8),
    ),
]


@pytest.mark.parametrize(
    ("prefill_topology", "decode", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_target_ranks(
    prefill_topology: Topology, decode: DecodeTopology, expected: tuple[Any, ...]
) -> None:
    mapping = target_ranks(prefill_topology, decode)
    assert (
        mapping.tp_rank,
        mapping.tp_ranks,
        mapping.cp_ranks,
        mapping.pp_ranks,
        set(mapping.dummy_tp_ranks),
        mapping.required_dst_info_num,
        mapping.required_prefill_response_num,
    ) == expected


def test_every_decode_rank_is_served_and_prefill_ranks_are_shared_evenly() -> None:
    for prefill_tp, decode_tp in [(2, 8), (8, 2), (4, 4)]:
        served: dict[int, int] = {}
        for rank in range(decode_tp):
            for tp in target_ranks(
                prefill(tp=prefill_tp), DecodeTopology(decode_tp, rank)
            ).tp_ranks:
                served[tp] = served.get(tp, 0) + 1
        assert sorted(served) == list(range(prefill_tp))
        assert set(served.values()) == {max(1, decode_tp // prefill_tp)}


def test_targets_are_listed_in_sglangs_order_higher_pp_first() -> None:
    mapping = target_ranks(
        prefill(tp=4, cp=2, pp=2, enable_kv_cache_sharding=True), DecodeTopology(2, 0)
    )
    assert mapping.targets() == [
        (0, 0, 1),
        (0, 0, 0),
        (0, 1, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 0, 0),
        (1, 1, 1),
        (1, 1, 0),
    ]


@pytest.mark.parametrize(
    ("prefill_topology", "decode", "reason"),
    [
        (prefill(pp=3), DecodeTopology(1, 0, pp_size=2), "pp_size 2 must equal"),
        (prefill(tp=2), DecodeTopology(3, 0), "must divide one another"),
        (prefill(tp=6), DecodeTopology(4, 0), "must divide one another"),
        (
            prefill(tp=4, enable_kv_cache_sharding=True),
            DecodeTopology(2, 0, mla=True),
            "sharding needs equal",
        ),
    ],
)
def test_incompatible_layouts_are_refused_with_the_reason(
    prefill_topology: Topology, decode: DecodeTopology, reason: str
) -> None:
    with pytest.raises(IncompatibleTopology, match=reason):
        target_ranks(prefill_topology, decode)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp_size": 0, "tp_rank": 0},
        {"tp_size": 2, "tp_rank": 2},
        {"tp_size": 2, "tp_rank": -1},
        {"tp_size": 1, "tp_rank": 0, "pp_size": 2, "pp_rank": 2},
    ],
)
def test_decode_topology_checks_its_ranks(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be in"):
        DecodeTopology(**kwargs)
