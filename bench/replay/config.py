"""The replay's one typed configuration: the cluster model, its calibration, the policies.

Every parameter is the same in sim and live mode, so a live run can be simulated exactly.
Defaults and why (the Markdown report repeats the values used):

- `pods` 16 prefill pods: the Mooncake paper's Fig. 5 setting.
- `capacity_blocks` per pod; unset, `capacity_fraction` (0.2) of the trace's unique blocks
  is shared evenly by the pods. 20 % of the Mooncake trace is 2,285 blocks of 512 tokens
  per pod = 1.17 M tokens, 357 GiB of LLaMA-2-70B KV (320 KiB/token): the HBM an 8×A800
  node has left after the weights. The cache is the engine's own `PagedKVCache`.
- `prefill_tokens_per_s`; unset, it follows from `utilisation` (0.7): the rate at which
  the pods, computing every prompt token with no cache at all, would be busy that share
  of the time. 0.7 is where random routing's mean TTFT is 3.7× load balancing's on the
  Mooncake trace, the ratio of the paper's Fig. 5 (19.65 s / 5.27 s): loaded enough that
  random routing queues, not so loaded that balancing does (3,655 tokens/s per pod; see
  `docs/routing-quality.md` for the calibration sweep).
- `prefill_overhead_s` 5 ms per request and `max_batch_tokens` 8192 (SGLang's chunked
  prefill size): the emulated engine's defaults, so sim and live step the same way.
- `attention_tokens`: attention's superlinear cost. A token at context position p costs
  `1 + p / attention_tokens` linear-token units; None keeps the engine's linear model.
  52,000 is LLaMA-2-70B's FLOP break-even (2 × 69 GFLOP linear vs 2.6 MFLOP × p).
- `decode_tokens_per_s` 30 per request (33 ms between tokens); decode pods never queue
  (the engine's model), so they shape end-to-end time and throughput, not TTFT.
- `kv_transfer_tokens_per_s` 300,000: LLaMA-2-70B KV over one 800 Gb/s RDMA path; the
  decode waits for the whole prompt's KV. TTFT = queue + prefill + transfer; the first
  token is computed by the prefill (as in SGLang PD), so no decode step is added.
- `event_delay_s` 10 ms between a pod caching blocks and the index seeing it (ZMQ +
  ingest on a LAN); the sensitivity study varies it.
- `arrivals` "spread": the Mooncake trace's timestamps are rounded to ~3 s steps.
- `max_output_tokens`: unset, every request decodes its traced output; live mode caps
  it (16 by default on the command line) because streaming hundreds of tokens per
  request through Python processes would load the machine and change the prefill
  timings it measures; output length changes neither hit rate nor TTFT.
- `time_scale`: wall seconds per trace second. Arrivals, modelled durations and delays
  are multiplied by it (rates divided), and reported times divided back, so a live run
  can replay an hour of trace in a minute and still be compared with the simulation.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bench.replay.trace import Arrivals
from gateway.settings.base import PolicyName
from gateway.settings.routing import CacheAwareConfig, PrefixWeights

DEFAULT_VOCAB = 256
"""Byte tokens: why 256 is the default is told in `bench.replay.tokens`."""

ALL_POLICIES: tuple[PolicyName, ...] = (
    "prefix",
    "cache_aware",
    "least_load",
    "power_of_two",
    "round_robin",
    "random",
)
DEFAULT_POLICIES: tuple[PolicyName, ...] = ("prefix", "cache_aware", "least_load", "random")
Mode = Literal["sim", "live"]


class ClusterModel(BaseModel):
    """The simulated cluster; `None` fields are derived from the trace by `resolve`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pods: int = Field(16, ge=1, le=512, description="Prefill pods.")
    decode_pods: int | None = Field(None, ge=1, le=512, description="Decode pods (= pods).")
    capacity_blocks: int | None = Field(None, ge=1, description="KV capacity per pod, blocks.")
    capacity_fraction: float = Field(
        0.2, gt=0, description="Unset capacity: this share of unique blocks over all pods."
    )
    prefill_tokens_per_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Uncached tokens per second per pod."
    )
    utilisation: float = Field(
        0.7, gt=0, allow_inf_nan=False, description="Unset rate: no-cache busy share."
    )
    prefill_overhead_s: float = Field(0.005, ge=0, description="Fixed cost per prefill.")
    max_batch_tokens: int = Field(8192, ge=1, description="Prefill tokens per engine step.")
    attention_tokens: float | None = Field(
        None, gt=0, description="Context length doubling a token's cost; None: linear."
    )
    decode_tokens_per_s: float = Field(30.0, gt=0, description="Output tokens/s per request.")
    kv_transfer_tokens_per_s: float | None = Field(
        300_000.0, gt=0, description="Prompt KV moved per second to the decode; None: free."
    )
    event_delay_s: float = Field(0.01, ge=0, description="KV event to index visibility.")


class ReplaySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    trace: str = Field(description="Mooncake-format JSONL trace.")
    mode: Mode = Field("sim", description="Simulate, or drive a live local stack.")
    policies: tuple[PolicyName, ...] = Field(DEFAULT_POLICIES, min_length=1)
    block_size: int | None = Field(None, ge=1, description="Tokens per hash id; inferred.")
    limit: int | None = Field(None, ge=1, description="Replay the first N requests only.")
    arrivals: Arrivals = Field("spread", description="Equal timestamps spread or bursts.")
    time_scale: float = Field(1.0, gt=0, allow_inf_nan=False, description="Wall s per trace s.")
    seed: int = Field(0, description="Seed of every policy's RNG (same for all policies).")
    vocab: int = Field(DEFAULT_VOCAB, ge=2, le=2**32, description="Token ids drawn below this.")
    model: str = Field("replay-model", min_length=1, description="Model name keyed in the index.")
    engine: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="Live: the PD protocol of the stack's engines (`globalkv up --engine`).",
    )
    sessions: bool = Field(
        False,
        description="Name each request's conversation (`trace.conversation`) as a client's "
        "session header would; the prefix policy keeps sessions as the gateway does.",
    )
    cluster: ClusterModel = Field(default_factory=ClusterModel)
    prefix: PrefixWeights = Field(default_factory=PrefixWeights)
    cache_aware: CacheAwareConfig = Field(default_factory=CacheAwareConfig)
    decode_policy: PolicyName = Field("power_of_two", description="The gateway's default.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Cap on each request's output tokens; None: as traced."
    )
    run_dir: str | None = Field(
        None, description="Live: where each stack's logs go, one directory per policy."
    )
    oracle: bool = Field(True, description="Compute the pooled LRU and Belady lines.")
    bucket_s: float = Field(60.0, gt=0, description="Width of the hit-rate-over-time buckets.")
    gateways: int = Field(
        1, ge=1, le=64, description="Gateway replicas the requests are split over."
    )
    entry: Literal["gateway", "envoy"] = Field(
        "gateway",
        description="Live: how requests enter the stack (`globalkv up --entry`): the "
        "gateway, or Envoy with endpoint pickers (`gateways` replicas) and a sidecar per decode.",
    )
    gateway_sharing: Literal["none", "shared"] = Field(
        "shared",
        description="What replicas share besides the index: nothing, or their loads and "
        "pending prompts every share_interval_s (bench.replay.gateways).",
    )
    share_interval_s: float = Field(
        0.05, ge=0, allow_inf_nan=False, description="Replicas' publication interval, trace s."
    )
    pd_decider: Literal["always", "local-when-faster", "isl-bounding"] = Field(
        "always",
        description="Whether each request is disaggregated: always; the gateway's decider "
        "(--pd-decider local-when-faster); or Dynamo's isl_bounding rule (bench.replay.decodes).",
    )
    pd_decider_itl_weight: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="The gateway's --pd-decider-itl-weight."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ReplaySettings:
        if self.decode_policy == "prefix":
            raise ValueError("the prefix policy reads prefill caches; choose another for decode")
        if self.pd_decider != "always" and self.gateways != 1:
            raise ValueError("--pd-decider is simulated with one gateway")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError("a policy is listed twice")
        if self.mode == "live":
            if self.cluster.attention_tokens is not None:
                raise ValueError("live mode: the emulated engines have no attention term")
            if self.pd_decider == "isl-bounding":
                raise ValueError("live mode: isl-bounding is the simulator's baseline only")
            if self.pd_decider != "always" and self.engine != "vllm":
                raise ValueError("live mode: only vLLM decodes prefill locally (--engine vllm)")
            if self.cluster.kv_transfer_tokens_per_s is not None:
                raise ValueError("live mode: the emulated engines model no KV transfer time")
            if self.sessions:
                raise ValueError("live mode sends no session header: sessions are simulated")
        elif self.entry != "gateway":
            raise ValueError("the entry is live mode's: the simulation routes as a gateway")
        return self

    def output_tokens(self, traced: int) -> int:
        return traced if self.max_output_tokens is None else min(traced, self.max_output_tokens)


class ResolvedCluster(BaseModel):
    """The cluster model with every derived value filled in, as reported."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pods: int
    decode_pods: int
    block_size: int
    capacity_blocks: int
    capacity_fraction: float
    """Cluster capacity over the trace's unique blocks (what was asked or what follows)."""
    prefill_tokens_per_s: float
    utilisation: float
    """No-cache busy share at this rate (what was asked or what follows), overheads aside."""
    prefill_overhead_s: float
    max_batch_tokens: int
    attention_tokens: float | None
    decode_tokens_per_s: float
    kv_transfer_tokens_per_s: float | None
    event_delay_s: float


def resolve(
    cluster: ClusterModel, *, block_size: int, unique_blocks: int, offered_work_per_s: float
) -> ResolvedCluster:
    """Fill in capacity and rate from the trace; everything is in trace seconds.

    `offered_work_per_s` is the trace's prompt work with no cache (tokens, weighted by
    the attention term when there is one), so utilisation means the same with it.
    """
    pods = cluster.pods
    if cluster.capacity_blocks is not None:
        capacity = cluster.capacity_blocks
    else:
        capacity = max(1, round(cluster.capacity_fraction * unique_blocks / pods))
    if cluster.prefill_tokens_per_s is not None:
        rate = cluster.prefill_tokens_per_s
    else:
        rate = offered_work_per_s / (pods * cluster.utilisation)
    return ResolvedCluster(
        pods=pods,
        decode_pods=cluster.decode_pods or pods,
        block_size=block_size,
        capacity_blocks=capacity,
        capacity_fraction=capacity * pods / unique_blocks,
        prefill_tokens_per_s=rate,
        utilisation=offered_work_per_s / (pods * rate),
        prefill_overhead_s=cluster.prefill_overhead_s,
        max_batch_tokens=cluster.max_batch_tokens,
        attention_tokens=cluster.attention_tokens,
        decode_tokens_per_s=cluster.decode_tokens_per_s,
        kv_transfer_tokens_per_s=cluster.kv_transfer_tokens_per_s,
        event_delay_s=cluster.event_delay_s,
    )
