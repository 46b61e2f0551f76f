"""What lossless mode saves on each model family: held bytes against DynamicCache's at 8k tokens.

Each family is its transformers default config (the layer pattern, sliding windows and layer count of a real
checkpoint) with tiny random-weight layers (hidden 64, 4 heads, 2 KV heads of 16 channels): the structure is
real, the K/V statistics are not, so the coded rate of the attention layers is a random model's. The table also
gives the structure alone: the share of DynamicCache's bytes that sit in layers this library codes (full
attention; sliding windows of at least `SLIDING_MIN_BLOCKS` blocks), which bounds what any codec saves there.

    python experiments/architecture_memory.py [--tokens 8192] [--families gemma3_text,gpt_oss] [--out results/arch_memory.json]
    python experiments/architecture_memory.py --windows 128,256,512,1024 --tokens 4096

``--windows`` measures where a sliding window starts to be worth coding: a tiny mistral (every layer sliding)
with each window, its windows coded (sealed blocks) and raw, held bytes and decode-step time of both against
DynamicCache's, the steps alternating between the three caches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

import hf_kvcompress.cache.cache as cache_module
from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.layer import CompressedLayer
from hf_kvcompress.layer.hybrid import state_bytes
from hf_kvcompress_eval.env import walk_held_bytes

SHRINK = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
#: per family: what its default config needs to build tiny (expert counts, mamba sizes), and the real layer
#: pattern where the default config does not give it
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "gemma2": {},
    "gemma3_text": {"sliding_window": 1024},  # Gemma 3 4B-27B: 1,024-token windows, 5 sliding : 1 full
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "cohere2": {},
    "exaone4": {},
    "qwen3_next": {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    # LFM2-1.2B: 16 layers, attention at these six, short convolutions elsewhere
    "lfm2": {"num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14]},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 1,
                  "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 16},
    "deepseek_v3": {"num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}


def build(family: str, tokens: int, dtype: torch.dtype):
    overrides = {**SHRINK, "max_position_embeddings": max(tokens + 64, 8192), **FAMILIES[family]}
    config = AutoConfig.for_model(family, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def measure(family: str, tokens: int, chunk: int, dtype: torch.dtype) -> dict:
    model = build(family, tokens, dtype)
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(CompressionConfig(mode="lossless"), model=model, calibration=None)
    start = time.perf_counter()
    with torch.no_grad():
        for at in range(0, tokens, chunk):  # chunked prefill: bounded attention buffers at 8k
            model(ids[:, at:at + chunk], cache=reference)
            model(ids[:, at:at + chunk], cache=cache)
    # DynamicCache's own tensors (its sliding layers keep a view of the last forward's states: the walk counts
    # the whole buffer behind it, which is what the process holds; the logical size is what it needs)
    dynamic = sum(t.numel() * t.element_size() for layer in reference.layers
                  for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
    dynamic += sum(state_bytes(layer) for layer in reference.layers if isinstance(layer, LinearAttentionCacheLayerMixin))
    stats = cache.stats(per_layer=True)
    coded = [s for s in stats["per_layer"] if isinstance(cache.layers[s["layer"]], CompressedLayer)
             and cache.layers[s["layer"]].seals]
    coded_raw = sum(s["raw_bytes"] for s in coded)
    coded_scalars = sum(s["scalars"] for s in coded)
    return {
        "family": family,
        "layers": len(cache.layers),
        "kinds": sorted({type(layer).__name__ for layer in cache.layers}),
        "dynamic_bytes": dynamic,
        "dynamic_walked_bytes": walk_held_bytes(reference),
        "held_bytes": stats["held_bytes"],
        "held_ratio": stats["held_bytes"] / dynamic,
        "coded_share": coded_raw / dynamic,
        "bits_per_scalar": 8 * sum(s["stored_bytes"] for s in coded) / coded_scalars if coded_scalars else None,
        "seconds": time.perf_counter() - start,
    }


def window_sweep(windows: list[int], tokens: int, chunk: int, steps: int = 9) -> None:
    """Coded against raw sliding windows: held bytes and step time per window (see the module docstring)."""
    print("| window | coded held / DynamicCache | raw held / DynamicCache | coded step / DynamicCache's | "
          "raw step / DynamicCache's |")
    print("|---|---|---|---|---|")
    for window in tqdm(windows, desc="windows"):
        FAMILIES["mistral"] = {"sliding_window": window}
        model = build("mistral", tokens, torch.bfloat16)
        ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
        caches = {"dynamic": DynamicCache(config=model.config)}
        for name, blocks in (("coded", 0), ("raw", 1 << 30)):
            cache_module.SLIDING_MIN_BLOCKS = blocks  # read when the cache builds its layers
            caches[name] = CompressedCache(CompressionConfig(mode="lossless"), model=model, calibration=None)
        cache_module.SLIDING_MIN_BLOCKS = 4
        times: dict[str, list[float]] = {name: [] for name in caches}
        with torch.no_grad():
            for at in range(0, tokens, chunk):
                for cache in caches.values():
                    model(ids[:, at:at + chunk], cache=cache)
            step = ids[:, -1:]
            for _ in range(steps):
                for name, cache in caches.items():
                    start = time.perf_counter()
                    model(step, cache=cache)
                    times[name].append(time.perf_counter() - start)
        dynamic = sum(t.numel() * t.element_size() for layer in caches["dynamic"].layers for t in (layer.keys,
                                                                                                    layer.values))
        base = statistics.median(times["dynamic"])
        held = {name: caches[name].stats()["held_bytes"] / dynamic for name in ("coded", "raw")}
        print(f"| {window} | {held['coded']:.3f} | {held['raw']:.3f} | {statistics.median(times['coded']) / base:.2f} "
              f"| {statistics.median(times['raw']) / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--windows", default=None, help="comma-separated sliding windows to sweep instead")
    args = parser.parse_args()
    if args.windows:
        window_sweep([int(w) for w in args.windows.split(",")], args.tokens, args.chunk)
        return
    rows = []
    for family in tqdm(args.families.split(","), desc="families"):
        try:
            rows.append(measure(family, args.tokens, args.chunk, getattr(torch, args.dtype)))
        except Exception as err:  # one family's failure is a row of the table, not the end of the run
            rows.append({"family": family, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"})
        row = rows[-1]
        tqdm.write(json.dumps(row))
    print(f"\n| family | layers | held / DynamicCache at {args.tokens} tokens | share of DynamicCache's bytes in "
          "coded layers | bits/scalar of coded layers | DynamicCache walked / logical |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['family']} | | {row['error']} | | | |")
        else:
            bits = "-" if row["bits_per_scalar"] is None else f"{row['bits_per_scalar']:.2f}"
            print(f"| {row['family']} | {row['layers']} | {row['held_ratio']:.3f} | {row['coded_share']:.3f} | "
                  f"{bits} | {row['dynamic_walked_bytes'] / row['dynamic_bytes']:.2f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
