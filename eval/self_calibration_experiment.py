"""Issue 11, "the cache calibrates itself": what a lossless cache with no model and no calibration can learn
from its own sealed blocks, on SmolLM2's K/V of held-out text.

Three parts:

``--part sim``   candidate schemes, estimated with Gaussian code lengths (bits = -log2 of the density times
                 the bf16 bin width, clamped at 0.05; one quarter-octave std scale per stream and block, as the
                 cache's scale byte). Blocks of 128 tokens; block b of layer l may use every layer's blocks
                 before b (causal) and its own block one layer down. Side data and held maps are counted.
``--part bounds`` in-sample bounds (maps fitted on the tokens they code, nothing counted): where the bits
                 are, and what knowing the RoPE frame would be worth.
``--part cache`` the real thing: `CompressedCache(lossless, predictor=generic|framed|self)` without model or
                 calibration, filled with the first N tokens' K/V (N = --tokens), then every layer read once
                 (one generation step's decoding). Prints stored ``bits_per_scalar``, held bits per scalar
                 (8 * held_bytes / scalars, after that read) and the read's seconds (one thread).

    python eval/self_calibration_experiment.py [--part sim|cache|bounds|both] [--tokens 256,512,1024,2048,4096]
        [--sim-tokens 2048] [--out results/self_calibration.json]

K/V come from one forward pass over 4,096 held-out tokens (``token_ids(tok, 4096, split="evaluation")``);
shorter runs use its prefixes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from hf_kvcompress import CompressedCache, CompressionConfig
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors.rope import RopeFrame
from hf_kvcompress.predictors.runner import run_decoder
from hf_kvcompress_eval.env import walk_held_bytes

LN2 = math.log(2)
BLOCK = 128


def held_out_kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SmolLM2 keys and values ``[layers, kv_heads, tokens, head_dim]`` (bf16, keys post-RoPE as cached)."""
    model, tok = load_model()
    ids = torch.as_tensor(token_ids(tok, tokens, split="evaluation")).reshape(1, -1)[:, :tokens]
    cache, _ = run_decoder(model, ids)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys, values


# ---------------------------------------------------------------------- simulation


def code_bits(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-element bits of bf16 ``x`` (``[heads, tokens, dim]``) under N(mean, std), one std scale per head."""
    z2 = ((x - mean) / std).square()
    ms = z2.clamp(max=25).mean(dim=(-1, -2), keepdim=True)
    std = std * torch.exp2(torch.round(2 * torch.log2(ms)).clamp(-32, 63) / 4)
    z = (x - mean) / std
    ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)
    return (0.5 * z.square() / LN2 + torch.log2(std * math.sqrt(2 * math.pi) / ulp)).clamp(min=0.05)


def block_stat_bits(x: torch.Tensor) -> float:
    """`generic`: the block's channel mean and std as bf16 side data (32 bits per channel)."""
    m = x.mean(dim=1, keepdim=True).bfloat16().float()
    s = x.std(dim=1, keepdim=True, correction=0).clamp_min(1e-6).bfloat16().float()
    return float(code_bits(x, m, s).sum()) + 32.0 * x.shape[0] * x.shape[2]


def _complex(x: torch.Tensor, center: bool = False) -> torch.Tensor:
    """``[heads, tokens, dim]`` -> complex ``[dim/2, tokens, heads]`` (channel c + i * channel c + dim/2)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    if center:
        z = z - z.mean(dim=1, keepdim=True)
    return z.permute(2, 1, 0)


def _uncomplex(z: torch.Tensor) -> torch.Tensor:
    z = z.permute(2, 1, 0)
    return torch.cat([z.real, z.imag], dim=-1).float()


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0, 2).reshape(x.shape[1], -1).double()


def _ridge(gram: torch.Tensor, ridge: float, skip_first: bool) -> torch.Tensor:
    g = gram.clone()
    diag = g.diagonal(dim1=-2, dim2=-1).real.clamp_min(1e-12)
    if skip_first:
        diag = diag.clone()
        diag[..., 0] = 0
    return g + torch.diag_embed(ridge * diag).to(g.dtype)


def simulate(keys: torch.Tensor, values: torch.Tensor, scheme: str) -> dict:
    """Bits per scalar of one scheme (see `SCHEMES`), stored and with held maps (bf16) counted."""
    K, V = keys.float(), values.float()
    layers, heads, tokens, dim = K.shape
    blocks = tokens // BLOCK
    total = 0.0
    map_params = 0
    for layer in range(layers):
        z2_prev = None
        for b in range(blocks):
            t0, t1 = b * BLOCK, (b + 1) * BLOCK
            k, v = K[layer, :, t0:t1], V[layer, :, t0:t1]
            if scheme == "generic" or layer == 0 or b == 0:
                total += block_stat_bits(k) + block_stat_bits(v)
                continue
            # "self" (what predictors/selffit.py does) refits at epochs: 1, 2, 4, 8... blocks
            fit_blocks = 1 << (b.bit_length() - 1) if scheme == "self" else b
            n = fit_blocks * BLOCK
            # keys: complex maps from the layer below, per channel pair, fitted on blocks before
            center = scheme == "self"
            if center:
                below = K[layer - 1, :, :n].reshape(heads, fit_blocks, BLOCK, dim)
                below = (below - below.mean(2, keepdim=True)).reshape(heads, n, dim)
                own = K[layer, :, :n].reshape(heads, fit_blocks, BLOCK, dim)
                own = (own - own.mean(2, keepdim=True)).reshape(heads, n, dim)
            else:
                below, own = K[layer - 1, :, :n], K[layer, :, :n]
            f, y = _complex(below), _complex(own)
            w = torch.linalg.solve(_ridge(f.mH @ f, 1e-2, False), f.mH @ y)
            fb = _complex(K[layer - 1, :, t0:t1], center=center)
            mean_k = _uncomplex(fb @ w)
            if center:
                mean_k = mean_k + k.mean(dim=1, keepdim=True).bfloat16().float()
                resid = _uncomplex(y - f @ w)
                sig_k = resid.square().mean(dim=1, keepdim=True)
                half = dim // 2
                sig_k = ((sig_k[..., :half] + sig_k[..., half:]) / 2).sqrt()
                sig_k = torch.cat([sig_k, sig_k], dim=-1).clamp_min(1e-6)
                total += block_stat_bits(v) + float(code_bits(k, mean_k, sig_k).sum()) + 32.0 * heads * dim
                continue
            sig_k = _uncomplex(y - f @ w).std(dim=1, keepdim=True, correction=0).clamp_min(1e-6)
            # values: ridge from [1, V below] (optionally rank-reduced), fitted on blocks before
            x_all = _flat(V[layer - 1, :, :n])
            if scheme.startswith("rank"):
                rank = int(scheme[4:])
                mu = x_all.mean(0)
                _, vecs = torch.linalg.eigh((x_all - mu).T @ (x_all - mu))
                proj = vecs[:, -rank:]

                def feats(x, mu=mu, proj=proj):
                    return torch.cat([torch.ones(x.shape[0], 1, dtype=torch.float64), (x - mu) @ proj], 1)
            else:
                def feats(x):
                    return torch.cat([torch.ones(x.shape[0], 1, dtype=torch.float64), x], 1)
            fv = feats(x_all)
            yv = _flat(V[layer, :, :n])
            wv = torch.linalg.solve(_ridge(fv.T @ fv, 1e-1, True), fv.T @ yv)
            sig_v = (yv - fv @ wv).std(0, correction=0).float().clamp_min(1e-6).reshape(heads, 1, dim)
            mean_v = (feats(_flat(V[layer - 1, :, t0:t1])) @ wv).float().reshape(BLOCK, heads, dim).permute(1, 0, 2)
            if scheme.endswith("+surprise") and z2_prev is not None:
                scale = z2_prev.sqrt().clamp(0.25, 8.0).pow(0.5)[None, :, None]
                sig_k, sig_v = sig_k * scale, sig_v * scale
            total += float(code_bits(k, mean_k, sig_k).sum()) + float(code_bits(v, mean_v, sig_v).sum())
            if b == blocks - 1:
                map_params += w.numel() * 2 + wv.numel() + (proj.numel() if scheme.startswith("rank") else 0)
    scalars = 2 * K.numel()
    stored = total / scalars
    return {"scheme": scheme, "tokens": tokens, "stored_bits": round(stored, 3),
            "held_map_bits_bf16": round(16.0 * map_params / scalars, 3),
            "note": SCHEMES[scheme]}


SCHEMES = {
    "generic": "per-block channel mean/std as bf16 side data (today's in-generation default)",
    "self": "generic + centered complex key maps from the layer below, refitted at 128*2^k tokens (implemented)",
    "allprev": "keys: complex maps from the layer below; values: ridge from V below; refitted every block",
    "rank16": "as allprev, values through the top-16 principal directions of V below",
    "rank48": "as allprev, values through the top-48 principal directions of V below",
}


def in_sample_bound(keys: torch.Tensor, values: torch.Tensor, frame_theta: float | None, inter_head: bool) -> float:
    """Bits per scalar when each stream's linear map (features: [1, K_{l-1}, V_{l-1}], plus the layer's earlier
    heads with ``inter_head``) is fitted on the very tokens it codes: no causality, no map cost, per-channel
    sigma; layer 0 coded against the constant only. ``frame_theta``: un-rotate keys with RoPE of that base
    (SmolLM2: 100000; a model-free cache does not know it), None: keys as cached."""
    K, V = keys.float(), values.float()
    layers, heads, tokens, dim = K.shape
    positions = torch.arange(tokens)
    if frame_theta is None:
        frame, framed = None, K
    else:
        frame = RopeFrame(1.0 / (frame_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))
        framed = torch.stack([frame.unrotate(K[layer][None], positions)[0] for layer in range(layers)])
    total = 0.0
    for layer in range(layers):
        base = [torch.ones(tokens, 1, dtype=torch.float64)]
        if layer > 0:
            base += [_flat(framed[layer - 1]), _flat(V[layer - 1])]
        for kind in ("k", "v"):
            for head in range(heads):
                own = []
                if inter_head:
                    own = [framed[layer, h].double() for h in range(head if kind == "k" else heads)]
                    own += [V[layer, h].double() for h in range(head)] if kind == "v" else []
                f = torch.cat(base + own, 1)
                y = (framed if kind == "k" else V)[layer, head].double()
                w = torch.linalg.solve(_ridge(f.T @ f, 1e-3, True), f.T @ y)
                mean = f @ w
                sigma = (y - mean).std(0, correction=0).clamp_min(1e-6)
                if kind == "k" and frame is not None:
                    mean = frame.rotate(mean.float()[None], positions)[0]
                    std = frame.rotate_variance(sigma.float().square().expand(tokens, -1), positions).sqrt()
                else:
                    mean, std = mean.float(), sigma.float().expand(tokens, -1)
                x = (K if kind == "k" else V)[layer, head]
                ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)
                z = (x - mean) / std
                bits = (0.5 * z.square() / LN2 + torch.log2(std * math.sqrt(2 * math.pi) / ulp)).clamp(min=0.05)
                total += float(bits.sum())
    return total / (2 * K.numel())


def run_bounds(keys, values, tokens: int) -> list[dict]:
    out = []
    for theta in (None, 100000.0):
        for inter in (False, True):
            row = {"tokens": tokens, "keys_frame": "cached (post-RoPE)" if theta is None else f"pre-RoPE, base {theta:g}",
                   "features": "layer below" + (" + earlier heads of the layer" if inter else ""),
                   "in_sample_bits": round(in_sample_bound(keys[:, :, :tokens], values[:, :, :tokens], theta, inter), 3)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def run_sim(keys, values, tokens: int) -> list[dict]:
    out = []
    for scheme in SCHEMES:
        t = time.time()
        row = simulate(keys[:, :, :tokens], values[:, :, :tokens], scheme)
        row["seconds"] = round(time.time() - t, 1)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


# ---------------------------------------------------------------------- the cache itself


def run_cache(keys, values, token_counts: list[int], predictors=("generic", "framed", "self")) -> list[dict]:
    out = []
    torch.set_num_threads(1)
    for tokens in token_counts:
        for name in predictors:
            cache = CompressedCache(CompressionConfig(mode="lossless", lossless={"predictor": name}))
            t = time.time()
            for layer in range(keys.shape[0]):
                cache.update(keys[layer, :, :tokens][None].clone(), values[layer, :, :tokens][None].clone(), layer)
            fill = time.time() - t
            exact = True
            for _ in range(2):  # two passes up the layers: the second is a generation step's decoding
                t = time.time()
                for layer in range(keys.shape[0]):
                    k, v = cache.layers[layer].keys, cache.layers[layer].values
                    exact = exact and torch.equal(k[0].view(torch.int16), keys[layer, :, :tokens].view(torch.int16))
                    exact = exact and torch.equal(v[0].view(torch.int16), values[layer, :, :tokens].view(torch.int16))
                read = time.time() - t
            stats = cache.stats(per_layer=True)
            scalars = sum(s["scalars"] for s in stats["per_layer"])
            row = {"predictor": name, "tokens": tokens, "bits_per_scalar": round(stats["bits_per_scalar"], 3),
                   "held_bits_per_scalar": round(8.0 * stats["held_bytes"] / scalars, 3),
                   "decoded_and_state_bytes": stats["decoded_bytes"],
                   "predictor_state_bytes": sum(t.numel() * t.element_size()
                                                for t in cache.lossless.predictor.state_tensors()),
                   "held_bytes": stats["held_bytes"], "walked_bytes": walk_held_bytes(cache),
                   "fill_s": round(fill, 2), "read_all_layers_s": round(read, 2), "exact": exact}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("sim", "cache", "bounds", "both"), default="both")
    parser.add_argument("--tokens", default="256,512,1024,2048,4096")
    parser.add_argument("--sim-tokens", type=int, default=2048)
    parser.add_argument("--out", default="results/self_calibration.json")
    args = parser.parse_args()
    counts = [int(x) for x in args.tokens.split(",")]
    keys, values = held_out_kv(max([*counts, args.sim_tokens]))
    result = {}
    if args.part in ("sim", "both"):
        result["simulation"] = run_sim(keys, values, args.sim_tokens)
    if args.part == "bounds":
        result["in_sample_bounds"] = run_bounds(keys, values, args.sim_tokens)
    if args.part in ("cache", "both"):
        result["cache"] = run_cache(keys, values, counts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    if out.exists():  # parts run separately land in one file
        result = {**json.loads(out.read_text()), **result}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
