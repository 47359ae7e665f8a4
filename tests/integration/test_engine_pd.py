"""A prefill and a decode as real processes, bound by the room, as a PD router drives them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from globalkv.tokenize import load_tokenizer
from tests.enginesim.cluster import EngineProc, engines, pd_body, pd_request

pytestmark = pytest.mark.integration

PROMPT = "You are a helpful assistant. Tell me about prefix caching in LLM serving."


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[EngineProc, EngineProc]]:
    with engines(("prefill", ["--page-size", "4", "--model", "sim"]), ("decode", [])) as (
        prefill,
        decode,
    ):
        yield prefill, decode


async def test_generate_completes_and_the_second_request_reuses_the_prefix(
    pair: tuple[EngineProc, EngineProc],
) -> None:
    prefill, decode = pair
    body = pd_body(prefill, 1001, text=PROMPT, sampling_params={"max_new_tokens": 6})
    first_p, first_d = await pd_request(prefill, decode, "/generate", body)
    assert first_p.status_code == first_d.status_code == 200, first_d.text
    answer = first_d.json()
    meta = answer["meta_info"]
    assert meta["completion_tokens"] == len(answer["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["cached_tokens"] == 0
    assert set(meta["pd_stages_ms"]) == {
        "register",
        "rank",
        "connect",
        "transfer",
        "room",
        "consume",
    }
    prefill_answer = first_p.json()
    assert prefill_answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert prefill_answer["output_ids"] == answer["output_ids"][:1]

    follow_up = pd_body(
        prefill, 1002, text=PROMPT + " And then?", sampling_params={"max_new_tokens": 2}
    )
    _, second_d = await pd_request(prefill, decode, "/generate", follow_up)
    assert second_d.status_code == 200, second_d.text
    prompt_tokens = meta["prompt_tokens"]
    assert second_d.json()["meta_info"]["cached_tokens"] == (prompt_tokens - 1) // 4 * 4


async def test_chat_reports_cached_tokens_in_usage_and_streams(
    pair: tuple[EngineProc, EngineProc],
) -> None:
    prefill, decode = pair
    messages = [{"role": "user", "content": PROMPT + " (chat)"}]
    body = pd_body(prefill, 2001, messages=messages, max_tokens=3)
    await pd_request(prefill, decode, "/v1/chat/completions", body)
    body = pd_body(
        prefill,
        2002,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    _, streamed = await pd_request(prefill, decode, "/v1/chat/completions", body)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_batch_completion_binds_each_prompt_to_its_room(
    pair: tuple[EngineProc, EngineProc],
) -> None:
    prefill, decode = pair
    body = pd_body(prefill, 0, prompt=["first prompt", "second prompt"], max_tokens=2)
    body["bootstrap_room"] = [3001, 3002]
    prefill_answer, decode_answer = await pd_request(prefill, decode, "/v1/completions", body)
    assert prefill_answer.status_code == decode_answer.status_code == 200, decode_answer.text
    answer = decode_answer.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 4


def test_server_info_advertises_what_a_control_plane_needs(
    pair: tuple[EngineProc, EngineProc],
) -> None:
    prefill, decode = pair
    info = httpx.get(f"{prefill.url}/get_server_info").json()
    events = info["kv_events"]
    assert events["endpoint"] == f"tcp://127.0.0.1:{events['endpoint_port_base']}"
    assert events["replay_endpoint"] == f"tcp://127.0.0.1:{events['replay_endpoint_port_base']}"
    assert events["topic"] == f"kv@{info['pod_id']}@sim"
    assert (events["block_size"], events["dp_size"], events["format"]) == (4, 1, "sglang")
    assert info["disaggregation_mode"] == "prefill"
    assert httpx.get(f"http://127.0.0.1:{prefill.bootstrap_port}/health").status_code == 200
    assert decode.info["disaggregation_mode"] == "decode"
    assert decode.info["kv_events"] is None
    models = httpx.get(f"{prefill.url}/v1/models").json()
    assert models["data"][0]["id"] == "sim"


async def test_bad_requests_get_4xx_with_a_message(pair: tuple[EngineProc, EngineProc]) -> None:
    prefill, decode = pair
    async with httpx.AsyncClient(timeout=10) as client:
        no_fields = await client.post(f"{decode.url}/generate", json={"text": "hi"})
        assert no_fields.status_code == 400
        assert no_fields.json()["error"]["stage"] == "request"
        room_zero = await client.post(f"{decode.url}/generate", json=pd_body(prefill, 0, text="hi"))
        assert room_zero.status_code == 422
        assert "bootstrap_room" in room_zero.json()["error"]["message"]
        garbage = await client.post(
            f"{prefill.url}/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert garbage.status_code == 422
        half = await client.post(
            f"{prefill.url}/generate", json={"text": "hi", "bootstrap_room": 5}
        )
        assert half.status_code == 400
        assert "together" in half.json()["error"]["message"]
        pinned = pd_body(prefill, 6, text="hi", disagg_prefill_dp_rank=3)
        beyond = await client.post(f"{decode.url}/generate", json=pinned)
        assert beyond.status_code == 400
        assert beyond.json()["error"]["stage"] == "dp_rank"
        assert "disagg_prefill_dp_rank 3 is outside [0, 1)" in beyond.json()["error"]["message"]


async def test_round_robin_prefill_registers_rooms_and_every_tp_rank_sends_kv() -> None:
    prefill_args = ["--dp", "2", "--tp", "2", "--load-balance-method", "round_robin"]
    with engines(("prefill", prefill_args), ("decode", ["--tp", "1"])) as (prefill, decode):
        ranks = []
        for room in (60, 62, 64):
            body = pd_body(prefill, room, text="round robin", sampling_params={"max_new_tokens": 1})
            prefill_answer, decode_answer = await pd_request(prefill, decode, "/generate", body)
            assert decode_answer.status_code == 200, decode_answer.text
            prefill_rank = prefill_answer.json()["meta_info"]["dp_rank"]
            assert decode_answer.json()["meta_info"]["prefill_dp_rank"] == prefill_rank
            ranks.append(prefill_rank)
        assert ranks == [0, 1, 0], "even rooms, yet both DP ranks: the decode queried them"


async def test_hugging_face_tokenizer_is_used_for_text_and_chat(tmp_path: Path) -> None:
    tokenizer_dir = write_tokenizer(tmp_path)
    args = ["--tokenizer", str(tokenizer_dir)]
    with engines(("prefill", args), ("decode", args)) as (prefill, decode):
        messages = [{"role": "user", "content": "hello world hello"}]
        body = pd_body(prefill, 77, messages=messages, max_tokens=3)
        _, answer = await pd_request(prefill, decode, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    expected = load_tokenizer(str(tokenizer_dir)).apply_chat_template(messages)
    assert answer.json()["usage"]["prompt_tokens"] == len(expected)
    assert answer.json()["choices"][0]["message"]["content"].strip()


def write_tokenizer(directory: Path) -> Path:
    """A small real tokenizer.json (word level) with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "the quick brown fox jumps over lazy dog while prefill computes and decode streams"
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    core.train_from_iterator([words, "hello world user assistant . : , ( )"], trainer)
    core.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
