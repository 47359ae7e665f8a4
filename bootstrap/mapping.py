"""Which prefill ranks one decode rank pulls its KV from (PROTOCOLS §1.5), pure.

This is SGLang 0.5.23's `CommonKVManager._resolve_rank_mapping`, kept apart from any
I/O so the table of cases can be tested directly and shared by the resolver and the
engine emulator. Where SGLang would silently compute a wrong mapping (TP sizes that do
not divide each other) or assert, this raises `IncompatibleTopology` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from bootstrap.protocol import Topology


class IncompatibleTopology(ValueError):
    """The decode's parallel layout cannot pull from this prefill's."""


@dataclass(frozen=True, slots=True)
class DecodeTopology:
    """The decode rank asking: its attention TP and PP position.

    `mla` selects SGLang's MLA rules (one real sender among several prefill TP ranks;
    KV-cache sharding across all of them). `pull_all_cp_ranks` is SGLang's
    `enable_all_cp_ranks_for_transfer`. Decode-side CP is always 1 in SGLang.
    """

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    mla: bool = False
    pull_all_cp_ranks: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={self.pp_rank} must be in [0, pp_size={self.pp_size})")


@dataclass(frozen=True, slots=True)
class RankMapping:
    """The prefill ranks (of the chosen DP rank) a decode rank connects to.

    `tp_rank` is the prefill TP rank that sends real KV, None when all of `tp_ranks` do;
    `dummy_tp_ranks` are connected only so their transfer state completes (MLA with a
    narrower decode). The two `required_*` counts are SGLang's: how many decode ranks each
    prefill rank serves, and how many prefill answers a decode rank waits for.
    """

    tp_rank: int | None
    tp_ranks: tuple[int, ...]
    cp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dummy_tp_ranks: frozenset[int]
    required_dst_info_num: int
    required_prefill_response_num: int

    def targets(self) -> list[tuple[int, int, int]]:
        """(cp, tp, pp) to look up, in SGLang's order (higher PP ranks first)."""
        return [
            (cp, tp, pp)
            for cp in self.cp_ranks
            for tp in self.tp_ranks
            for pp in reversed(self.pp_ranks)
        ]


def target_ranks(prefill: Topology, decode: DecodeTopology) -> RankMapping:
    """SGLang's mapping from a decode rank to the prefill ranks holding its KV."""
    prefill_tp, decode_tp, rank = prefill.attn_tp_size, decode.tp_size, decode.tp_rank
    tp_rank: int | None
    if decode.mla and prefill.enable_kv_cache_sharding and prefill.attn_cp_size == 1:
        if decode_tp != prefill_tp:
            raise IncompatibleTopology(
                f"MLA KV-cache sharding needs equal attention TP sizes, "
                f"prefill {prefill_tp} vs decode {decode_tp}"
            )
        tp_rank, tp_ranks = None, tuple(range(prefill_tp))
        dst_info, responses = decode_tp, prefill_tp
    elif decode_tp == prefill_tp:
        tp_rank, tp_ranks = rank, (rank,)
        dst_info, responses = 1, 1
    elif decode_tp > prefill_tp:
        ratio = _ratio(prefill_tp, decode_tp)
        tp_rank = rank // ratio
        tp_ranks = (tp_rank,)
        dst_info, responses = ratio, 1
    else:
        ratio = _ratio(prefill_tp, decode_tp)
        tp_ranks = tuple(range(rank * ratio, (rank + 1) * ratio))
        tp_rank = tp_ranks[0]
        dst_info, responses = 1, 1 if decode.mla else ratio

    if prefill.attn_cp_size == 1:
        cp_ranks: tuple[int, ...] = (0,)
    elif (
        decode.pull_all_cp_ranks
        or prefill.enable_dsa_cache_layer_split
        or prefill.enable_kv_cache_sharding
    ):
        cp_ranks = tuple(range(prefill.attn_cp_size))
        responses *= prefill.attn_cp_size
    else:
        cp_ranks = (0,)

    if decode.pp_size == prefill.pp_size:
        pp_ranks: tuple[int, ...] = (decode.pp_rank,)
    elif decode.pp_size == 1:
        pp_ranks = tuple(range(prefill.pp_size))
        responses *= prefill.pp_size
    else:
        raise IncompatibleTopology(
            f"decode pp_size {decode.pp_size} must equal the prefill's {prefill.pp_size} or be 1"
        )

    dummies = frozenset(t for t in tp_ranks if decode.mla and tp_rank is not None and t != tp_rank)
    return RankMapping(
        tp_rank=tp_rank,
        tp_ranks=tp_ranks,
        cp_ranks=cp_ranks,
        pp_ranks=pp_ranks,
        dummy_tp_ranks=dummies,
        required_dst_info_num=dst_info,
        required_prefill_response_num=responses,
    )


def _ratio(prefill_tp: int, decode_tp: int) -> int:
    larger, smaller = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if larger % smaller:
        raise IncompatibleTopology(
            f"prefill attention TP {prefill_tp} and decode TP {decode_tp} must divide one another"
        )
    return larger // smaller
