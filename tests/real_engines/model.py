"""A tiny LLaMA that vLLM CPU serves, written into a directory: a `config.json` and a
byte-level BPE tokenizer trained here with the `tokenizers` library, so nothing binary is
committed and nothing is downloaded.

The weights are vLLM's `--load-format dummy`: drawn from a generator seeded by the model
config's seed (0), so two engines started on this directory compute the same tokens
(the tests check it). Sizes are the smallest vLLM's CPU attention takes: its head size
must be one of 32, 64, … (16 fails at the first request), its block size a multiple of 32.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MODEL = "tiny"
"""The served model name every engine and the gateway use."""

VOCAB = 384
WORDS = (
    "the",
    "a",
    "prefill",
    "decode",
    "cache",
    "block",
    "index",
    "gateway",
    "route",
    "engine",
    "token",
    "prompt",
    "model",
    "vllm",
    "kv",
    "event",
    "store",
    "hit",
    "miss",
    "pod",
    "layer",
    "head",
    "query",
    "answer",
    "replay",
    "socket",
    "topic",
    "index",
    "holder",
    "transfer",
    "connector",
    "shared",
    "storage",
    "batch",
    "sequence",
    "chain",
    "parent",
    "root",
    "key",
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "model_max_length": 2048,
    "chat_template": (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    ),
}


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_model(directory: Path) -> Path:
    """The model directory, written into `directory` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    corpus = [sentence(rng, 24) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory
