"""Calibrated storage is the same bytes everywhere (issue 48): a `grid` file and a `grid` LMCache chunk written here
(two torch threads, this CPU's kernels) and written in a subprocess under one thread, ``ATEN_CPU_CAPABILITY=default``
(what another CPU computes) and oneDNN off are byte for byte the same, and each side decodes the other's bit for bit.
No model in the subprocess (its random initialisation is no part of the claim): the K/V and the calibration travel
as files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers import fresh_tiny_model, random_ids, same_bits, tiny_calibration
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.cache.persist import read_header
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.integrations.kv_chunk import MODE_GRID, ChunkCoder, parse_header

ROOT = Path(__file__).resolve().parents[2]
CONFIG = CompressionConfig(mode="lossless", block_tokens=16)

# the writer and reader both sides run: fill a model-free cache from the K/V file, save it calibrated (the default
# save), code the chunk, then decode what the other side wrote
SIDE = """
import sys, torch
from safetensors.torch import load_file
from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.integrations.kv_chunk import ChunkCoder

def write(folder):
    kv = load_file(f"{folder}/kv.safetensors")
    cal = Calibration.load(f"{folder}/cal")
    cache = CompressedCache(CompressionConfig(mode="lossless", block_tokens=16), calibration=cal)
    layers = len(kv) // 2
    for i in range(layers):
        cache.update(kv[f"k{i}"], kv[f"v{i}"], i)
    return cache.save(f"{folder}/{sys.argv[2]}.kvc"), ChunkCoder(cal).encode(kv["chunk"], first_position=0)

folder = sys.argv[1]
if sys.argv[3] == "1":
    torch.set_num_threads(1)
with torch.backends.mkldnn.flags(enabled=sys.argv[4] == "1"):
    _, payload = write(folder)
open(f"{folder}/{sys.argv[2]}.chunk", "wb").write(payload)
"""


def _side(folder: Path, name: str, threads: int, onednn: bool, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-c", SIDE, str(folder), name, str(threads), str(int(onednn))], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=folder, timeout=300)


def test_a_grid_file_and_chunk_are_the_same_bytes_under_any_threads_cpu_kernels_and_matrix_paths(tmp_path):
    model = fresh_tiny_model("llama-gqa", torch.bfloat16, layers=6)
    cal = tiny_calibration(model, 256)
    cal.save(tmp_path / "cal")
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(random_ids(1, 72, seed=11), cache=reference)
    kv = {}
    for i, layer in enumerate(reference.layers):
        kv[f"k{i}"], kv[f"v{i}"] = layer.keys.contiguous(), layer.values.contiguous()
    k, v = (torch.stack([getattr(layer, name)[0, :, :64] for layer in reference.layers]) for name in ("keys", "values"))
    kv["chunk"] = torch.stack([t.transpose(1, 2).reshape(6, 64, -1) for t in (k, v)]).contiguous()  # [2, L, T, H*D]
    save_file(kv, str(tmp_path / "kv.safetensors"))
    _side(tmp_path, "here", 2, True, {})
    _side(tmp_path, "there", 1, False, {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"})

    here, there = (tmp_path / "here.kvc").read_bytes(), (tmp_path / "there.kvc").read_bytes()
    assert read_header(tmp_path / "here.kvc")["predictor"]["name"] == "grid"
    assert here == there
    assert (tmp_path / "here.chunk").read_bytes() == (tmp_path / "there.chunk").read_bytes()
    payload = (tmp_path / "there.chunk").read_bytes()
    assert parse_header(payload).mode == MODE_GRID
    loaded_cal = Calibration.load(tmp_path / "cal")
    stored = load_file(str(tmp_path / "kv.safetensors"))
    assert same_bits(ChunkCoder(loaded_cal).decode(payload), stored["chunk"])
    loaded = CompressedCache.load(tmp_path / "there.kvc", calibration=loaded_cal)
    for i, layer in enumerate(loaded.kv_layers()):
        assert same_bits(layer.keys, stored[f"k{i}"]) and same_bits(layer.values, stored[f"v{i}"])
