"""Benchmark the LMCache serde on real SmolLM2-135M KV chunks (docs/lmcache.md).

Prefills ``--tokens`` held-out Shakespeare tokens (evaluation split) with the embedded SmolLM2-135M-Instruct
(bf16), cuts the KV into LMCache chunks ``[2, 30 layers, 256 tokens, 3 kv heads x 64]`` (``KV_2LTD``, 5.90 MB
raw each) and runs every chunk through LMCache's own serde processors (``create_serde_processor``: submit,
then poll, as the L2 adapter wrapper does):

- ``naive``: no serde (LMCache stores the raw chunk; the copy into the transfer buffer is timed);
- ``fp8``: LMCache's built-in lossy fp8 serde (error reported);
- CacheGen (lossy): LMCache's own CacheGen encode / decode functions with its 7B/8B bin layout (K: 32 bins in
  the first third of the layers, 16 after; V: 32 bins in the first 2 layers, 16 after). Its size is that of
  LMCache's serialised encoder output; the decode runs from the encoder's in-memory output (LMCache reads
  those bytes back with pickle, which this project never loads);
- ``hf_kvcompress`` model-free: per-chunk statistics (no kwargs), and with the model's config (shape check,
  keys in a relative RoPE frame);
- ``hf_kvcompress`` with a calibration: the ``context`` predictor. ``--calibration DIR`` uses a saved one;
  otherwise a ``context``-only calibration is fitted on ``--calib-tokens`` tokens of the calibration split
  (disjoint from the coded text) and saved under ``--out``.

Reports bits per scalar, ratio, encode / decode seconds per chunk and MB/s (raw MB over wall seconds, one
torch thread), whether the lossy rows are exact and their error, and, for a 1 GB/s disk, the read time a
chunk's compression saves against the time its decode costs. Also measures the ``pad_to_estimate``
workaround for LMCache 0.5.6's ``fs`` adapter: a padded file's apparent size and the blocks it occupies after
``fallocate --dig-holes``.

Usage: ``hf-kvcompress bench lmcache [--tokens 1024] [--calibration DIR] [--calib-tokens 16384]
[--out DIR]`` (``LMCACHE_TRACK_USAGE=false`` is set unless given). Writes report.md and results.json. Needs the ``lmcache`` install (docs/lmcache.md); ~15 min on
2 busy cores with the default calibration fit (~1 min per chunk for all rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch

from hf_kvcompress.calibration import Calibration
from hf_kvcompress.integrations.kv_chunk import (
    MODE_NAMES,
    ChunkCoder,
    estimate_first_position,
    max_payload_bytes,
)
from hf_kvcompress.predictors.rerun import run_decoder

from .common import Workload, out_folder, workload

CHUNK_TOKENS = 256  # LMCache's default --chunk-size
DISK_BYTES_PER_S = 1e9  # the reference disk
TEXT_OFFSET = 2000  # tokens into the evaluation split (as the tests' Shakespeare prompt)


def model_chunks(work: Workload, tokens: int) -> list[torch.Tensor]:
    """The KV of ``tokens`` evaluation tokens as ``[2, layers, 256, kv_heads * head_dim]`` chunks."""
    ids = work.ids(tokens, split="evaluation", offset=TEXT_OFFSET)
    cache, _ = run_decoder(work.model, ids)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, heads, tokens, dim]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    layers, heads, n, dim = keys.shape
    kv = torch.stack([keys, values]).permute(0, 1, 3, 2, 4).reshape(2, layers, n, heads * dim).cpu()
    return [kv[:, :, s : s + CHUNK_TOKENS].contiguous() for s in range(0, n - CHUNK_TOKENS + 1, CHUNK_TOKENS)]


class Clock:
    """Wall and CPU seconds (this process, all threads) of a block. On a shared machine the CPU seconds are
    the stable figure: wall time there includes waiting for a core."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def wait(poll, fd: int):
    """LMCache's submit / event fd / query pattern: block on the fd (no busy polling), then query."""
    while True:
        result = poll()
        if result is not None:
            return result
        if select.select([fd], [], [], 1.0)[0]:
            os.read(fd, 8)


class Bench:
    """Runs chunks through LMCache serde processors on objects of a real L1 manager."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype):
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
        from lmcache.v1.distributed.l1_manager import L1Manager

        memory = L1MemoryManagerConfig(size_in_bytes=256 << 20, use_lazy=False, shm_name="")
        self.l1 = L1Manager(L1ManagerConfig(memory_config=memory))
        self.shape, self.dtype = shape, dtype
        self.layout = MemoryLayoutDesc([shape], [dtype])
        self.count = 0
        self.held: list = []  # the ObjectKeys of this run

    def _objs(self, layout):
        from lmcache.v1.distributed.api import ObjectKey

        self.count += 1
        k = ObjectKey(chunk_hash=self.count.to_bytes(8, "little"), model_name="bench", kv_rank=0)
        result = self.l1.reserve_write([k], [True], layout, tag="bench")[k]
        if result[1] is None:
            raise RuntimeError(f"L1 reservation failed: {result[0]}")
        self.held.append(k)
        return k, result[1]

    def release(self) -> None:
        """Give the run's L1 objects back (the wrapper does this after each task)."""
        if self.held:
            self.l1.finish_write_and_delete(self.held, tag="bench")
        self.held = []

    def serde(self, kwargs_type: str, kwargs: dict, chunk: torch.Tensor) -> dict:
        from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, serialized_layout_desc

        processor = create_serde_processor(SerdeConfig(type=kwargs_type, kwargs=kwargs))
        try:
            k, src = self._objs(self.layout)
            src.tensor.copy_(chunk)
            _, temp = self._objs(serialized_layout_desc(self.layout, processor))
            with Clock() as enc:
                task = processor.submit_serialize([src], [temp], [k])
                ok = wait(lambda: processor.query_serialize_result(task), processor.get_serialize_event_fd())
            _, dst = self._objs(self.layout)
            dst.tensor.fill_(0)
            with Clock() as dec:
                task = processor.submit_deserialize([temp], [dst], [k])
                ok = ok and wait(lambda: processor.query_deserialize_result(task), processor.get_deserialize_event_fd())
            if not ok:
                raise RuntimeError(f"serde {kwargs_type} failed (see the LMCache log above)")
            return {"bytes": temp.get_size(), "encode_s": enc.wall, "decode_s": dec.wall, "encode_cpu_s": enc.cpu,
                    "decode_cpu_s": dec.cpu, "decoded": dst.tensor.clone()}
        finally:
            processor.close()
            self.release()

    def naive(self, chunk: torch.Tensor) -> dict:
        _, src = self._objs(self.layout)
        _, dst = self._objs(self.layout)
        with Clock() as enc:
            src.tensor.copy_(chunk)
        with Clock() as dec:
            dst.tensor.copy_(src.tensor)
        out = {"bytes": src.get_size(), "encode_s": enc.wall, "decode_s": dec.wall, "encode_cpu_s": enc.cpu,
               "decode_cpu_s": dec.cpu, "decoded": dst.tensor.clone()}
        self.release()
        return out

    def close(self) -> None:
        self.l1.close()


def cachegen(chunk: torch.Tensor, kv_heads: int, head_dim: int) -> dict:
    """LMCache's CacheGen codec on one chunk (see module docstring)."""
    import pickle  # only to measure the size of what LMCache stores (dumps; nothing is ever loaded)

    from lmcache.storage_backend.serde.cachegen_decoder import decode_function_gpu, do_dequantize
    from lmcache.storage_backend.serde.cachegen_encoder import encode_function
    from lmcache.v1.storage_backend.naive_serde.cachegen_basics import CacheGenConfig, QuantizationSpec

    layers, tokens = chunk.shape[1], chunk.shape[2]
    third = max(1, layers * 10 // 32)  # CacheGen's 7B/8B layout: 10 of 32 layers at 32 bins for keys
    config = CacheGenConfig(nlayers=layers,
                            kspecs=[QuantizationSpec(0, third, 32), QuantizationSpec(third, layers, 16)],
                            vspecs=[QuantizationSpec(0, 2, 32), QuantizationSpec(2, layers, 16)])
    key_bins, value_bins = torch.zeros(layers), torch.zeros(layers)
    key_bins[:third], key_bins[third:], value_bins[:2], value_bins[2:] = 32, 16, 32, 16
    with Clock() as enc:
        five = chunk.reshape(2, layers, tokens, kv_heads, head_dim).permute(1, 0, 2, 3, 4)
        output = encode_function(five, config, key_bins, value_bins, tokens)
        size = len(pickle.dumps(output))
    with Clock() as dec:
        buffer = torch.zeros((tokens, 2 * layers * kv_heads * head_dim), dtype=torch.uint8)
        key, value = decode_function_gpu(output.cdf, output.data_chunks, layers, tokens, buffer)
        key = do_dequantize(key, key_bins, output.max_tensors_key)
        value = do_dequantize(value, value_bins, output.max_tensors_value)
        decoded = torch.stack([key, value]).to(chunk.dtype)
    return {"bytes": size, "encode_s": enc.wall, "decode_s": dec.wall, "encode_cpu_s": enc.cpu,
            "decode_cpu_s": dec.cpu, "decoded": decoded}


def error_of(decoded: torch.Tensor, chunk: torch.Tensor) -> dict:
    exact = torch.equal(decoded.view(torch.int16), chunk.view(torch.int16))
    d, c = decoded.float(), chunk.float()
    rel = float((d - c).square().mean().sqrt() / c.square().mean().sqrt())
    return {"exact": exact, "rel_rms_error": rel, "max_abs_error": float((d - c).abs().max()),
            "elements_changed": float((decoded.view(torch.int16) != chunk.view(torch.int16)).float().mean())}


def padding_cost(payload: bytes, estimate: int, folder: Path) -> dict:
    """Apparent and allocated size of a payload zero-padded to ``estimate``, before and after punching holes."""
    path = folder / "padded.data"
    path.write_bytes(payload + bytes(estimate - len(payload)))
    out = {"payload_bytes": len(payload), "apparent_bytes": path.stat().st_size,
           "allocated_bytes": path.stat().st_blocks * 512}
    if shutil.which("fallocate"):
        subprocess.run(["fallocate", "--dig-holes", str(path)], check=True)
        out["allocated_after_dig_holes"] = path.stat().st_blocks * 512
    path.unlink()
    return out


def run(args: argparse.Namespace) -> int:
    from hf_kvcompress.errors import CliError

    try:
        from hf_kvcompress.integrations.lmcache import SERDE_NAME
    except ImportError as err:
        raise CliError(f"bench lmcache needs lmcache ({err}): see docs/lmcache.md") from err
    torch.set_num_threads(1)
    out = out_folder(args, "lmcache")
    work = workload(args.smoke)
    model = work.model
    chunks = model_chunks(work, args.tokens)
    text = model.config
    kv_heads, head_dim = text.num_key_value_heads, text.head_dim
    print(f"{len(chunks)} chunks of {tuple(chunks[0].shape)} {chunks[0].dtype}, "
          f"{chunks[0].numel() * 2 / 1e6:.2f} MB raw each")

    if args.calibration:
        cal_dir, calibration = Path(args.calibration), Calibration.load(args.calibration, model)
        cal_note = f"given ({calibration.meta['text']['tokens']} tokens)"
    else:
        t0 = time.perf_counter()
        calibration = work.fit_calibration(args.calib_tokens, min(1024, args.calib_tokens // 2), ("context",))
        cal_dir = calibration.save(out / "calibration")
        cal_note = f"fitted here: context only, {args.calib_tokens} tokens, {time.perf_counter() - t0:.0f} s"
    print(f"calibration: {cal_note}")
    config_dir = out / "model_config"
    model.config.save_pretrained(config_dir)

    ours = [
        ("hf_kvcompress, model-free (no options)", {}),
        ("hf_kvcompress, model-free + model config", {"model_config": str(config_dir)}),
        (f"hf_kvcompress, calibrated ({MODE_NAMES[ChunkCoder(calibration).mode].split(' ')[0]})",
         {"calibration": str(cal_dir)}),
    ]
    # compile the codec's kernels (numba, cached on disk after the first run) outside the timings
    for coder in (ChunkCoder(), ChunkCoder(calibration)):
        coder.decode(coder.encode(chunks[0]))
    bench = Bench(chunks[0].shape, chunks[0].dtype)
    rows: dict[str, list[dict]] = {}
    positions = []
    for index, chunk in enumerate(chunks):
        positions.append((index * CHUNK_TOKENS, estimate_first_position(chunk, calibration)))
        runs = [("naive (raw, LMCache default)", lambda c=chunk: bench.naive(c)),
                ("fp8 (LMCache serde, lossy)", lambda c=chunk: bench.serde("fp8", {}, c)),
                ("CacheGen (LMCache, lossy)", lambda c=chunk: cachegen(c, kv_heads, head_dim))]
        runs += [(name, lambda c=chunk, k=kwargs: bench.serde(SERDE_NAME, k, c)) for name, kwargs in ours]
        for name, run in runs:
            try:
                result = run()
            except Exception as err:  # a baseline that does not run here is reported, not fatal
                rows.setdefault(name, []).append({"error": f"{type(err).__name__}: {err}"})
                continue
            decoded = result.pop("decoded")
            rows.setdefault(name, []).append({**result, **error_of(decoded, chunk)})
            print(f"chunk {index} {name}: {result['bytes']} bytes, {result['encode_s']:.3f} s / "
                  f"{result['decode_s']:.3f} s", flush=True)
    bench.close()

    raw = chunks[0].numel() * 2
    table = []
    for name, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            table.append({"method": name, "error": runs[0]["error"]})
            continue
        n = len(ok)
        size = sum(r["bytes"] for r in ok) / n
        mean = {f: sum(r[f] for r in ok) / n for f in ("encode_s", "decode_s", "encode_cpu_s", "decode_cpu_s")}
        table.append({
            "method": name, "chunks": n, "bytes_per_chunk": size, "bits_per_scalar": 8 * size / chunks[0].numel(),
            "ratio": raw / size, **mean, "encode_mb_s": raw / 1e6 / max(mean["encode_cpu_s"], 1e-9),
            "decode_mb_s": raw / 1e6 / max(mean["decode_cpu_s"], 1e-9), "exact": all(r["exact"] for r in ok),
            "rel_rms_error": max(r["rel_rms_error"] for r in ok), "max_abs_error": max(r["max_abs_error"] for r in ok),
            "disk_read_saved_s": (raw - size) / DISK_BYTES_PER_S,
        })

    with tempfile.TemporaryDirectory() as tmp:
        payload = ChunkCoder(calibration).encode(chunks[0])
        padding = padding_cost(payload, max_payload_bytes(chunks[0].shape, chunks[0].dtype), Path(tmp))

    lines = [
        f"{work.name} bf16, {len(chunks)} chunks x 256 tokens (evaluation split), "
        f"{raw / 1e6:.2f} MB raw per chunk; 1 torch thread; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; calibration: {cal_note}",
        "",
        "CPU s: CPU seconds of this process per chunk (the stable figure on a shared machine); wall s beside it; "
        "MB/s: raw MB per CPU second; read saved: what reading the stored bytes instead of the raw chunk saves "
        "on a 1 GB/s disk.",
        "",
        "| method | bits/scalar | ratio | exact | rel. RMS error | encode CPU s (wall) | decode CPU s (wall) "
        "| encode MB/s | decode MB/s | read saved s |",
        "| :--- | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        if "error" in r:
            lines.append(f"| {r['method']} | does not run here: {r['error'][:80]} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['bits_per_scalar']:.3f} | {r['ratio']:.3f} | {'yes' if r['exact'] else 'no'} "
            f"| {r['rel_rms_error']:.2e} | {r['encode_cpu_s']:.3f} ({r['encode_s']:.2f}) "
            f"| {r['decode_cpu_s']:.3f} ({r['decode_s']:.2f}) | {r['encode_mb_s']:.1f} "
            f"| {r['decode_mb_s']:.1f} | {r['disk_read_saved_s']:.4f} |"
        )
    lines += ["", f"first-position estimates (true, estimated): {positions}",
              f"pad_to_estimate on {tempfile.gettempdir()}: {padding}"]
    report = "\n".join(lines)
    print(report)
    (out / "report.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps({
        "table": table, "per_chunk": rows, "positions": positions, "padding": padding, "calibration": cal_note,
        "torch": torch.__version__, "machine": platform.platform(), "args": vars(args),
    }, indent=1))
    print(f"\nwrote {out / 'report.md'} and {out / 'results.json'}")
    return 0

