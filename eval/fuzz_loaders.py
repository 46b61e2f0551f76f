"""Resealed-damage fuzz of the two loaders whose checksums a faulty writer can recompute (docs/lmcache.md,
docs/lossless.md "Model identity"): every failure must be the loader's documented error, never another
exception, and nothing may decode to other values.

- ``chunks``: every bit of every body byte of three LMCache payloads (model-free with a guessed frame, model-free
  with a RoPE frame, calibrated) flipped, the payload CRC recomputed; each decode must raise `ChunkPayloadError`
  or give the chunk back bit for bit.
- ``calibration``: every field of a tiny calibration's JSON (paths into ``model.config`` and ``model.identity``
  left out) deleted or set to null, "x", -1, 10^12, [] or {}; each file is loaded and then used (a lossless cache
  with the ``context`` predictor, save / load, a calibrated chunk round trip, the model check). ``--legacy``
  rewrites the JSON as format version 4 (no checksum of its own) first.

    python eval/fuzz_loaders.py chunks            # ~2 min here
    python eval/fuzz_loaders.py calibration [--legacy]   # ~1 min each

Prints the count of each outcome and an example of each unexpected one.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import shutil
import struct
import tempfile
import warnings
import zlib
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.calibration import META_FILE, Calibration, CalibrationError
from hf_kvcompress.errors import ChunkPayloadError
from hf_kvcompress.integrations.kv_chunk import HEADER, ChunkCoder


def tiny_model(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model: torch.nn.Module, cache, tokens: torch.Tensor):
    with torch.inference_mode():
        model(tokens, past_key_values=cache, use_cache=True)
    return cache


def as_chunk(cache) -> torch.Tensor:
    """The cache's K/V in LMCache's ``[2, layers, tokens, kv_heads * head_dim]`` layout."""
    return torch.stack([torch.stack([getattr(layer, kind)[0].transpose(0, 1).reshape(layer.keys.shape[2], -1)
                                     for layer in cache.layers]) for kind in ("keys", "values")])


def fuzz_chunks() -> None:
    model = tiny_model()
    calibration = Calibration.fit(model, None, ids=ids(256, 4), tokens=256, chunk=128, predictors=("context",),
                                  progress=False)
    chunk = as_chunk(prefill(model, CompressedCache(CompressionConfig(mode="none")), ids(32, 3)))
    cases = [("model-free, guessed frame", ChunkCoder(), {}),
             ("model-free, RoPE frame", ChunkCoder(rope=calibration.rope_frame(), kv_heads=2, head_dim=16), {}),
             ("calibrated", ChunkCoder(calibration), {"first_position": 0})]
    for label, coder, kwargs in cases:
        payload = coder.encode(chunk, **kwargs)
        outcomes: collections.Counter = collections.Counter()
        examples = {}
        for i in tqdm(range(HEADER.size, len(payload)), desc=label, leave=False):
            for bit in range(8):
                damaged = bytearray(payload)
                damaged[i] ^= 1 << bit
                crc = zlib.crc32(damaged[HEADER.size :], zlib.crc32(damaged[: HEADER.size - 4]))
                struct.pack_into("<I", damaged, HEADER.size - 4, crc)
                try:
                    same = torch.equal(coder.decode(bytes(damaged)).view(torch.int16), chunk.view(torch.int16))
                    outcome = "exact" if same else "WRONG CHUNK"
                except ChunkPayloadError:
                    outcome = "refused"
                except Exception as err:  # what the fuzz looks for
                    outcome = f"ESCAPED {type(err).__name__}"
                    examples.setdefault(outcome, f"byte {i}, bit {bit}: {str(err)[:100]}")
                outcomes[outcome] += 1
        print(f"{label}: {len(payload)} bytes, {sum(outcomes.values())} flips, {dict(outcomes)}")
        for outcome, example in examples.items():
            print(f"  {outcome}: {example}")


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key)
            if prefix[:2] not in (("model", "config"), ("model", "identity")):
                yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:3]):
            yield (*prefix, index)
            yield from _paths(value, (*prefix, index))


def fuzz_calibration(legacy: bool) -> None:
    model = tiny_model()
    calibration = Calibration.fit(model, None, ids=ids(256, 4), tokens=256, chunk=128, predictors=("none", "context"),
                                  progress=False)
    root = Path(tempfile.mkdtemp(prefix="fuzz_calibration_"))
    calibration.save(root / "intact")
    meta = json.loads((root / "intact" / META_FILE).read_text())
    if legacy:
        meta["version"] = 4
        del meta["meta_sha256"]
    tokens = ids(80, 3)

    def use(loaded: Calibration) -> None:
        config = CompressionConfig(mode="lossless", block_tokens=32, lossless=LosslessConfig(predictor="context"))
        cache = prefill(model, CompressedCache(config, calibration=loaded), tokens)
        path = cache.save(root / "x.kvc")
        CompressedCache.load(path, calibration=loaded)
        coder = ChunkCoder(loaded)
        chunk = as_chunk(cache)
        coder.decode(coder.encode(chunk, first_position=0))
        loaded.check_model(model)

    edits = {"delete": None, "null": None, "string": "x", "-1": -1, "10^12": 10**12, "[]": [], "{}": {}}
    outcomes: collections.Counter = collections.Counter()
    examples = {}
    for path in tqdm(list(_paths(meta)), desc="fields", leave=False):
        for edit, value in edits.items():
            changed = copy.deepcopy(meta)
            node = changed
            for key in path[:-1]:
                node = node[key]
            if edit == "delete":
                node.pop(path[-1])
            else:
                node[path[-1]] = copy.deepcopy(value)
            folder = root / "edited"
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(root / "intact", folder)
            (folder / META_FILE).write_text(json.dumps(changed))
            stage = "load"
            try:
                loaded = Calibration.load(folder)
                stage = "use"
                use(loaded)
                outcome = "loaded and used"
            except CalibrationError:
                outcome = f"refused at {stage}"
            except Exception as err:  # what the fuzz looks for
                outcome = f"ESCAPED at {stage}: {type(err).__name__}"
                examples.setdefault(outcome, f"{'.'.join(map(str, path))} -> {edit}: {str(err)[:100]}")
            outcomes[outcome] += 1
    print(f"calibration JSON (version {meta['version']}): {sum(outcomes.values())} edits, {dict(outcomes)}")
    for outcome, example in examples.items():
        print(f"  {outcome}: {example}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("chunks", "calibration"))
    parser.add_argument("--legacy", action="store_true", help="calibration: as format version 4 (no JSON checksum)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.what == "chunks":
        fuzz_chunks()
    else:
        fuzz_calibration(args.legacy)


if __name__ == "__main__":
    main()
