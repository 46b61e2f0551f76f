"""A hash of every byte the lossless writers write, to show a refactor left them unchanged (issue 35).

Run from the project root: ``python experiments/byte_hash.py [--verbose]``. Prints one SHA-256 per part and one
over all of them; equal output before and after a change (on the same machine: saved files record it) means the
codec streams, the cache's generation blocks, saved files, prefix-store chunks and LMCache chunk payloads are
byte for byte the same. Covers both generation coders (``huff``, ``lanes``; ``ans`` for streams and files), every
predictor ``save`` takes on a tiny 6-layer Llama (the model-running ones included), and K/V holding the special
values (NaN payloads, infinities, -0.0, subnormals). It also checks that what it wrote decodes bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_KVCOMPRESS_CACHE", tempfile.mkdtemp())
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "fixtures"))

import torch  # noqa: E402

torch.set_num_threads(1)

from helpers import fresh_tiny_model, random_ids  # noqa: E402
from make_fixtures import STREAM_CONFIGS, special_values, stream_inputs  # noqa: E402

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig, PrefixStore, codec  # noqa: E402
from hf_kvcompress.calibration import Calibration  # noqa: E402
from hf_kvcompress.codec import CodecConfig  # noqa: E402
from hf_kvcompress.integrations.kv_chunk import ChunkCoder  # noqa: E402
from hf_kvcompress.predictors.registry import NAMES, STORAGE_ONLY  # noqa: E402

VERBOSE = "--verbose" in sys.argv
PARTS: dict[str, hashlib._Hash] = {}


def add(part: str, name: str, data: bytes) -> None:
    PARTS.setdefault(part, hashlib.sha256()).update(name.encode() + len(data).to_bytes(8, "little") + data)
    if VERBOSE:
        print(f"  {part}/{name}: {hashlib.sha256(data).hexdigest()[:16]} ({len(data)} bytes)")


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.contiguous().view(view), b.contiguous().view(view)):
        raise SystemExit(f"NOT EXACT: {what}")


def streams() -> None:
    inputs = stream_inputs()
    for cname, kwargs in STREAM_CONFIGS.items():
        config = CodecConfig(**kwargs)
        for data in ("bf16", "fp16"):
            x, mean, std = inputs[f"{data}/x"], inputs[f"{data}/mean"], inputs[f"{data}/std"]
            blob = codec.encode(x, mean, std, config)
            add("streams", f"{cname}/{data}", blob)
            same_bits(codec.decode(blob, mean, std, config=config), x, f"stream {cname}/{data}")
            if kwargs["coder"] != "ans":
                for i, b in enumerate(codec.encode_batch(x, mean, std, config)):
                    add("streams", f"{cname}/{data}/batch{i}", b)


def kv_with_specials(model, ids, specials: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's K/V of ``ids`` per layer, with the special values written over a few elements of each."""
    cache = CompressedCache(CompressionConfig(mode="none"))
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    out = []
    for layer in cache.layers:
        k, v = layer.keys.clone(), layer.values.clone()
        values = special_values(k.dtype)
        for t in (k, v) if specials else ():
            flat = t.view(-1)
            flat[5 : 5 + values.numel()] = values
            flat[-40 : -40 + values.numel()] = values
        out.append((k, v))
    return out


def filled(config: CompressionConfig, kv, calibration=None, model=None) -> CompressedCache:
    cache = CompressedCache(config, calibration=calibration, model=model)
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache


def blocks_of(cache: CompressedCache) -> bytes:
    """Every generation block's bytes: streams, scale codes, side data and listed elements, in layer order."""
    out = bytearray()
    for layer in cache.kv_layers():
        for block in layer.blocks:
            for row in block.rows:
                for blob in row.blobs:
                    out += len(blob).to_bytes(4, "little") + blob
                out += bytes(row.scales)
                for name in sorted(row.side):
                    out += name.encode() + row.side[name].contiguous().view(torch.uint8).numpy().tobytes()
                if row.listed is not None:
                    out += row.listed.numpy().tobytes()
    return bytes(out)


def caches_and_files(model, calibration, kv, folder: Path, label: str) -> None:
    names = [n for n in NAMES if n not in STORAGE_ONLY]
    for coder in (f"{label}/huff", f"{label}/lanes"):
        for predictor in names:
            cal = calibration if predictor in ("none", "context", "below") else None
            if predictor == "framed":  # reads the model's RoPE frame
                continue
            config = CompressionConfig(mode="lossless", block_tokens=32, residual_tokens=16,
                                       lossless=LosslessConfig(predictor=predictor, coder=coder.split("/")[1],
                                                               save_predictor=predictor))
            try:
                cache = filled(config, kv, cal)
            except ValueError as err:  # a refusal is behaviour too: its message goes into the hash
                print(f"  (generation {coder}/{predictor}: {err})")
                add("generation", f"{coder}/{predictor}", f"ValueError: {err}".encode())
                continue
            add("generation", f"{coder}/{predictor}", blocks_of(cache))
            for saved in NAMES:
                if saved in STORAGE_ONLY:
                    continue
                path = folder / f"{coder.replace('/', '-')}-{predictor}-{saved}.kvc"
                try:
                    cache.save(path, predictor=saved)
                except ValueError as err:
                    if VERBOSE:
                        print(f"  (save {coder}/{predictor} as {saved}: {err})")
                    continue
                add("files", f"{coder}/{predictor}/{saved}", path.read_bytes())
                loaded = CompressedCache.load(path, calibration=cal)
                for i, ((k, v), layer) in enumerate(zip(kv, loaded.kv_layers())):
                    same_bits(layer.keys, k, f"file {path.name} layer {i} keys")
                    same_bits(layer.values, v, f"file {path.name} layer {i} values")


def storage_only_files(model, calibration, ids, folder: Path) -> None:
    """Files of the predictors that rerun the model (generation with 'generic', the model attached)."""
    config = CompressionConfig(mode="lossless", block_tokens=32, residual_tokens=16)
    cache = CompressedCache(config, model=model, calibration=calibration)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    for saved in (*STORAGE_ONLY, "framed"):
        path = folder / f"model-{saved}.kvc"
        try:
            cache.save(path, predictor=saved, probe_layer=2)
        except ValueError as err:
            print(f"  (save with the model as {saved}: {err})")
            continue
        add("files", f"model/{saved}", path.read_bytes())
        CompressedCache.load(path, model=model, calibration=calibration)


def store(model, calibration, ids, folder: Path) -> None:
    for coder in ("huff", "lanes"):
        for predictor in ("generic", "context", "below"):  # the predictors a PrefixStore takes
            config = CompressionConfig(mode="lossless", block_tokens=32, residual_tokens=16,
                                       lossless=LosslessConfig(coder=coder))
            root = folder / f"store-{coder}-{predictor}"
            prefix = PrefixStore(model, path=root, chunk_tokens=64, predictor=predictor, config=config,
                                 calibration=calibration if predictor != "generic" else None)
            cache = CompressedCache(config, model=model)
            with torch.inference_mode():
                model(ids, cache=cache, use_cache=True)
            prefix.put(ids, cache)
            for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".lock"):
                add("store", f"{coder}/{predictor}/{path.relative_to(root)}", path.read_bytes())
            again = prefix.cache_for(ids)
            assert again is not None and again.get_seq_length() > 0, "the store did not hit"


def chunks(model, calibration, kv) -> None:
    layers = [(k[0].transpose(0, 1).reshape(k.shape[2], -1), v[0].transpose(0, 1).reshape(v.shape[2], -1))
              for k, v in kv]
    chunk = torch.stack([torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])])[:, :, :96]
    chunk = chunk.contiguous()
    cfg = model.config
    coders = {"plain": ChunkCoder(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim),
              "rope": ChunkCoder.from_model_config(cfg),
              "portable": ChunkCoder.from_model_config(cfg, portable=True),
              "calibrated": ChunkCoder(calibration)}
    for name, coder in coders.items():
        payload = coder.encode(chunk, first_position=0)
        add("chunks", name, payload)
        same_bits(coder.decode(memoryview(payload), shape=tuple(chunk.shape), dtype=chunk.dtype), chunk, f"chunk {name}")


def main() -> None:
    model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)
    # fitted here (the pinned fixture calibration has no 'below' heads); the fit is deterministic
    calibration = Calibration.fit(model, None, ids=random_ids(1, 512, seed=5), tokens=512, chunk=256,
                                  predictors=("none", "context", "below"), progress=False)
    ids = random_ids(1, 128, seed=7)
    kv = kv_with_specials(model, ids)
    folder = Path(tempfile.mkdtemp())
    streams()
    caches_and_files(model, calibration, kv, folder, "specials")
    # the calibrated predictors' blocks from clean K/V too (until 2026-12-04 they refused the special values)
    caches_and_files(model, calibration, kv_with_specials(model, ids, specials=False), folder, "clean")
    storage_only_files(model, calibration, ids, folder)
    store(model, calibration, ids, folder)
    chunks(model, calibration, kv)
    total = hashlib.sha256()
    for part, digest in PARTS.items():
        print(f"{part:12s} {digest.hexdigest()}")
        total.update(digest.digest())
    print(f"{'ALL':12s} {total.hexdigest()}")


if __name__ == "__main__":
    main()
