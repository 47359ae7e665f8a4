"""Stage 4: can the prefix policy work — is the index answering, is the prompt tokenizable?
And was the probe disaggregated, or prefilled on its decode?

Three kinds of evidence. The gateway's settings (`GET /v1/config`) say what it routes
prefills with: the policy, which index, the tokenizer and the model name it keys lookups
with. The index API is asked directly (a token lookup must answer; a text lookup shows
whether the indexer has a tokenizer). The gateway's own counters, read before and after
the probe request, say how the probe was routed: which prefill policy decided, whether it
fell back to load and for what reason (no tokenizer, no index, index unavailable…), and
whether the repeated probe was a cache hit, and whether the disaggregation decider
(`--pd-decider`) sent it to a prefill or let its decode prefill it, and why.
"""

from __future__ import annotations

from globalkv.stack.doctor.reading import Reader, Samples
from globalkv.stack.doctor.report import Level, Stage
from globalkv.stack.views import GatewaySettingsView

_FALLBACKS = {
    "no_tokenizer": (
        Level.WARN,
        "the gateway has no tokenizer: text and chat prompts are routed by load "
        "(start it with --tokenizer)",
    ),
    "not_tokenizable": (Level.WARN, "the prompt could not be tokenized: routed by load"),
    "no_index": (
        Level.WARN,
        "the gateway has no index (no --indexer-url or --redis-url): routed by load",
    ),
    "no_model": (
        Level.WARN,
        "the gateway knows no model name to key the index with (give --model)",
    ),
    "index_unavailable": (
        Level.FAIL,
        "the index did not answer the gateway's lookup in time: routed by load",
    ),
}
DECISIONS = "globalkv_gateway_routing_decisions_total"
FALLBACKS = "globalkv_gateway_routing_fallbacks_total"
PD_DECISIONS = "globalkv_gateway_pd_decisions_total"
_PD_REASONS = {
    "always": "the decider is off (--pd-decider always)",
    "faster": "estimated sooner than the remote prefill and the transfer, the decode's "
    "running requests' delay counted",
    "slower": "the remote prefill and the transfer were estimated sooner",
    "no_lookup": "nothing to estimate from (no tokens or no index answer)",
    "no_local_decode": "no eligible decode can prefill (only vLLM decodes do)",
    "unmeasured": "no prefill rate measured yet",
    "batch": "a batch request",
}


async def check_settings(stage: Stage, reader: Reader, gateway: str, indexer: str | None) -> None:
    """What the gateway routes prefills with; `indexer` is the one doctor was given."""
    url = f"{gateway}/v1/config"
    settings = await reader.view(url, GatewaySettingsView)
    if isinstance(settings, str):
        stage.skip("gateway settings", f"{url} {settings}: judged from its counters only")
        return
    decider = settings.pd_decider
    if decider is not None and decider.mode != "always":
        stage.ok(
            "gateway PD decider",
            f"{decider.mode}: a vLLM decode prefills a request itself when that is estimated "
            f"sooner (transfer {decider.transfer_tokens_per_s:g} tokens/s, ITL weight "
            f"{decider.itl_weight:g})",
        )
    elif decider is not None:
        stage.ok("gateway PD decider", "always: every request is disaggregated")
    if settings.prefill_policy != "prefix":
        policy = settings.prefill_policy
        stage.warn("gateway prefill policy", f"{policy}: the index is not consulted")
        return
    stage.ok("gateway prefill policy", "prefix: prefills chosen by cached prefix and load")
    if settings.index == "indexer":
        asked = settings.indexer_url or "?"
        if indexer is not None and asked.rstrip("/") != indexer:
            stage.warn("gateway index", f"it asks the indexer at {asked}, not {indexer}")
        else:
            stage.ok("gateway index", f"the indexer at {asked}")
    elif settings.index == "redis":
        stage.ok("gateway index", f"read from Redis at {settings.redis_url}")
    else:
        stage.warn(
            "gateway index",
            "none (no --indexer-url or --redis-url): prefills are chosen by load",
        )
    if settings.tokenizer_loaded:
        stage.ok("gateway tokenizer", settings.tokenizer or "loaded")
    else:
        stage.warn(
            "gateway tokenizer",
            "none: text and chat prompts are routed by load (start it with --tokenizer)",
        )
    if settings.model_in_use:
        stage.ok("gateway model", f"lookups keyed by {settings.model_in_use}")
    else:
        stage.warn(
            "gateway model",
            "unknown: no --model and no prefill advertised one; routed by load until then",
        )


async def check_lookup(stage: Stage, reader: Reader, indexer: str, model: str | None) -> None:
    """The index API answers lookups; say whether it can tokenize text itself."""
    if model is None:
        stage.skip("index lookups", "no model name known to look up")
        return
    url = f"{indexer}/v1/lookup"
    answer = await reader.post(url, {"model": model, "token_ids": list(range(64))})
    if isinstance(answer, str):
        stage.fail("index lookups", f"{url} {answer}")
        return
    if answer.status_code != 200:
        problem = f"answered HTTP {answer.status_code}: {answer.text[:200]}"
        stage.fail("index lookups", f"{url} {problem}")
        return
    stage.ok("index lookups", f"{url} answers token lookups for model {model}")
    text = await reader.post(url, {"model": model, "text": "globalkv doctor"})
    if isinstance(text, str) or text.status_code == 200:
        return
    if text.status_code == 400:
        stage.ok(
            "index tokenizer",
            "none: the index API takes token_ids only (the gateway tokenizes for itself)",
        )
    else:
        stage.warn("index tokenizer", f"a text lookup answered HTTP {text.status_code}")


def judge_decision(stage: Stage, delta: Samples, subject: str) -> bool:
    """How the gateway routed the probe's prefill, from counter increases; True when the
    prefix policy decided over an index answer (no fallback)."""
    for labels, value in delta.matching(FALLBACKS):
        if value > 0:
            reason = labels.get("reason", "?")
            level, message = _FALLBACKS.get(reason, (Level.WARN, "routed by load"))
            stage.add(level, subject, f"fell back to load ({reason}): {message}")
            return False
    decided = [labels for labels, value in delta.matching(DECISIONS, role="prefill") if value > 0]
    policies = {labels.get("policy") for labels in decided}
    if not decided:
        stage.warn(subject, "the gateway's routing counters did not move")
        return False
    if policies != {"prefix"}:
        shown = ", ".join(sorted(str(p) for p in policies))
        stage.warn(subject, f"prefill policy is {shown}: the index is not consulted")
        return False
    outcomes = sorted(labels.get("outcome", "?") for labels in decided)
    stage.ok(subject, f"routed by the prefix policy over the index ({', '.join(outcomes)})")
    return True


def judge_pd_decision(stage: Stage, delta: Samples, subject: str) -> bool | None:
    """Whether the gateway disaggregated the probe, from counter increases: True when a
    decode prefilled it itself, False when disaggregated, None when the counters did not
    move (a gateway without the decider)."""
    for labels, value in delta.matching(PD_DECISIONS):
        if value > 0:
            reason = labels.get("reason", "?")
            why = _PD_REASONS.get(reason, reason)
            if labels.get("decision") == "local":
                stage.ok(subject, f"prefilled on the decode, not disaggregated ({reason}: {why})")
                return True
            stage.ok(subject, f"disaggregated ({reason}: {why})")
            return False
    return None
