"""Gateway and engine must compute identical prompt ids; these pin how each path does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as CoreTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from globalkv.tokenize import (
    ByteTokenizer,
    HFTokenizer,
    NotTokenizable,
    TokenizeError,
    Tokenizer,
    load_tokenizer,
)

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizer; caches and prefixes",
    "system user assistant you are a helpful model",
] * 20


def build_core() -> CoreTokenizer:
    core = CoreTokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS, trainer=trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", core.token_to_id("<s>"))]
    )
    return core


@pytest.fixture(scope="module")
def core() -> CoreTokenizer:
    return build_core()


def write_model(directory: Path, core: CoreTokenizer, config: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    core.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def model_dir(tmp_path: Path, core: CoreTokenizer) -> Path:
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken", "special": True},
        "chat_template": CHATML,
    }
    return write_model(tmp_path / "tiny-model", core, config)


def test_encode_adds_bos_through_the_post_processor(model_dir: Path, core: CoreTokenizer) -> None:
    tok = HFTokenizer.from_path(model_dir)
    ids = tok.encode("hello world")
    assert ids[0] == core.token_to_id("<s>")
    assert ids[1:] == core.encode("hello world", add_special_tokens=False).ids
    assert tok.decode(ids) == "hello world"


def test_special_tokens_in_text_become_single_ids(model_dir: Path, core: CoreTokenizer) -> None:
    tok = HFTokenizer.from_path(model_dir)
    ids = tok.encode("<|im_start|>user")
    assert ids[1] == core.token_to_id("<|im_start|>")
    assert core.token_to_id("<|im_start|>") not in tok.encode("<|im_start |>")


def test_chat_template_renders_like_transformers(model_dir: Path, core: CoreTokenizer) -> None:
    tok = HFTokenizer.from_path(model_dir)
    messages = [
        {"role": "system", "content": "you are a helpful model"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    assert tok.render_chat(messages) == (
        "<s><|im_start|>system\nyou are a helpful model<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    simple = [{"role": "user", "content": "hello"}]
    ids = tok.apply_chat_template(simple)
    expected = "<s><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert ids == core.encode(expected, add_special_tokens=False).ids
    assert ids.count(core.token_to_id("<s>")) == 1, "BOS written by the template, not added twice"
    without = tok.apply_chat_template(simple, add_generation_prompt=False)
    assert ids[: len(without)] == without
    assert len(without) < len(ids)


def test_content_parts_follow_the_templates_format(tmp_path: Path, core: CoreTokenizer) -> None:
    """SGLang joins text parts for templates that print content, keeps them for loops."""
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    message = {"role": "user", "content": parts, "name": None}
    printing = HFTokenizer.from_path(
        write_model(tmp_path / "p", core, {"chat_template": "{{ messages[0] }}"})
    )
    assert printing.render_chat([message]) == "{'role': 'user', 'content': 'a b'}"
    looping = HFTokenizer.from_path(
        write_model(
            tmp_path / "l",
            core,
            {
                "chat_template": "{% for message in messages %}"
                "{% for p in message['content'] | list %}[{{ p.text }}]{% endfor %}{% endfor %}"
            },
        )
    )
    assert looping.render_chat([message]) == "[a][b]"
    media = [{"type": "image_url", "image_url": {"url": "x"}}]
    for tok in (printing, looping, ByteTokenizer()):
        with pytest.raises(NotTokenizable, match="image_url"):
            tok.apply_chat_template([{"role": "user", "content": media}])


def test_eos_token_id_comes_from_the_config(model_dir: Path, core: CoreTokenizer) -> None:
    tok = HFTokenizer.from_path(model_dir)
    assert tok.eos_token_id == core.token_to_id("</s>")
    assert tok.name == "tiny-model"
    assert isinstance(tok, Tokenizer)


def test_template_exception_is_a_tokenize_error(model_dir: Path) -> None:
    tok = HFTokenizer.from_path(model_dir)
    with pytest.raises(TokenizeError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizeError, match="refused"):
        tok.apply_chat_template([{"role": "user"}])


def test_transformers_template_helpers(tmp_path: Path, core: CoreTokenizer) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    directory = write_model(tmp_path / "m", core, {"chat_template": template})
    tok = HFTokenizer.from_path(directory)
    text = tok.render_chat([{"role": "user", "content": "é"}, {"role": "user", "content": "b"}])
    assert text == '{"role": "user", "content": "é"}4'
    assert tok.eos_token_id is None


def test_named_templates_use_default(tmp_path: Path, core: CoreTokenizer) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT{{ messages | length }}"},
        ]
    }
    tok = HFTokenizer.from_path(write_model(tmp_path / "m", core, config) / "tokenizer.json")
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "DEFAULT1"


def test_chat_template_jinja_file_is_used(tmp_path: Path, core: CoreTokenizer) -> None:
    directory = write_model(tmp_path / "m", core, {})
    (directory / "chat_template.jinja").write_text("J{{ add_generation_prompt }}")
    tok = HFTokenizer.from_path(directory)
    assert tok.render_chat([], add_generation_prompt=False) == "JFalse"


def test_without_template_chat_is_not_tokenizable(tmp_path: Path, core: CoreTokenizer) -> None:
    tok = HFTokenizer.from_path(write_model(tmp_path / "m", core, {}))
    assert not tok.has_chat_template
    with pytest.raises(NotTokenizable, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({}, "no tokenizer.json"),
        ({"tokenizer.json": "{not json"}, "not a valid tokenizer.json"),
        ({"tokenizer.json": None, "tokenizer_config.json": "[1]"}, "must hold a JSON object"),
        ({"tokenizer.json": None, "tokenizer_config.json": "{"}, "not readable JSON"),
        (
            {"tokenizer.json": None, "tokenizer_config.json": '{"chat_template": "{% if %}"}'},
            "does not compile",
        ),
        (
            {"tokenizer.json": None, "tokenizer_config.json": '{"chat_template": [{"name": "x"}]}'},
            "no 'default'",
        ),
        (
            {"tokenizer.json": None, "tokenizer_config.json": '{"chat_template": 3}'},
            "must be a string",
        ),
    ],
)
def test_bad_model_directories_fail_with_a_reason(
    tmp_path: Path, core: CoreTokenizer, files: dict[str, str | None], match: str
) -> None:
    for name, content in files.items():
        if content is None:
            core.save(str(tmp_path / name))
        else:
            (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_chooses_the_implementation(model_dir: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(model_dir)), HFTokenizer)
    assert isinstance(load_tokenizer(str(model_dir / "tokenizer.json")), HFTokenizer)


def test_byte_tokenizer_round_trip_and_chat() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("hé")
    assert ids == [256, 0x68, 0xC3, 0xA9]
    assert tok.decode([*ids, tok.EOS]) == "hé"
    chat = tok.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert chat == [256, *b"<|user|>\na b<|end|>\n<|assistant|>\n"]
    no_prompt = tok.apply_chat_template(
        [{"role": "user", "content": None}], add_generation_prompt=False
    )
    assert no_prompt == [256, *b"<|user|>\n<|end|>\n"]


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ("hello", "must be an object"),
        ({"content": "x"}, "non-empty string 'role'"),
        ({"role": "user", "content": 5}, "must be a string"),
        ({"role": "user", "content": ["x"]}, "string 'type'"),
        ({"role": "user", "content": [{"type": "text", "text": 1}]}, "string 'text'"),
    ],
)
def test_byte_tokenizer_rejects_bad_messages(message: object, match: str) -> None:
    with pytest.raises(TokenizeError, match=match):
        ByteTokenizer().apply_chat_template([message])  # type: ignore[list-item]


def _ids(tok: HFTokenizer, core: CoreTokenizer, text: str = "hello world") -> tuple[int, ...]:
    """The special ids `tok` puts around `text`'s own ids, as (leading..., -1, trailing...)."""
    plain = core.encode(text, add_special_tokens=False).ids
    ids = tok.encode(text)
    start = next(i for i in range(len(ids)) if ids[i : i + len(plain)] == plain)
    return (*ids[:start], -1, *ids[start + len(plain) :])


LLAMA = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "LlamaTokenizerFast"}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, ("<s>", -1)),  # the class default: BOS on, EOS off
        ({"add_bos_token": True, "add_eos_token": True}, ("<s>", -1, "</s>")),
        ({"add_bos_token": False}, (-1,)),  # drops the BOS tokenizer.json adds
        ({"add_bos_token": False, "add_eos_token": True}, (-1, "</s>")),
    ],
)
def test_transformers4_rebuilds_bos_eos_for_llama_style_classes(
    tmp_path: Path, core: CoreTokenizer, flags: dict[str, bool], expected: tuple[object, ...]
) -> None:
    directory = write_model(tmp_path / "m", core, {**LLAMA, **flags})
    tok = HFTokenizer.from_path(directory, rules="transformers4")
    assert _ids(tok, core) == tuple(t if t == -1 else core.token_to_id(str(t)) for t in expected)
    assert isinstance(load_tokenizer(str(directory)), HFTokenizer)


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizerFast", "PreTrainedTokenizerFast"])
def test_transformers5_keeps_the_tokenizer_json_post_processor(
    tmp_path: Path, core: CoreTokenizer, tokenizer_class: str
) -> None:
    config = {**LLAMA, "tokenizer_class": tokenizer_class}
    config |= {"add_bos_token": False, "add_eos_token": True}
    tok = HFTokenizer.from_path(write_model(tmp_path / "m", core, config))
    assert _ids(tok, core) == (core.token_to_id("<s>"), -1)


def test_transformers4_keeps_the_post_processor_of_other_classes(
    tmp_path: Path, core: CoreTokenizer
) -> None:
    config = {**LLAMA, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    tok = HFTokenizer.from_path(write_model(tmp_path / "m", core, config), rules="transformers4")
    assert _ids(tok, core) == (core.token_to_id("<s>"), -1)


def test_a_flag_without_its_token_is_refused(tmp_path: Path, core: CoreTokenizer) -> None:
    config = {"tokenizer_class": "GemmaTokenizerFast", "eos_token": "</s>"}
    with pytest.raises(ValueError, match=r"add_bos_token is set but .* names no bos_token"):
        HFTokenizer.from_path(write_model(tmp_path / "m", core, config), rules="transformers4")


def test_named_special_tokens_missing_from_tokenizer_json_are_added(
    tmp_path: Path, core: CoreTokenizer
) -> None:
    config = {"pad_token": "<pad>", "additional_special_tokens": ["<tool>"]}
    tok = HFTokenizer.from_path(write_model(tmp_path / "m", core, config))
    bos, pad, tool = tok.encode("<pad><tool>")
    assert bos == core.token_to_id("<s>")
    assert {pad, tool} == {core.get_vocab_size(), core.get_vocab_size() + 1}
    assert tok.decode(tok.encode("a<pad>b")) == "ab"
    assert core.token_to_id("<pad>") is None, "the fixture's tokenizer is not modified"
