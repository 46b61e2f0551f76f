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


class _Tally:
    """Outcomes of fuzz cases, with an example of each unexpected one (an exception the loader does not document)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.examples: dict[str, str] = {}

    def attempt(self, run, documented: type[Exception], refused: str, where: str) -> None:
        """``run()`` names its outcome; ``documented`` counts as ``refused``; any other exception escaped."""
        try:
            outcome = run()
        except documented:
            outcome = refused
        except Exception as err:  # what the fuzz looks for
            outcome = f"ESCAPED {type(err).__name__}"
            self.examples.setdefault(outcome, f"{where}: {str(err)[:100]}")
        self.counts[outcome] += 1

    def total(self) -> int:
        return sum(self.counts.values())

    def report(self, title: str) -> None:
        print(f"{title}, {dict(self.counts)}")
        for outcome, example in self.examples.items():
            print(f"  {outcome}: {example}")


def _flipped(payload: bytes, byte: int, bit: int) -> bytes:
    """One bit flipped, the payload CRC (the header's last field) recomputed as a faulty writer would."""
    damaged = bytearray(payload)
    damaged[byte] ^= 1 << bit
    struct.pack_into("<I", damaged, HEADER.size - 4, zlib.crc32(damaged[HEADER.size :], zlib.crc32(damaged[: HEADER.size - 4])))
    return bytes(damaged)


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
        tally = _Tally()
        for i in tqdm(range(HEADER.size, len(payload)), desc=label, leave=False):
            for bit in range(8):
                def run(i=i, bit=bit, coder=coder, payload=payload) -> str:
                    same = torch.equal(coder.decode(_flipped(payload, i, bit)).view(torch.int16), chunk.view(torch.int16))
                    return "exact" if same else "WRONG CHUNK"

                tally.attempt(run, ChunkPayloadError, "refused", f"byte {i}, bit {bit}")
        tally.report(f"{label}: {len(payload)} bytes, {tally.total()} flips")


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
    tally = _Tally()
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

            def run(folder=folder) -> str:
                try:
                    loaded = Calibration.load(folder)
                except CalibrationError:
                    return "refused at load"
                use(loaded)
                return "loaded and used"

            tally.attempt(run, CalibrationError, "refused at use", f"{'.'.join(map(str, path))} -> {edit}")
    tally.report(f"calibration JSON (version {meta['version']}): {tally.total()} edits")


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
