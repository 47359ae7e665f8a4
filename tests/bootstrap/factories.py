"""Registrations, topologies and a clock for the bootstrap tests."""

from __future__ import annotations

from typing import Any

from bootstrap.protocol import RankRegistration

SGLANG_0_5_23_PUT = {
    "attn_tp_size": 2,
    "attn_tp_rank": 1,
    "attn_cp_size": 1,
    "attn_cp_rank": 0,
    "attn_dp_size": 2,
    "attn_dp_rank": 1,
    "pp_size": 1,
    "pp_rank": 0,
    "system_dp_size": 1,
    "system_dp_rank": 0,
    "rank_ip": "127.0.0.1",
    "rank_port": 40003,
    "page_size": 64,
    "kv_cache_dtype": "auto",
    "kv_layout": None,
    "dsv41_spec_layout": None,
    "load_balance_method": "follow_bootstrap_room",
    "enable_dsa_cache_layer_split": False,
    "enable_kv_cache_sharding": False,
    "prefill_http_port": 30000,
    "decode_allocation_policy": "early",
}
"""The body SGLang 0.5.23 sends (PROTOCOLS §1.1, captured at run time)."""

SGLANG_0_5_23_SNAPSHOT = (
    '{"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1, "page_size": 64, '
    '"kv_cache_dtype": "auto", "follow_bootstrap_room": true, '
    '"enable_dsa_cache_layer_split": false, "decode_allocation_policy": "early", '
    '"enable_kv_cache_sharding": false, "prefill_http_port": 30000, '
    '"target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null, '
    '"target_pp_ranks": null, "required_dst_info_num": null, '
    '"required_prefill_response_num": null}'
)
"""SGLang 0.5.23's answer to four -1 after registering that body (PROTOCOLS §1.2)."""


def body(
    *,
    dp: tuple[int, int] = (0, 1),
    cp: tuple[int, int] = (0, 1),
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    port: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """A PUT /route body; each layout argument is (rank, size)."""
    return {
        **SGLANG_0_5_23_PUT,
        "attn_dp_rank": dp[0],
        "attn_dp_size": dp[1],
        "attn_cp_rank": cp[0],
        "attn_cp_size": cp[1],
        "attn_tp_rank": tp[0],
        "attn_tp_size": tp[1],
        "pp_rank": pp[0],
        "pp_size": pp[1],
        "rank_port": port if port is not None else rank_port(dp[0], cp[0], tp[0], pp[0]),
        **overrides,
    }


def registration(**kwargs: Any) -> RankRegistration:
    return RankRegistration.model_validate(body(**kwargs))


def rank_port(dp: int, cp: int, tp: int, pp: int) -> int:
    """A distinct, recognisable port per coordinate."""
    return 40000 + dp * 1000 + cp * 100 + tp * 10 + pp


def instance(
    dp: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, **overrides: Any
) -> list[dict[str, Any]]:
    """Bodies for every rank of one instance."""
    return [
        body(dp=(d, dp), cp=(c, cp), tp=(t, tp), pp=(p, pp), **overrides)
        for d in range(dp)
        for c in range(cp)
        for t in range(tp)
        for p in range(pp)
    ]
