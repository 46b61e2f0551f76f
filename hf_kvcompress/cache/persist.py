"""One-file save / load of a lossless cache: the prefix-cache use (store a prompt's KV once, reload later).

File layout: ``MAGIC`` (8 bytes), header length (u32, little endian), a UTF-8 JSON header, then the
payload (every stream and side tensor, at the offsets the header lists). The header carries the token ids,
the config, the predictor, the model and calibration fingerprints, the library version, what the predictor
needs to reproduce (threads, CPU) and a SHA-256 of the payload. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import platform
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .. import __version__
from ..config import CompressionConfig
from ..predictors import make_predictor
from ..predictors.base import Predictor
from .coded import CodedBlock, CodedRow, LosslessContext, PredictorMismatchError
from .storage import Block

if TYPE_CHECKING:
    from .cache import CompressedCache

MAGIC = b"HFKVCACH"
FORMAT = "hf_kvcompress.cache"
VERSION = 1
MAX_HEADER = 1 << 30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CacheFileError(ValueError):
    """A saved cache cannot be loaded: corrupt, truncated, foreign, from another version, model or
    calibration, or its predictor does not reproduce here."""


def reproducibility() -> dict[str, Any]:
    """What a model-running predictor's bits depend on besides the inputs."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def save_cache(cache: CompressedCache, path: str | Path, predictor: str | None = None, probe_layer: int | None = None,
               progress: bool = False) -> Path:
    """Write ``cache`` to ``path`` as one file, every token coded with ``predictor`` (default: the config's
    ``save_predictor``)."""
    from ..models import model_fingerprint

    layers = cache.kv_layers()
    if not layers or layers[0].seen_tokens == 0:
        raise ValueError("save: the cache is empty")
    if any(layer.sliding_window is not None for layer in layers) or any(not layer.is_croppable for layer in layers):
        raise ValueError("save: only caches that hold every token exactly (no sliding window, no lossy summary)")
    settings = cache.config.lossless
    name = predictor or settings.save_predictor
    k = probe_layer or settings.probe_layer
    chosen = make_predictor(name, calibration=cache.calibration, model=cache.model, probe_layer=k)
    token_ids = cache.token_ids
    needs_tokens = not chosen.practical_in_generation
    if needs_tokens:
        _check_tokens_for_rerun(cache, token_ids, layers[0].seen_tokens)

    kv = [(layer.keys, layer.values) for layer in layers]
    block_tokens = cache.config.block_tokens
    context, blocks = _coding_context(cache, settings, chosen)
    if needs_tokens:
        context.extras_source = chosen.model_extras(token_ids)
    payload = bytearray()
    layer_entries = []
    bar = tqdm(total=len(kv), desc=f"saving ({name})", disable=not progress, leave=False)
    for index, (keys, values) in enumerate(kv):
        entries = []
        for start in range(0, keys.shape[2], block_tokens):
            stop = min(start + block_tokens, keys.shape[2])
            block = context.encode_block(index, keys[:, :, start:stop], values[:, :, start:stop], start)
            blocks[(index, start)] = block
            entries.append({"start": start, "tokens": stop - start, "rows": [_write_row(row, payload) for row in block.rows]})
        layer_entries.append({"layer": index, "blocks": entries})
        bar.update(1)
    bar.close()

    keys0 = kv[0][0]
    header = {
        "format": FORMAT,
        "version": VERSION,
        "library_version": __version__,
        "config": cache.config.to_dict(),
        "predictor": {"name": name, "probe_layer": k},
        "model_fingerprint": model_fingerprint(cache.model) if cache.model is not None else None,
        "calibration_sha256": cache.calibration.meta["tensors_sha256"] if cache.calibration is not None else None,
        "dtype": str(keys0.dtype).replace("torch.", ""),
        "rows": keys0.shape[0],
        "kv_heads": keys0.shape[1],
        "head_dim": keys0.shape[3],
        "tokens": keys0.shape[2],
        "token_ids": token_ids.tolist() if token_ids is not None else None,
        "reproducibility": reproducibility(),
        "layers": layer_entries,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_bytes": len(payload),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    target = Path(path)
    with open(target, "wb") as out:
        out.write(MAGIC)
        out.write(struct.pack("<I", len(blob)))
        out.write(blob)
        out.write(payload)
    return target


def load_cache(path: str | Path, *, model: torch.nn.Module | None = None, calibration=None,
               config: CompressionConfig | None = None, progress: bool = False) -> CompressedCache:
    """Rebuild a saved cache: bit-identical keys and values, held per ``config`` (default: the saved one)."""
    from ..models import model_fingerprint
    from .cache import CompressedCache

    header, payload = _read(Path(path))
    saved_config = CompressionConfig.from_dict(_with_saved_defaults(header["config"]))
    target = CompressedCache(config or saved_config, model=model, calibration=calibration)
    if header["library_version"] != __version__:
        raise CacheFileError(
            f"{path}: saved by hf_kvcompress {header['library_version']}, this is {__version__}; re-save it"
        )
    if header["model_fingerprint"] is not None:
        if model is None:
            raise CacheFileError(f"{path}: this cache was saved from a model; pass model=... to load it")
        got = model_fingerprint(model)
        if got != header["model_fingerprint"]:
            raise CacheFileError(
                f"{path}: saved from model {header['model_fingerprint']}, but the model given is {got}"
            )
    want_cal = header["calibration_sha256"]
    have_cal = target.calibration.meta["tensors_sha256"] if target.calibration is not None else None
    if want_cal != have_cal:
        raise CacheFileError(
            f"{path}: saved with calibration {want_cal or 'none'}, loading with {have_cal or 'none'}; "
            "pass the calibration it was saved with"
        )
    name, k = header["predictor"]["name"], header["predictor"]["probe_layer"]
    predictor = make_predictor(name, calibration=target.calibration, model=model, probe_layer=k)
    dtype = DTYPES.get(header["dtype"])
    if dtype is None:
        raise CacheFileError(f"{path}: unknown dtype {header['dtype']!r}")
    context, blocks = _coding_context(target, saved_config.lossless, predictor)
    token_ids = torch.tensor(header["token_ids"], dtype=torch.long) if header["token_ids"] is not None else None
    if not predictor.practical_in_generation:
        if token_ids is None:
            raise CacheFileError(f"{path}: the {name} predictor needs token ids, which this file lacks")
        context.extras_source = predictor.model_extras(token_ids)

    rows, heads, dim = header["rows"], header["kv_heads"], header["head_dim"]
    try:
        for entry in tqdm(header["layers"], desc=f"loading ({name})", disable=not progress, leave=False):
            layer = entry["layer"]
            for b in entry["blocks"]:
                coded_rows = [_read_row(row, payload, heads) for row in b["rows"]]
                if len(coded_rows) != rows:
                    raise CacheFileError(f"{path}: block at layer {layer} has {len(coded_rows)} rows, not {rows}")
                blocks[(layer, b["start"])] = CodedBlock(context, layer, b["start"], b["tokens"], coded_rows,
                                                         heads, dim, dtype, torch.device("cpu"))
            keys, values = [], []
            for b in entry["blocks"]:
                decoded = context.decoded(blocks[(layer, b["start"])])
                keys.append(decoded.keys)
                values.append(decoded.values)
            device = _layer_device(model, layer)
            target.update(torch.cat(keys, dim=2).to(device), torch.cat(values, dim=2).to(device), layer)
    except PredictorMismatchError as err:
        saved = header["reproducibility"]
        raise CacheFileError(
            f"{path}: the '{name}' predictor does not reproduce here (saved with {saved}, loading with "
            f"{reproducibility()}): {err}"
        ) from err
    except (KeyError, TypeError, IndexError) as err:
        raise CacheFileError(f"{path}: malformed header ({type(err).__name__}: {err})") from err
    target.token_ids = token_ids
    return target


def _with_saved_defaults(config: Any) -> Any:
    """A saved config with the defaults of the version that wrote it: files written before the lanes coder
    existed hold ``ans`` streams and say nothing of the coder."""
    if isinstance(config, dict) and isinstance(config.get("lossless"), dict) and "coder" not in config["lossless"]:
        return {**config, "lossless": {**config["lossless"], "coder": "ans"}}
    return config


def read_header(path: str | Path) -> dict[str, Any]:
    """The checked JSON header of a saved cache (stream offsets and sizes, predictor, fingerprints)."""
    return _read(Path(path))[0]


def stream_bytes(header: dict[str, Any]) -> list[dict[str, int]]:
    """Bytes per layer of key streams, value streams and side data (scales, side tensors) in a header."""
    heads = header["kv_heads"]
    per_layer = []
    for entry in header["layers"]:
        k = v = side = 0
        for block in entry["blocks"]:
            for row in block["rows"]:
                lengths = [length for _, length in row["streams"]]
                k += sum(lengths[:heads])
                v += sum(lengths[heads:])
                side += len(row["scales"]) + sum(info["bytes"] for info in row["side"].values())
        per_layer.append({"layer": entry["layer"], "k": k, "v": v, "side": side})
    return per_layer


# ---------------------------------------------------------------------- helpers


def _coding_context(cache: CompressedCache, settings, predictor: Predictor) -> tuple[LosslessContext, dict]:
    from .lossless import codec_config

    blocks: dict[tuple[int, int], Block] = {}
    codec = codec_config(settings)
    marginals = cache.calibration.marginal if cache.calibration is not None else None
    context = LosslessContext(predictor, codec, lambda layer, start: blocks.get((layer, start)), marginals, settings.workers)
    return context, blocks


def _check_tokens_for_rerun(cache: CompressedCache, token_ids: torch.Tensor | None, tokens: int) -> None:
    if cache.model is None:
        raise ValueError("save: this predictor reruns the model; the cache needs model=... attached")
    if token_ids is None or token_ids.shape[1] != tokens:
        raise ValueError(
            "save: this predictor reruns the model on the cached tokens, but the cache did not see them all "
            "(attach the model when creating the cache, before the first forward pass)"
        )
    if cache.saw_padding:
        raise ValueError("save: this predictor cannot rerun padded (left-padded batch) inputs; use 'context'")


def _write_row(row: CodedRow, payload: bytearray) -> dict[str, Any]:
    streams = []
    for blob in row.blobs:
        streams.append([len(payload), len(blob)])
        payload += blob
    side = {}
    for name, tensor in row.side.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        side[name] = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape),
                      "offset": len(payload), "bytes": len(data)}
        payload += data
    return {"scales": list(row.scales), "streams": streams, "side": side}


def _read_row(entry: dict[str, Any], payload: bytes, heads: int) -> CodedRow:
    streams = entry["streams"]
    if len(streams) != 2 * heads or len(entry["scales"]) != 2 * heads:
        raise CacheFileError(f"a block row has {len(streams)} streams, expected {2 * heads}")
    blobs = [bytes(_slice(payload, offset, length)) for offset, length in streams]
    side = {}
    for name, info in entry["side"].items():
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise CacheFileError(f"side tensor {name!r} has unknown dtype {info['dtype']!r}")
        raw = _slice(payload, info["offset"], info["bytes"])
        count = 1
        for n in info["shape"]:
            count *= int(n)
        if count * torch.tensor([], dtype=dtype).element_size() != len(raw):
            raise CacheFileError(f"side tensor {name!r}: {len(raw)} bytes do not hold shape {info['shape']}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        side[name] = flat.view(dtype).reshape(info["shape"]).clone()
    return CodedRow(blobs, [int(s) for s in entry["scales"]], side)


def _slice(payload: bytes, offset: int, length: int) -> memoryview:
    if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0 \
            or offset + length > len(payload):
        raise CacheFileError(f"a stream [{offset}, +{length}) lies outside the {len(payload)}-byte payload")
    return memoryview(payload)[offset : offset + length]


def _read(path: Path) -> tuple[dict[str, Any], bytes]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CacheFileError(f"cannot read {path}: {err}") from err
    if len(data) < 12 or data[:8] != MAGIC:
        raise CacheFileError(f"{path}: not an hf_kvcompress cache file (bad magic)")
    (size,) = struct.unpack_from("<I", data, 8)
    if size > MAX_HEADER or 12 + size > len(data):
        raise CacheFileError(f"{path}: truncated (header of {size} bytes, file of {len(data)})")
    try:
        header = json.loads(data[12 : 12 + size].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheFileError(f"{path}: corrupt header ({err})") from err
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheFileError(f"{path}: not an hf_kvcompress cache file")
    if header.get("version") != VERSION:
        raise CacheFileError(f"{path}: cache format version {header.get('version')}, this library reads {VERSION}")
    payload = data[12 + size :]
    if len(payload) != header.get("payload_bytes") or hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CacheFileError(f"{path}: payload is truncated or corrupt (size or SHA-256 mismatch)")
    return header, payload


def _layer_device(model: torch.nn.Module | None, layer: int) -> torch.device:
    if model is None:
        return torch.device("cpu")
    from ..predictors.runner import decoder_layers

    try:
        return next(decoder_layers(model)[layer].parameters()).device
    except (StopIteration, IndexError, ValueError):
        return torch.device("cpu")
