"""One typed configuration per emulated engine, built from flags in `enginesim.cli` only.

Defaults follow SGLang where the flag exists there (ports 30000/8998/5557, the bootstrap
retry schedule, `follow_bootstrap_room`); the rest are sized for a laptop: a page of 16
tokens (the indexer's default block size; SGLang's own default of 1 would make the index
key one block per token) and rates that make routing effects visible in milliseconds.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from globalkv.wire import Flavor
from kvplumbing.endpoints import endpoint_port, offset_endpoint

Role = Literal["prefill", "decode"]
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")

Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class KVEventsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = Field(
        "tcp://*:5557",
        description="PUB endpoint of DP rank 0 (rank r uses port + r); binds for */0.0.0.0/::/"
        "ipc/inproc, connects otherwise; None disables events. Port 0: any free port.",
    )
    replay_endpoint: str | None = Field(
        None, description="Replay ROUTER endpoint of DP rank 0 (always binds); None: no replay."
    )
    topic: str | None = Field(None, description="Topic frame; None means kv@<pod>@<model>.")
    format: Flavor = Field("sglang", description="Wire flavour: vllm, vllm-array or sglang.")
    buffer_steps: int = Field(10_000, ge=1, description="Batches kept for replay.")
    hwm: int = Field(100_000, ge=1, description="PUB send high-water mark.")


class LatencySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_tokens_per_s: float = Field(
        20_000.0, gt=0, allow_inf_nan=False, description="Uncached prompt tokens per second."
    )
    prefill_overhead_ms: float = Field(
        5.0, ge=0, allow_inf_nan=False, description="Fixed cost per prefilled request."
    )
    max_batch_tokens: int = Field(
        8192, ge=1, description="Prefill tokens per step; longer prompts are chunked."
    )
    decode_tokens_per_s: float = Field(
        200.0, gt=0, allow_inf_nan=False, description="Output tokens per second per request."
    )


class FaultSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    fail_rate: Rate = Field(0.0, description="Share of prompts failed with HTTP 500.")
    wrong_room_rate: Rate = Field(
        0.0, description="Share of KV-ready messages whose metadata carries another room."
    )
    unready_room_rate: Rate = Field(
        0.0, description="Share of KV-ready messages whose metadata room is 0."
    )
    drop_event_rate: Rate = Field(
        0.0, description="Share of KV-event batches not sent live (still replayable)."
    )
    eos_rate: Rate = Field(
        0.0,
        description="vLLM API: share of prefills whose one token is EOS, answered without "
        "kv_transfer_params (the decode then recomputes the prompt).",
    )
    seed: int | None = Field(None, description="Seed of the fault draws, for repeatable runs.")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role = Field(description="prefill or decode.")
    api: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="PD protocol: sglang (bootstrap rooms, both legs at once) or vllm "
        "(kv_transfer_params: the prefill first, then the decode pulls its KV).",
    )
    host: str = Field("127.0.0.1", description="Address the HTTP server and ZMQ sockets bind.")
    port: int = Field(30000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    advertise_host: str | None = Field(
        None,
        description="Host others reach this engine at (rank addresses, kv_events endpoints); "
        "default: --host, or this machine's address when --host is a wildcard.",
    )
    model: str = Field("enginesim", min_length=1, description="Served model name.")
    lora_adapters: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field(
        (),
        description="LoRA adapters served, comma-separated names: listed in /v1/models with "
        "the model as parent, each cached (and its KV events named) in its own namespace.",
    )
    pod_id: str | None = Field(None, description="Pod id in the topic; default host:port.")
    tokenizer: str | None = Field(
        None, description="tokenizer.json or model directory; None: the built-in byte tokenizer."
    )
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks emulated.")
    dp: int = Field(1, ge=1, le=64, description="Data-parallel ranks (prefill only).")
    pp: int = Field(1, ge=1, le=64, description="Pipeline-parallel ranks emulated.")
    page_size: int = Field(16, ge=1, description="Tokens per KV page (block).")
    kv_capacity: int = Field(4096, ge=1, description="Pages of KV cache per DP rank.")
    bootstrap_port: int = Field(
        8998,
        ge=0,
        le=65535,
        description="Prefill: port of its embedded bootstrap directory (0: free port). Decode: "
        "the port used when a request's bootstrap_port is null.",
    )
    bootstrap_admin_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Prefill: required as `Authorization: Bearer …` to reset its bootstrap "
        "directory (DELETE /v1/directory); without one, only loopback clients may.",
    )
    bootstrap_insecure: bool = Field(
        False,
        description="Prefill: without a bootstrap admin token, let any host reset its directory.",
    )
    load_balance_method: Literal["follow_bootstrap_room", "round_robin"] = Field(
        "follow_bootstrap_room",
        description="Prefill DP rank choice: room % dp, or round robin with the room "
        "registered in the directory for decodes to query.",
    )
    sglang_compat: Literal["0.5.10", "0.5.16", "0.5.23"] = Field(
        "0.5.23", description="SGLang version whose topology snapshot the directory serves."
    )
    max_new_tokens: int = Field(
        128, ge=1, description="Output tokens when a request does not say (SGLang's default)."
    )
    handshake_timeout: float = Field(
        30.0, gt=0, description="Prefill: seconds to wait for the decode's handshake."
    )
    connect_timeout: float = Field(
        5.0, gt=0, description="Decode: seconds for every prefill rank to acknowledge the room."
    )
    transfer_timeout: float = Field(
        60.0, gt=0, description="Decode: seconds to wait for the KV-ready messages."
    )
    bootstrap_retry_interval: float = Field(
        1.0, gt=0, description="Decode: seconds between tries of an unready directory."
    )
    bootstrap_max_tries: int = Field(
        15, ge=1, description="Decode: tries of an unready directory before failing."
    )
    keepalive_interval: float = Field(
        5.0, gt=0, description="Prefill: seconds between rank re-registrations."
    )
    decode_kv_events: bool = Field(
        False,
        description="vLLM decode: publish its prefix cache's KV events (what it pulled and "
        "computed) on the kv_events endpoints, as a prefill does.",
    )
    kv_events: KVEventsSettings = KVEventsSettings()
    latency: LatencySettings = LatencySettings()
    faults: FaultSettings = FaultSettings()

    @field_validator("lora_adapters", mode="before")
    @classmethod
    def _split_adapters(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if len(set(self.lora_adapters)) != len(self.lora_adapters):
            raise ValueError("lora_adapters names an adapter twice")
        if self.role == "decode" and self.dp != 1:
            raise ValueError("a decode emulates one DP rank: run more decode engines instead")
        if self.api == "vllm" and (self.tp != 1 or self.pp != 1):
            raise ValueError("the vllm API emulates tp 1 and pp 1 (one KV address per prefill)")
        events = self.kv_events
        if self.decode_kv_events and (self.role, self.api) != ("decode", "vllm"):
            raise ValueError(
                "--decode-kv-events is for a vLLM decode (--role decode --api vllm): an "
                "SGLang decode keeps no prefix cache, and a prefill always publishes"
            )
        if events.endpoint is not None:
            _check_endpoint("kv_events.endpoint", events.endpoint, self.dp)
            if events.replay_endpoint is not None:
                _check_endpoint("kv_events.replay_endpoint", events.replay_endpoint, self.dp)
                _check_disjoint(events.endpoint, events.replay_endpoint, self.dp)
        return self

    @property
    def pod(self) -> str:
        """The pod id, known once the HTTP port is (port 0 resolves at bind time)."""
        return self.pod_id or f"{self.host}:{self.port}"


def _check_endpoint(name: str, endpoint: str, dp: int) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{name} {endpoint!r} must be tcp://, ipc:// or inproc://")
    if _any_free_port(endpoint):
        return  # each rank follows the port rank 0 was given (`rank_publishers`)
    try:
        offset_endpoint(endpoint, dp - 1)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _any_free_port(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and endpoint_port(endpoint) == 0


def _check_disjoint(endpoint: str, replay: str, dp: int) -> None:
    if not (endpoint.startswith("tcp://") and replay.startswith("tcp://")):
        return
    if _any_free_port(endpoint) or _any_free_port(replay):
        return
    live = {offset_endpoint(endpoint, r).rsplit(":", 1)[1] for r in range(dp)}
    back = {offset_endpoint(replay, r).rsplit(":", 1)[1] for r in range(dp)}
    if live & back:
        raise ValueError(
            f"kv_events endpoints overlap: PUB ports {sorted(live)} and replay ports "
            f"{sorted(back)} (each DP rank uses port + rank)"
        )
