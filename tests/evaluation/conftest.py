"""Fixtures of the evaluation tests: a tiny random Llama saved with a character-level tokenizer, and a local
text file, so a whole suite runs in seconds without the default model."""

from __future__ import annotations

import random
import string

import pytest
import torch

WORDS = ["the", "king", "queen", "lord", "lady", "sword", "crown", "night", "day", "love", "death", "war", "peace",
         "speak", "hear", "see", "come", "go", "now", "never", "thou", "thee", "art", "hath", "doth", "good", "ill",
         "fair", "foul", "heaven", "earth", "sea", "storm", "ghost"]


def write_tiny_model(folder) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {"[UNK]": 0, "<eos>": 1, "<pad>": 2}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=2, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)


def write_text(path, chars: int = 8000) -> None:
    rng = random.Random(0)
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS) + ("." if rng.random() < 0.1 else ""))
    path.write_text(" ".join(words))


TINY_SUITE = """
name = "tiny"
threads = 1

[model]
name = "{model}"

[data]
source = "{text}"

[calibration]
use = "fit"
tokens = 256
chunk = 64
predictors = ["none", "context"]

[lossless]
tokens = 64
block_tokens = 16
predictors = ["generic", "none", "context"]
baselines = ["zstd-3", "exponent-bound"]
windows = ["fixed-1024", "predicted"]
window_tokens = 32

[generation]
prompt_tokens = 24
new_tokens = 4
block_tokens = 8
residual_tokens = 4

[lossy]
context = 64
continuation = 16
interval = 8
window = 8
sinks = 2
heldout_stride = 2
budgets = [0.5]
methods = ["summary", "topk", {{ name = "summary-entropy", method = "summary", selection = "entropy" }}]
needles = 2
needle_context = 128
needle_batch = 2
quantized = ["fp8"]
q_group_size = 16
"""


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """(model folder, text file) of a tiny random Llama and ~8000 characters of text."""
    root = tmp_path_factory.mktemp("tiny_eval")
    model_dir = root / "model"
    write_tiny_model(model_dir)
    text = root / "text.txt"
    write_text(text)
    return model_dir, text


@pytest.fixture
def tiny_suite(tiny_assets, tmp_path):
    """A factory: write the tiny suite (with ``{old: new}`` text replacements) and return its path."""
    model_dir, text = tiny_assets

    def make(replace: dict[str, str] | None = None) -> str:
        body = TINY_SUITE.format(model=model_dir, text=text)
        for old, new in (replace or {}).items():
            body = body.replace(old, new)
        path = tmp_path / "tiny.toml"
        path.write_text(body)
        return str(path)

    return make
