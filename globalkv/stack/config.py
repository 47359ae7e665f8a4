"""What a local cluster is: its typed configuration, checked as a whole.

`globalkv up` builds it from its flags, the trace-replay tool and the tests from Python;
`plan.plan_stack` turns it into each component's command line. The checks here are the
ones no single component can make: they are about how the components reach each other
(one Redis for indexer replicas, a gateway on a host address and the indexer's protected
mode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from globalkv import redis_client
from kvplumbing.auth import is_loopback

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
_WILDCARDS = {"0.0.0.0", "::", ""}
LOOPBACK = "127.0.0.1"


class StackConfig(BaseModel):
    """One local cluster: how many engines of each role, and how they are configured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: int = Field(2, ge=1, le=32, description="Prefill engines, one pod each.")
    decode: int = Field(2, ge=1, le=32, description="Decode engines.")
    gateways: int = Field(
        1,
        ge=1,
        le=16,
        description="Gateways, each serving every worker on its own port (with the envoy "
        "entry: endpoint picker replicas behind the one Envoy).",
    )
    entry: Literal["gateway", "envoy"] = Field(
        "gateway",
        description="How requests enter: the gateway, or Envoy calling `globalkv epp` with a "
        "`globalkv sidecar` in front of each decode (needs the envoy extra).",
    )
    indexers: int = Field(
        1,
        ge=1,
        le=16,
        description="Indexers; more than one share the pods by leases and need redis_url.",
    )
    host: str = Field(
        LOOPBACK, min_length=1, description="Address the gateway and the index API listen on."
    )
    gateway_port: int = Field(0, ge=0, le=65535, description="Gateway port; 0 picks a free one.")
    redis_url: str | None = Field(
        None,
        description="Keep the index in this Redis (the gateway then reads it directly); "
        "None: the indexer's in-memory index.",
    )
    redis_cluster: int | None = Field(
        None,
        ge=3,
        le=16,
        description="Start a local Redis Cluster of this many masters (one replica each) "
        "and keep the index there; exclusive with redis_url.",
    )
    run_dir: Path | None = Field(
        None, description="Where logs and cluster.json go; None: a fresh directory under runs/."
    )
    model: str = Field("emulated-model", min_length=1, description="Served model name.")
    engine: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="PD protocol the emulated engines speak: SGLang's bootstrap rooms or "
        "vLLM's kv_transfer_params (KV events then in vLLM's wire shape).",
    )
    block_size: int = Field(
        16, ge=1, le=4096, description="Engine page size and index block size, in tokens."
    )
    tokenizer: str = Field(
        "byte",
        min_length=1,
        description="'byte' or a tokenizer.json / model directory, shared by engines, "
        "gateway and indexer so they all compute the same tokens.",
    )
    log_level: LogLevel = Field("INFO", description="Log level of every component.")
    health_check_interval: float = Field(
        2.0, gt=0, description="Seconds between the gateway's health checks of each worker."
    )
    start_timeout: float = Field(60.0, gt=0, description="Seconds allowed to become ready.")
    stop_timeout: float = Field(
        10.0, gt=0, description="Seconds a component gets to exit after SIGTERM."
    )
    prefill_args: list[str] = Field(
        default_factory=list, description="Extra `globalkv engine` flags for every prefill."
    )
    decode_args: list[str] = Field(
        default_factory=list, description="Extra `globalkv engine` flags for every decode."
    )
    gateway_args: list[str] = Field(
        default_factory=list, description="Extra `globalkv gateway` flags."
    )
    indexer_args: list[str] = Field(
        default_factory=list, description="Extra `globalkv indexer` flags."
    )
    admin_token: SecretStr | None = Field(
        None,
        min_length=1,
        description="One admin token for the indexer, the gateway and every prefill's "
        "directory; None: protected mode, changes only from this machine.",
    )
    insecure: bool = Field(
        False, description="Without an admin token, let any host change every component."
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        return None if value is None else redis_client.check_url(value)

    @model_validator(mode="after")
    def _one_redis(self) -> StackConfig:
        if self.redis_url is not None and self.redis_cluster is not None:
            raise ValueError("--redis-url and --redis-cluster are exclusive: give one")
        return self

    @model_validator(mode="after")
    def _replicas_share_redis(self) -> StackConfig:
        if self.indexers > 1 and self.redis_url is None and self.redis_cluster is None:
            raise ValueError(
                f"--indexers {self.indexers}: indexer replicas share the pods through Redis; "
                "give --redis-url or --redis-cluster too"
            )
        return self

    @model_validator(mode="after")
    def _reachable_without_a_token(self) -> StackConfig:
        """On an address of its own the gateway reaches the indexer from that address,
        and the indexer in protected mode would refuse its registrations."""
        local = reachable(self.host)
        on_loopback = local == "localhost" or is_loopback(local)
        if self.admin_token is None and not self.insecure and not on_loopback:
            raise ValueError(
                f"--host {self.host}: the gateway would register pods with the indexer from "
                f"{local}, which the indexer refuses without an admin token: give "
                "--admin-token (GLOBALKV_UP_ADMIN_TOKEN), or --insecure to leave every "
                "component open to any host"
            )
        return self

    @property
    def token(self) -> str | None:
        return None if self.admin_token is None else self.admin_token.get_secret_value()


def reachable(host: str) -> str:
    """The address others reach a component listening on `host` at (loopback for a
    wildcard)."""
    return LOOPBACK if host in _WILDCARDS else host
