"""What the benchmarks share: the model and text of a run (the embedded SmolLM2-135M-Instruct and held-out
Shakespeare; with ``--smoke`` a tiny random Llama and random token ids, so that a run takes seconds and needs
no download) and the results folder."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `add_common_arguments` serves every bench's --help, which imports no torch
    import torch

#: where ``hf-kvcompress bench NAME`` writes by default (untracked; published runs pass --out results/...)
DEFAULT_ROOT = Path("eval-results") / "bench"
#: the tiny model of ``--smoke``: two layers, 4 query heads and 2 K/V heads of 16 channels
TINY_VOCAB = 128


@dataclass
class Workload:
    """The model of a run and where its token ids come from."""

    model: torch.nn.Module
    tokenizer: object | None  # None: random token ids (smoke)
    name: str
    smoke: bool

    def ids(self, n: int, split: str = "evaluation", offset: int = 0) -> torch.LongTensor:
        """``[1, n]`` token ids of ``split`` from token ``offset`` on (smoke: random ids, a fixed sequence per
        split, so offsets and splits behave as with text)."""
        if self.tokenizer is not None:
            from hf_kvcompress.data import token_ids

            return token_ids(self.tokenizer, n, split=split, offset=offset)
        import torch

        g = torch.Generator().manual_seed(0 if split == "evaluation" else 1)
        return torch.randint(3, TINY_VOCAB, (1, offset + n), generator=g)[:, offset:]

    def fit_calibration(self, tokens: int, chunk: int, predictors, probe_layers=()):
        """A calibration fitted here on ``tokens`` tokens of the calibration split."""
        from hf_kvcompress.calibration import Calibration

        return Calibration.fit(self.model, None, tokens=tokens, chunk=chunk, predictors=tuple(predictors),
                               probe_layers=tuple(probe_layers), progress=False,
                               ids=self.ids((tokens // chunk) * chunk, split="calibration"))

    def default_calibration(self, predictors=("context",), smoke_tokens: int = 64):
        """The model's default calibration (fitted and saved on first use); smoke: one fitted here."""
        if self.smoke:
            return self.fit_calibration(smoke_tokens, smoke_tokens // 2, predictors)
        from hf_kvcompress.calibration import calibration_for

        calibration, note = calibration_for(self.model, tokenizer=self.tokenizer, predictors=tuple(predictors))
        if calibration is None:
            raise RuntimeError(f"no calibration for the benchmark: {note}")
        return calibration


def tiny_model(dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A two-layer random Llama (seeded: the same weights every call), bfloat16 unless ``dtype`` says."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=2, eos_token_id=1, bos_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dtype or torch.bfloat16).eval()
    model.generation_config.pad_token_id = 2
    return model


def sliding_window_model(model: torch.nn.Module, window: int) -> torch.nn.Module:
    """``model`` (a Llama) as a sliding-window architecture: its weights, unchanged, in a Mistral of the same config
    with ``sliding_window=window`` (every layer attends to its last ``window`` tokens). transformers' Llama ignores a
    ``sliding_window`` set on its config (its attention and mask take none), Mistral's honours it, and both name
    their weights alike: a load that misses or leaves one raises."""
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"sliding_window_model: a LlamaForCausalLM is converted, not {type(model).__name__}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"sliding_window_model: window must be an int >= 2 (tokens), not {window!r}")
    fields = model.config.to_dict()
    for name in ("architectures", "model_type", "transformers_version", "_name_or_path"):
        fields.pop(name, None)
    config = MistralConfig(**{**fields, "sliding_window": window})
    # built in place (not on "meta"): its rotary tables are buffers outside the state dict
    sliding = MistralForCausalLM(config).to(model.dtype)
    sliding.load_state_dict(model.state_dict(), strict=True)
    sliding.generation_config = model.generation_config
    return sliding.eval()


def workload(smoke: bool, **load_kwargs) -> Workload:
    """The run's model: the embedded default (``load_model(**load_kwargs)``), or the tiny random one."""
    if smoke:
        return Workload(tiny_model(load_kwargs.get("dtype")), None, "tiny random Llama (smoke)",
                        True)
    from hf_kvcompress.models import load_model

    model, tokenizer = load_model(**load_kwargs)
    return Workload(model, tokenizer, "SmolLM2-135M-Instruct", False)


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--out", default=None,
                        # the path first: argparse wraps help text at hyphens, which would split "eval-results"
                        help=f"{DEFAULT_ROOT / name} by default (untracked): the results folder")
    parser.add_argument("--smoke", action="store_true",
                        help="a run of seconds on a tiny random model: checks that the benchmark runs (its numbers "
                             "mean nothing)")


def out_folder(args: argparse.Namespace, name: str) -> Path:
    out = Path(args.out) if args.out else DEFAULT_ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    return out
