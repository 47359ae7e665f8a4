"""A Hugging Face model id as a tokenizer, without a network: the tokenizer files read from
a Hugging Face cache laid out as the Hub client lays it out, and an id the cache lacks
refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from globalkv.tokenize import HFTokenizer, load_tokenizer
from tests.test_tokenize import CHATML, build_core, write_model

MODEL_ID = "Qwen/Qwen2.5-0.5B-Instruct"
COMMIT = "a" * 40


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding MODEL_ID's tokenizer files, the Hub out of reach."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{MODEL_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    write_model(
        repo / "snapshots" / COMMIT, build_core(), {"bos_token": "<s>", "chat_template": CHATML}
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local directory named like the id
    return repo / "snapshots" / COMMIT


def test_a_hub_id_loads_the_cached_tokenizer(offline_cache: Path) -> None:
    tokenizer = load_tokenizer(MODEL_ID)
    assert isinstance(tokenizer, HFTokenizer)
    local = HFTokenizer.from_path(offline_cache)
    assert tokenizer.encode("hello world") == local.encode("hello world")
    assert tokenizer.has_chat_template


def test_an_id_missing_from_the_cache_is_one_line(offline_cache: Path) -> None:
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE") as missing:
        load_tokenizer("nobody/no-such-model")
    assert "\n" not in str(missing.value)
    assert str(missing.value).startswith("nobody/no-such-model is neither a local path")


def test_a_local_path_shaped_like_an_id_stays_a_path(offline_cache: Path, tmp_path: Path) -> None:
    write_model(tmp_path / "models" / "tiny", build_core(), {"bos_token": "<s>"})
    assert isinstance(load_tokenizer("models/tiny"), HFTokenizer)
