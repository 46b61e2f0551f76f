"""Resealed-damage fuzz of the two loaders whose checksums a faulty writer can recompute (docs/lmcache.md,
docs/lossless.md "Model identity"): every failure must be the loader's documented error, never another
exception, and nothing may decode to other values.

- chunks: bits of the body bytes of three LMCache payloads (model-free with a guessed frame, model-free with a
  RoPE frame, calibrated) flipped, the payload CRC recomputed; each decode must raise `ChunkPayloadError` or give
  the chunk back bit for bit.
- calibration: fields of a tiny calibration's JSON (paths into ``model.config`` and ``model.identity`` left out)
  deleted or set to null, "x", -1, 10^12, [] or {}; each file is loaded and then used (a lossless cache with the
  ``context`` predictor, save / load, a calibrated chunk round trip, the model check), also with the JSON rewritten
  as format version 4 (no checksum of its own).

The whole fuzz (every bit of every byte, every field: a few minutes) is marked ``fuzz``: ``pytest -m fuzz
tests/test_fuzz_loaders.py``. The unmarked tests run a seeded sample of the same cases in seconds.
"""

from __future__ import annotations

import collections
import copy
import json
import random
import shutil
import struct
import warnings
import zlib

import pytest
import torch
from helpers import fresh_tiny_model, random_ids

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.calibration import META_FILE, Calibration, CalibrationError
from hf_kvcompress.errors import ChunkPayloadError
from hf_kvcompress.integrations.kv_chunk import HEADER, ChunkCoder

EDITS = {"delete": None, "null": None, "string": "x", "-1": -1, "10^12": 10**12, "[]": [], "{}": {}}
CHUNK_CASES = ("model-free, guessed frame", "model-free, RoPE frame", "calibrated")
#: (byte, bit) flips per payload and JSON fields of the quick (unmarked) tests
SAMPLE_FLIPS, SAMPLE_FIELDS = 48, 6


class Tally:
    """Outcomes of fuzz cases, with an example of each unexpected one (an exception the loader does not document)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.examples: dict[str, str] = {}

    def attempt(self, run, documented: type[Exception], refused: str, where: str) -> None:
        """``run()`` names its outcome; ``documented`` counts as ``refused``; any other exception escaped."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outcome = run()
        except documented:
            outcome = refused
        except Exception as err:  # what the fuzz looks for
            outcome = f"ESCAPED {type(err).__name__}"
            self.examples.setdefault(outcome, f"{where}: {str(err)[:100]}")
        if outcome == "WRONG CHUNK":
            self.examples.setdefault(outcome, where)
        self.counts[outcome] += 1

    def check(self, expected: set[str]) -> None:
        unexpected = {k: v for k, v in self.counts.items() if k not in expected}
        assert not unexpected, f"{dict(self.counts)}; examples: {self.examples}"


@pytest.fixture(scope="module")
def model():
    return fresh_tiny_model("llama-gqa", torch.bfloat16)


@pytest.fixture(scope="module")
def calibration(model):
    return Calibration.fit(model, None, ids=random_ids(1, 256, seed=4), tokens=256, chunk=128,
                           predictors=("none", "context"), progress=False)


def prefill(model, cache, tokens: torch.Tensor):
    with torch.inference_mode():
        model(tokens, cache=cache, use_cache=True)
    return cache


def as_chunk(cache) -> torch.Tensor:
    """The cache's K/V in LMCache's ``[2, layers, tokens, kv_heads * head_dim]`` layout."""
    return torch.stack([torch.stack([getattr(layer, kind)[0].transpose(0, 1).reshape(layer.keys.shape[2], -1)
                                     for layer in cache.layers]) for kind in ("keys", "values")])


def flipped(payload: bytes, byte: int, bit: int) -> bytes:
    """One bit flipped, the payload CRC (the header's last field) recomputed as a faulty writer would."""
    damaged = bytearray(payload)
    damaged[byte] ^= 1 << bit
    crc = zlib.crc32(damaged[HEADER.size :], zlib.crc32(damaged[: HEADER.size - 4]))
    struct.pack_into("<I", damaged, HEADER.size - 4, crc)
    return bytes(damaged)


def fuzz_chunk(model, calibration, case: str, sample: int | None) -> None:
    chunk = as_chunk(prefill(model, CompressedCache(CompressionConfig(mode="none")), random_ids(1, 32, seed=3)))
    coder, kwargs = {
        "model-free, guessed frame": (ChunkCoder(), {}),
        "model-free, RoPE frame": (ChunkCoder(rope=calibration.rope_frame(), kv_heads=2, head_dim=16), {}),
        "calibrated": (ChunkCoder(calibration), {"first_position": 0}),
    }[case]
    payload = coder.encode(chunk, **kwargs)
    flips = [(i, bit) for i in range(HEADER.size, len(payload)) for bit in range(8)]
    if sample is not None:
        flips = random.Random(0).sample(flips, min(sample, len(flips)))
    tally = Tally()
    for i, bit in flips:
        def run(i=i, bit=bit) -> str:
            same = torch.equal(coder.decode(flipped(payload, i, bit)).view(torch.int16), chunk.view(torch.int16))
            return "exact" if same else "WRONG CHUNK"

        tally.attempt(run, ChunkPayloadError, "refused", f"byte {i}, bit {bit}")
    tally.check({"exact", "refused"})


def json_paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key)
            if prefix[:2] not in (("model", "config"), ("model", "identity")):
                yield from json_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:3]):
            yield (*prefix, index)
            yield from json_paths(value, (*prefix, index))


def fuzz_calibration(model, calibration, root, legacy: bool, sample: int | None) -> None:
    calibration.save(root / "intact")
    meta = json.loads((root / "intact" / META_FILE).read_text())
    if legacy:
        meta["version"] = 4
        del meta["meta_sha256"]
    tokens = random_ids(1, 80, seed=3)

    def use(loaded: Calibration) -> None:
        config = CompressionConfig(mode="lossless", block_tokens=32, lossless=LosslessConfig(predictor="context"))
        cache = prefill(model, CompressedCache(config, calibration=loaded), tokens)
        path = cache.save(root / "x.kvc")
        CompressedCache.load(path, calibration=loaded)
        coder = ChunkCoder(loaded)
        coder.decode(coder.encode(as_chunk(cache), first_position=0))
        loaded.check_model(model)

    paths = list(json_paths(meta))
    if sample is not None:
        paths = random.Random(0).sample(paths, min(sample, len(paths)))
    tally = Tally()
    for path in paths:
        for edit, value in EDITS.items():
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
    tally.check({"refused at load", "refused at use", "loaded and used"})


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_resealed_chunk_sample(model, calibration, case):
    fuzz_chunk(model, calibration, case, SAMPLE_FLIPS)


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "version-4"])
def test_edited_calibration_sample(model, calibration, tmp_path, legacy):
    fuzz_calibration(model, calibration, tmp_path, legacy, SAMPLE_FIELDS)


@pytest.mark.fuzz
@pytest.mark.parametrize("case", CHUNK_CASES)
def test_resealed_chunk_every_bit(model, calibration, case):
    fuzz_chunk(model, calibration, case, None)


@pytest.mark.fuzz
@pytest.mark.parametrize("legacy", [False, True], ids=["current", "version-4"])
def test_edited_calibration_every_field(model, calibration, tmp_path, legacy):
    fuzz_calibration(model, calibration, tmp_path, legacy, None)
