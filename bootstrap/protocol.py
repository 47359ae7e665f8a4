"""The bootstrap directory's wire contract (`docs/protocols.md` §1), as SGLang's peers speak it.

Every body the directory accepts or answers is a model here, so the server, the prefill
registrar, the decode resolver and the control-plane reader cannot drift apart. The
topology snapshot is the one answer a real SGLang decode parses strictly
(`PrefillServerInfo(**json)` fails on any unknown key), so its key set is pinned per
SGLang version and rendered only through `Topology.snapshot`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, NamedTuple, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvplumbing.addresses import HOST_RULE, is_host, is_ipv6

CompatVersion = Literal["0.5.10", "0.5.16", "0.5.23"]
COMPAT_VERSIONS: Final = get_args(CompatVersion)
DEFAULT_COMPAT: Final[CompatVersion] = "0.5.23"

MAX_RANKS: Final = 65_536
"""Upper bound on dp*cp*tp*pp: keeps a bogus registration from sizing a huge table."""

MAX_QUERY_ROOMS: Final = 65_536
"""Rooms per /query_dp_ranks body; a decode asks for its pending requests, far fewer."""

MAX_ROOM: Final = 2**64 - 1
READY_TEXT: Final = "OK"

ROUTE_PARAMS: Final = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
"""GET /route query parameters, in the order of `Coordinate` and of SGLang's decode."""
SNAPSHOT_QUERY: Final = dict.fromkeys(ROUTE_PARAMS, -1)
"""All four -1: the topology snapshot, not a rank."""

_SCRATCH_FIELDS: Final = (
    "target_tp_rank",
    "target_tp_ranks",
    "target_cp_ranks",
    "target_pp_ranks",
    "required_dst_info_num",
    "required_prefill_response_num",
)
_BASE_FIELDS: Final = (
    "attn_tp_size",
    "attn_cp_size",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_cache_dtype",
    "follow_bootstrap_room",
)

SNAPSHOT_FIELDS: Final[dict[CompatVersion, tuple[str, ...]]] = {
    "0.5.10": (*_BASE_FIELDS, *_SCRATCH_FIELDS),
    "0.5.16": (
        *_BASE_FIELDS,
        "enable_dsa_cache_layer_split",
        "prefill_http_port",
        *_SCRATCH_FIELDS,
    ),
    "0.5.23": (
        *_BASE_FIELDS,
        "enable_dsa_cache_layer_split",
        "dsv41_spec_layout",
        "kv_layout",
        "decode_allocation_policy",
        "enable_kv_cache_sharding",
        "prefill_http_port",
        *_SCRATCH_FIELDS,
    ),
}
"""Fields of SGLang's `PrefillServerInfo` per version, in its declaration order."""

OMITTED_WHEN_NULL: Final = frozenset({"dsv41_spec_layout", "kv_layout"})
"""Snapshot keys SGLang 0.5.23 drops when their value is null."""


def snapshot_keys(
    version: CompatVersion, *, kv_layout: bool = False, dsv41: bool = False
) -> set[str]:
    """The exact key set of a ready snapshot, given which optional layouts are set."""
    present = {"kv_layout": kv_layout, "dsv41_spec_layout": dsv41}
    return {k for k in SNAPSHOT_FIELDS[version] if k not in OMITTED_WHEN_NULL or present[k]}


_DECIMAL = re.compile(r"[+-]?\d{1,20}")


def _numeric_text_to_int(value: object) -> object:
    """Take a decimal string where SGLang calls int(); anything else meets strict int rules."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return int(value)
    return value


CoercedInt = Annotated[StrictInt, BeforeValidator(_numeric_text_to_int)]
Port = Annotated[CoercedInt, Field(ge=1, le=65535)]
Size = Annotated[StrictInt, Field(ge=1, le=MAX_RANKS)]
Rank = Annotated[StrictInt, Field(ge=0, lt=MAX_RANKS)]
Room = Annotated[CoercedInt, Field(ge=0, le=MAX_ROOM)]


class Coordinate(NamedTuple):
    """A rank's row key in the directory: table[dp][cp][tp][pp]."""

    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int

    def __str__(self) -> str:
        return f"DP{self.dp_rank} CP{self.cp_rank} TP{self.tp_rank} PP{self.pp_rank}"


_RANK_OF = {
    "attn_tp_rank": "attn_tp_size",
    "attn_cp_rank": "attn_cp_size",
    "attn_dp_rank": "attn_dp_size",
    "pp_rank": "pp_size",
    "system_dp_rank": "system_dp_size",
}


class RankRegistration(BaseModel):
    """The PUT /route body a prefill rank sends (SGLang 0.5.10–0.5.23); unknown keys ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    attn_tp_size: Size
    attn_tp_rank: Rank
    attn_cp_size: Size
    attn_cp_rank: Rank
    attn_dp_size: Size
    attn_dp_rank: Rank
    pp_size: Size
    pp_rank: Rank
    system_dp_size: Size
    system_dp_rank: Rank
    rank_ip: Annotated[StrictStr, Field(min_length=1, max_length=255)]
    rank_port: Port
    page_size: Annotated[CoercedInt, Field(ge=1)]
    kv_cache_dtype: StrictStr | None
    kv_layout: StrictStr | None = None
    dsv41_spec_layout: dict[str, Any] | None = None
    load_balance_method: StrictStr = "follow_bootstrap_room"
    enable_dsa_cache_layer_split: StrictBool = False
    enable_kv_cache_sharding: StrictBool = False
    prefill_http_port: Port | None = None
    decode_allocation_policy: StrictStr = "early"

    @field_validator(*_RANK_OF)
    @classmethod
    def _rank_below_size(cls, rank: int, info: ValidationInfo) -> int:
        assert info.field_name is not None
        size_field = _RANK_OF[info.field_name]
        size = info.data.get(size_field)
        if size is not None and rank >= size:
            raise ValueError(f"{info.field_name}={rank} is out of range for {size_field}={size}")
        return rank

    @field_validator("rank_ip")
    @classmethod
    def _a_host(cls, rank_ip: str) -> str:
        """Decodes dial it: anything else would only fail there, for every request."""
        bare = rank_ip[1:-1] if rank_ip.startswith("[") and rank_ip.endswith("]") else rank_ip
        if not (is_host(bare) or is_ipv6(bare)):
            raise ValueError(f"rank_ip must be {HOST_RULE}")
        return rank_ip

    @model_validator(mode="after")
    def _bounded_world(self) -> RankRegistration:
        world = self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size
        if world > MAX_RANKS:
            raise ValueError(f"dp*cp*tp*pp = {world} ranks exceeds the limit of {MAX_RANKS}")
        return self

    @property
    def dp_size(self) -> int:
        """SGLang's rule: system DP, when used, replaces attention DP as the row dimension."""
        return self.attn_dp_size if self.system_dp_size == 1 else self.system_dp_size

    @property
    def dp_rank(self) -> int:
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @property
    def coordinate(self) -> Coordinate:
        return Coordinate(self.dp_rank, self.attn_cp_rank, self.attn_tp_rank, self.pp_rank)

    @property
    def address(self) -> RankAddress:
        return RankAddress(rank_ip=self.rank_ip, rank_port=self.rank_port)


class RankAddress(BaseModel):
    """Where one prefill rank listens: the 200 body of a single-rank GET /route."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rank_ip: str = Field(min_length=1)
    rank_port: int = Field(ge=1, le=65535)

    def __str__(self) -> str:
        return f"{self.rank_ip}:{self.rank_port}"


class Topology(BaseModel):
    """An instance's topology, taken from its first registration.

    Fields are declared in the order of SGLang 0.5.23's `PrefillServerInfo`, so a snapshot
    renders byte for byte like SGLang's. Parsing a snapshot (ours or a real SGLang's, of any
    supported version) ignores the decode-side scratch fields and takes SGLang's defaults
    for keys older versions do not send.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    attn_tp_size: int = Field(ge=1)
    attn_cp_size: int = Field(ge=1)
    dp_size: int = Field(ge=1)
    pp_size: int = Field(ge=1)
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    dsv41_spec_layout: dict[str, Any] | None = None
    kv_layout: str | None = None
    decode_allocation_policy: str = "early"
    enable_kv_cache_sharding: bool = False
    prefill_http_port: int | None = None

    @classmethod
    def from_registration(cls, reg: RankRegistration) -> Topology:
        return cls(
            attn_tp_size=reg.attn_tp_size,
            attn_cp_size=reg.attn_cp_size,
            dp_size=reg.dp_size,
            pp_size=reg.pp_size,
            page_size=reg.page_size,
            kv_cache_dtype=reg.kv_cache_dtype,
            follow_bootstrap_room=reg.load_balance_method == "follow_bootstrap_room",
            enable_dsa_cache_layer_split=reg.enable_dsa_cache_layer_split,
            dsv41_spec_layout=reg.dsv41_spec_layout,
            kv_layout=reg.kv_layout,
            decode_allocation_policy=reg.decode_allocation_policy,
            enable_kv_cache_sharding=reg.enable_kv_cache_sharding,
            prefill_http_port=reg.prefill_http_port,
        )

    @property
    def expected(self) -> int:
        """How many distinct coordinates make the instance complete."""
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def coordinates(self) -> list[Coordinate]:
        return [
            Coordinate(dp, cp, tp, pp)
            for dp in range(self.dp_size)
            for cp in range(self.attn_cp_size)
            for tp in range(self.attn_tp_size)
            for pp in range(self.pp_size)
        ]

    def snapshot(self, version: CompatVersion) -> dict[str, Any]:
        """The four -1 answer as SGLang `version` serves it, and no other key."""
        values: dict[str, Any] = {**self.model_dump(), **dict.fromkeys(_SCRATCH_FIELDS)}
        return {
            key: values[key]
            for key in SNAPSHOT_FIELDS[version]
            if key not in OMITTED_WHEN_NULL or values[key] is not None
        }


class RoomRegistration(BaseModel):
    """POST /register_dp_rank: the prefill tells which DP rank serves a room."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    bootstrap_room: Room
    dp_rank: Annotated[CoercedInt, Field(ge=0, lt=MAX_RANKS)]


class RoomQuery(BaseModel):
    """POST /query_dp_ranks: a decode asks for the DP rank of its pending rooms."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    bootstrap_rooms: Annotated[list[Room], Field(max_length=MAX_QUERY_ROOMS)]


def not_ready_text(registered: int) -> str:
    """SGLang's 503 text; decodes only log it, but operators grep for it."""
    return f"Prefill server not fully registered yet ({registered} workers registered)."


def not_found_text(coord: Coordinate) -> str:
    return (
        f"Bootstrap info not found for dp_rank={coord.dp_rank} cp_rank={coord.cp_rank} "
        f"tp_rank={coord.tp_rank} pp_rank={coord.pp_rank}"
    )
