"""What identifies a model: a fingerprint of its architecture config, dtype and a sample of every weight tensor.
Calibrations and saved caches record it and refuse to be used with another model. Also what its config says of
its cache: KV heads and head size (`kv_shape`), each layer's cache layer type (`layer_types`). Reads the model it is given
only (no loading, no download)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

#: config keys that describe how a model is run or named, not what it computes
_RUNTIME_KEYS = frozenset({
    "transformers_version", "name_or_path", "torch_dtype", "dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "attn_implementation", "architectures",
    "pad_token_id", "bos_token_id", "eos_token_id", "quantization_config",
})
SAMPLES_PER_TENSOR = 4096  # elements hashed per parameter tensor, spread over the whole tensor


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies a model's weights and architecture: a short overall ``fingerprint`` plus the parts
    that let a refusal name the mismatch (parameter dtypes, architecture config, one digest per parameter
    group: each decoder layer, the embeddings, the head, ...). Calibrations and saved caches record it."""

    fingerprint: str
    dtype: str
    config: dict[str, Any]
    groups: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "dtype": self.dtype, "config": self.config, "groups": self.groups}

    @classmethod
    def from_dict(cls, data: object) -> ModelIdentity:
        """Inverse of `to_dict`; ``ValueError`` naming the field for anything malformed."""
        if not isinstance(data, dict) or set(data) != {"fingerprint", "dtype", "config", "groups"}:
            raise ValueError("model identity must have fields fingerprint, dtype, config, groups")
        fingerprint, dtype, config, groups = data["fingerprint"], data["dtype"], data["config"], data["groups"]
        if not isinstance(fingerprint, str) or not isinstance(dtype, str) or not isinstance(config, dict):
            raise ValueError("model identity: fingerprint and dtype must be strings, config a dict")
        if not isinstance(groups, dict) or not all(isinstance(v, str) for v in groups.values()):
            raise ValueError("model identity: groups must map names to digests")
        if _overall(dtype, config, groups) != fingerprint:
            raise ValueError("model identity: the fingerprint does not match the parts it was made from")
        return cls(fingerprint, dtype, config, groups)

    def mismatch(self, other: ModelIdentity) -> str | None:
        """None when ``other`` is the same model, else what differs (dtype, config keys, weight groups)."""
        if other.fingerprint == self.fingerprint:
            return None
        if other.dtype != self.dtype:
            return f"dtype differs: {self.dtype} recorded, {other.dtype} given"
        keys = sorted(k for k in set(self.config) | set(other.config) if self.config.get(k) != other.config.get(k))
        if keys:
            shown = ", ".join(f"{k}: {self.config.get(k)!r} recorded, {other.config.get(k)!r} given" for k in keys[:4])
            return f"config differs ({shown}{', ...' if len(keys) > 4 else ''})"
        names = [k for k in self.groups if other.groups.get(k) != self.groups[k]]
        names += [k for k in other.groups if k not in self.groups]
        if names:
            return (f"weights differ in {', '.join(names[:4])}{', ...' if len(names) > 4 else ''} "
                    f"({len(names)} of {len(self.groups)} parameter groups)")
        return f"fingerprint differs ({self.fingerprint} recorded, {other.fingerprint} given)"


def model_identity(model: torch.nn.Module) -> ModelIdentity:
    """The `ModelIdentity` of ``model``: every parameter and buffer of its state dict (name, shape, dtype
    and ``SAMPLES_PER_TENSOR`` elements spread evenly over the tensor, first and last included, as raw
    bytes), its parameter dtypes and its architecture config. Fast for large models: a fixed sample per
    tensor, read on the tensor's own device."""
    config = _architecture(model.config.to_dict()) if getattr(model, "config", None) is not None else {}
    state = model.state_dict()
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.values() if t.is_floating_point()})
    groups: dict[str, hashlib._Hash] = {}
    for name in sorted(state):
        digest = groups.setdefault(_group_of(name), hashlib.sha256())
        digest.update(_tensor_sample(name, state[name]))
    group_hex = {name: digest.hexdigest()[:16] for name, digest in groups.items()}
    dtype = ",".join(dtypes)
    return ModelIdentity(_overall(dtype, config, group_hex), dtype, config, group_hex)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's architecture config, dtype and a sample of every weight tensor (see
    `model_identity`): calibrations and saved caches record it and refuse to be used with another model."""
    return model_identity(model).fingerprint


def kv_shape(config: Any) -> tuple[int | None, int | None]:
    """A model's KV heads and head size per layer, from its transformers config (its text decoder's):
    ``num_key_value_heads`` (else ``num_attention_heads``: no grouping) and ``head_dim`` (else ``hidden_size //
    num_attention_heads``); None for what the config does not say."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    dim = getattr(text, "head_dim", None)
    if not dim and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        dim = text.hidden_size // text.num_attention_heads
    return heads, dim


def layer_types(config: Any) -> list[str]:
    """transformers' cache layer type of each layer of the model with ``config`` (its text decoder's)."""
    return list(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0])


def not_full_attention(config: Any) -> list[str]:
    """The layer types of the model with ``config`` other than full attention, sorted; empty: every layer holds
    every token (the one test of "full attention only": calibrations, predictors reading the layer below, the
    prefix store)."""
    return sorted(set(layer_types(config)) - {"full_attention"})


def _overall(dtype: str, config: dict[str, Any], groups: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps([dtype, config, groups], sort_keys=True).encode()).hexdigest()[:16]


def _architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The config without the keys that name or run the model (recursively, for composite configs), as JSON."""
    kept = {k: _architecture(v) if isinstance(v, dict) else v
            for k, v in config.items() if not str(k).startswith("_") and k not in _RUNTIME_KEYS}
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def _group_of(name: str) -> str:
    """``model.layers.29.mlp.up_proj.weight`` -> ``model.layers.29``; ``lm_head.weight`` -> ``lm_head``."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _tensor_sample(name: str, tensor: torch.Tensor) -> bytes:
    head = f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode()
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return head + b"no data"
    flat = tensor.detach().reshape(-1)
    if flat.numel() > SAMPLES_PER_TENSOR:
        index = torch.arange(SAMPLES_PER_TENSOR, dtype=torch.int64) * (flat.numel() - 1) // (SAMPLES_PER_TENSOR - 1)
        flat = flat.index_select(0, index.to(flat.device))
    raw = flat.contiguous().cpu()
    if raw.dtype == torch.bool:
        raw = raw.to(torch.uint8)
    return head + raw.view(torch.uint8).numpy().tobytes()
