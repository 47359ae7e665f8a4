from __future__ import annotations

import pytest
from pydantic import ValidationError

from enginesim.api_models import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    chat_prompts,
    completion_prompts,
    generate_prompts,
)
from enginesim.engine import Bootstrap
from enginesim.vllm import room_of
from globalkv.tokenize import ByteTokenizer

TOKENIZER = ByteTokenizer()


def test_single_text_is_tokenized_and_gets_the_default_budget() -> None:
    [prompt] = generate_prompts(GenerateRequest(text="hi"), TOKENIZER, 7)
    assert prompt.input_ids == [ByteTokenizer.BOS, ord("h"), ord("i")]
    assert prompt.max_new_tokens == 7
    assert prompt.bootstrap is None
    assert prompt.rid


def test_scalar_room_for_a_batch_becomes_room_plus_index_as_sglang_does() -> None:
    body = GenerateRequest.model_validate(
        {
            "input_ids": [[1, 2], [3]],
            "bootstrap_host": "10.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": 40,
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
        }
    )
    prompts = generate_prompts(body, TOKENIZER, 9)
    assert [p.bootstrap for p in prompts] == [
        Bootstrap("10.0.0.1", 8998, 40),
        Bootstrap("10.0.0.1", 8998, 41),
    ]
    assert [p.max_new_tokens for p in prompts] == [1, 2]


def test_room_lists_bind_each_element_and_null_ports_stay_null() -> None:
    body = CompletionRequest.model_validate(
        {
            "prompt": ["a", "b"],
            "n": 2,
            "bootstrap_host": ["h1", "h1", "h2", "h2"],
            "bootstrap_port": [None, None, 9000, 9000],
            "bootstrap_room": [11, 12, 13, 14],
            "rid": "r",
        }
    )
    prompts = completion_prompts(body, TOKENIZER)
    assert [p.bootstrap.room for p in prompts if p.bootstrap] == [11, 12, 13, 14]
    assert [p.bootstrap.port for p in prompts if p.bootstrap] == [None, None, 9000, 9000]
    assert [p.rid for p in prompts] == ["r-0", "r-1", "r-2", "r-3"]
    assert prompts[0].input_ids == prompts[1].input_ids != prompts[2].input_ids


def test_chat_uses_the_template_and_max_completion_tokens_first() -> None:
    body = ChatRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hey"}],
            "max_tokens": 50,
            "max_completion_tokens": 0,
        }
    )
    [prompt] = chat_prompts(body, TOKENIZER, 9)
    assert prompt.input_ids == TOKENIZER.apply_chat_template(body.messages)
    assert prompt.max_new_tokens == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": "a", "input_ids": [1]}, "exactly one of"),
        ({"input_ids": []}, "at least one token"),
        ({"input_ids": [[1], [2]], "bootstrap_room": [1]}, "1 entries for 2 prompts"),
        ({"text": "a", "bootstrap_room": 5}, "given together"),
        ({"text": "a", "bootstrap_host": "h"}, "given together"),
        ({"text": "a", "bootstrap_host": "h", "bootstrap_room": [5]}, "not a batch"),
        (
            {"input_ids": [[1], [2]], "bootstrap_host": "h", "bootstrap_room": 2**63 - 1},
            r"exceeds 2\^63",
        ),
        ({"text": []}, "holds no prompt"),
        ({"text": "a", "sampling_params": []}, "0 entries for 1 prompts"),
    ],
)
def test_inconsistent_generate_bodies_are_bad_requests(
    body: dict[str, object], message: str
) -> None:
    with pytest.raises(BadRequest, match=message):
        generate_prompts(GenerateRequest.model_validate(body), TOKENIZER, 1)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "a", "bootstrap_room": 0, "bootstrap_host": "h"},
        {"text": "a", "bootstrap_room": 2**63, "bootstrap_host": "h"},
        {"text": "a", "bootstrap_port": 70000},
        {"input_ids": [-1]},
        {"input_ids": [2**32]},
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        {"text": "a", "routed_dp_rank": -1},
        {"text": "a", "bootstrap_room": 1, "bootstrap_host": "prefill/route?x="},
        {"text": "a", "bootstrap_room": 1, "bootstrap_host": "user@prefill"},
        {"text": "a", "bootstrap_room": 1, "bootstrap_host": "prefill:8998"},
        {"text": "a", "bootstrap_room": 1, "bootstrap_host": "[zz::1]"},
        {"input_ids": [[1]], "bootstrap_room": [1], "bootstrap_host": ["two words"]},
    ],
)
def test_out_of_range_fields_fail_validation(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate(body)


@pytest.mark.parametrize("host", ["10.0.0.5", "::1", "[fd00::5]", "prefill-0.pd.svc.cluster.local"])
def test_host_names_and_addresses_are_bootstrap_hosts(host: str) -> None:
    body = GenerateRequest.model_validate(
        {"text": "a", "bootstrap_room": 3, "bootstrap_host": host}
    )
    [prompt] = generate_prompts(body, TOKENIZER, 1)
    assert prompt.bootstrap == Bootstrap(host, None, 3)


def test_mixed_prompt_kinds_are_refused() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [[1, 2], "text"]})


def test_vllm_transfer_params_reach_every_prompt_and_bad_ones_are_refused() -> None:
    params = {
        "do_remote_prefill": True,
        "remote_request_id": "req-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [0, 1],
    }
    body = CompletionRequest.model_validate(
        {"prompt": [1, 2, 3], "n": 2, "kv_transfer_params": params}
    )
    prompts = completion_prompts(body, TOKENIZER)
    assert [p.kv_transfer for p in prompts] == [
        {**params, "do_remote_decode": False, "remote_engine_id": None, "tp_size": None}
    ] * 2
    for bad in ({"remote_port": 0}, {"remote_host": "a/b"}, {"remote_block_ids": [-1]}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", "kv_transfer_params": bad})


def test_the_transfer_room_of_a_request_id_is_stable_and_never_zero() -> None:
    rooms = {room_of(f"req-{i}") for i in range(1000)}
    assert len(rooms) == 1000
    assert 0 not in rooms
    assert room_of("req-7") == room_of("req-7")
