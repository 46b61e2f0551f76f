"""Predictor rate / cost frontier (issue 10): bits per scalar of a 2,048-token SmolLM2 cache against what the
predictor costs per decoded scalar, for the in-generation candidates.

    python eval/predictor_frontier.py [--fit-tokens 8192] [--eval-tokens 2048] [--ranks 8,16,32,64,128]

Everything is measured: SmolLM2-135M bf16 K/V of held-out text (evaluation split) cut in blocks of 128 tokens
(generation's), every stream coded with the real ``lanes`` codec (`codec.encode_batch`, per-element or
per-channel statistics, the encoder's per-stream std scale `blockcoder.choose_scale`), decoded back
(`codec.decode_batch`, one call per layer as `generate()` does for independent streams) and compared bit for bit.
Rates count every byte a cache would hold for the block: the blobs (headers included), one scale byte per
stream and any side data (bf16). Variants:

- ``generic``: the library's per-block channel statistics (`predictors/generic.py`), the default now;
- ``none`` / ``context``: the library's calibrated predictors, fitted by `Calibration.fit` on the calibration
  text and run through their own `LinearSession` (stream by stream, as the cache decodes them);
- ``pca r``: the layer below's pre-RoPE K and V (384 features, standardised) projected on their first r
  principal directions (calibration text), then a ridge map to all six streams of the layer;
- ``rrr r``: reduced-rank ridge regression, the same rank-r factorisation ``[384, r] @ [r, 384]`` but with the
  r directions chosen for the targets (SVD of the whitened fitted values) rather than for the features;
- ``below1``: the full-rank (384) ridge map from the layer below, no inter-head features (the ceiling of both);
- ``rrrK r`` / ``below1K``: two phases per layer, each batched over the layer's blocks: the keys as ``rrr r`` /
  ``below1``, then the values from the layer below and this layer's (decoded, pre-RoPE) keys (576 features,
  rank r / full): ``context``'s strongest inter-head feature without its stream-by-stream order;

each low-rank / below1 variant with two spreads: ``/cal`` the per-channel residual std of the calibration fit
(no side data) or ``/blk`` the per-block per-channel std of the residual sent as bf16 side data (model-free).
Layer 0 has no layer below: those variants code it with ``generic``'s statistics.

Cost: predictor flops per decoded scalar counted from the shapes (a multiply-add is 2 flops), and measured
seconds of the predictor's mean and std for the whole cache on one thread (low-rank: batched per layer over
all 16 blocks, which the dependency allows since a layer reads only the layer below; ``context`` / ``none``:
the library's sessions, stream by stream, since a stream reads earlier heads of its layer), beside the
measured lanes decode of the same blocks. Writes ``results/predictor_frontier/{results.json, table.md,
frontier.png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hf_kvcompress import CompressedCache, CompressionConfig, LosslessConfig
from hf_kvcompress.blockcoder import choose_scale, scale_factor
from hf_kvcompress.calibration import Calibration
from hf_kvcompress.codec import decode_batch, encode_batch
from hf_kvcompress.data import token_ids
from hf_kvcompress.models import load_model
from hf_kvcompress.predictors.base import BlockInputs, LayerValues, stream_order
from hf_kvcompress.predictors.context import ContextPredictor
from hf_kvcompress.predictors.generic import BlockStatsSession, block_stats
from hf_kvcompress.predictors.linear import flat_heads
from hf_kvcompress.predictors.none import NoPredictor
from hf_kvcompress.predictors.rope import RopeFrame
from hf_kvcompress.predictors.runner import run_decoder

BLOCK = 128
RIDGE = 1e-3  # ridge penalty relative to the mean diagonal of the (standardised) Gram matrix


# ------------------------------------------------------------------------------------------ K/V capture


def capture(model, ids: torch.Tensor, chunk: int, frame: RopeFrame, desc: str,
            keep_kv: bool = True) -> list[dict[str, torch.Tensor]]:
    """Per layer: ``keys`` / ``values`` as cached (bf16, ``[1, heads, T, dim]``) and ``feat`` ``[T, 2*heads*dim]``
    float32, the pre-RoPE keys and the values flattened over heads (`FeatureBuilder`'s layout of a layer below)."""
    per_layer: list[dict[str, list]] = []
    for c in tqdm(range(ids.shape[1] // chunk), desc=desc):
        cache, _ = run_decoder(model, ids[:, c * chunk : (c + 1) * chunk])
        positions = torch.arange(chunk)
        for i, layer in enumerate(cache.layers):
            if len(per_layer) <= i:
                per_layer.append({"keys": [], "values": [], "feat": []})
            k, v = layer.keys.cpu(), layer.values.cpu()
            if keep_kv:
                per_layer[i]["keys"].append(k)
                per_layer[i]["values"].append(v)
            per_layer[i]["feat"].append(torch.cat([flat_heads(frame.unrotate(k, positions)), flat_heads(v)], -1)[0])
    return [{"keys": torch.cat(d["keys"], 2) if keep_kv else None,
             "values": torch.cat(d["values"], 2) if keep_kv else None, "feat": torch.cat(d["feat"], 0)}
            for d in per_layer]


# ------------------------------------------------------------------------------------------ low-rank fits


def ridge(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[n_feat + 1, out]`` (row 0 the bias) minimising ``|[1, x] w - y|^2 + RIDGE * mean diag * |w[1:]|^2``."""
    x1 = torch.cat([torch.ones(x.shape[0], 1, dtype=x.dtype), x], 1)
    gram = x1.T @ x1
    pen = RIDGE * gram.diagonal()[1:].mean()
    gram[1:, 1:] += pen * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x1.T @ y)


def top_directions(x: torch.Tensor) -> torch.Tensor:
    """Principal directions of the rows of ``x`` ``[T, n]`` as rows ``[n, n]``, largest variance first (the
    eigenvectors of the covariance: the right singular vectors of the centred ``x``)."""
    centred = x - x.mean(0)
    _, vectors = torch.linalg.eigh(centred.T @ centred)
    return vectors.flip(1).T


def fit_layer(below: torch.Tensor, target: torch.Tensor, ranks: list[int]) -> dict[str, dict]:
    """Fits of one layer from the layer below's features (both ``[T, 384]`` float32): per variant the factors
    ``mu``/``sd`` (feature standardisation), ``a`` ``[384, r]``, ``b`` ``[r + 1, 384]`` (mean = [1, z a] b) or
    ``w`` ``[385, 384]`` (full rank), and ``sigma`` (the per-channel residual std of the fit)."""
    x = below.double()
    y = target.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd
    out: dict[str, dict] = {}

    def finish(name, mean, params):
        params.update(mu=mu.float(), sd=sd.float(), sigma=(y - mean).square().mean(0).sqrt().clamp_min(1e-6).float())
        out[name] = params

    w = ridge(z, y)
    full = torch.cat([torch.ones(len(z), 1, dtype=z.dtype), z], 1) @ w
    finish("below1", full, {"w": w.float()})
    # principal directions of the standardised features
    vh = top_directions(z)
    # reduced rank: whiten the targets by the full fit's residual std, take the top directions of the fitted values
    res_sd = (y - full).std(0).clamp_min(1e-6)
    oh = top_directions(full / res_sd)
    w_z = w[1:] / res_sd  # [384, 384] in whitened target space
    for r in ranks:
        a = vh[:r].T.contiguous()
        b = ridge(z @ a, y)
        finish(f"pca {r}", torch.cat([torch.ones(len(z), 1, dtype=z.dtype), z @ a], 1) @ b, {"a": a.float(), "b": b.float()})
        # rank-r map: z -> z (w_z o_r) -> o_r^T * res_sd; the bias refitted by the (centred) mean
        o_r = oh[:r].T  # [384, r] in whitened output space
        a2 = w_z @ o_r  # [384, r]
        proj = z @ a2
        b2 = ridge(proj, y)  # refit the r -> 384 map and the bias by least squares (same shapes)
        finish(f"rrr {r}", torch.cat([torch.ones(len(z), 1, dtype=z.dtype), proj], 1) @ b2, {"a": a2.float(), "b": b2.float()})
    # two phases: keys from the layer below as above, then values from the layer below and this layer's keys
    half = y.shape[1] // 2
    values_from = fit_layer_rrr(torch.cat([below, target[:, :half]], 1), target[:, half:], ranks)
    for name, v in values_from.items():
        k_name = "below1" if name == "full" else f"rrr {name}"
        k = {key: (t[:, :half] if key in ("w", "b") else t[:half] if key == "sigma" else t)
             for key, t in out[k_name].items()}
        out["below1K" if name == "full" else f"rrrK {name}"] = {"k": k, "v": v, "sigma": torch.cat([k["sigma"], v["sigma"]])}
    return out


def fit_layer_rrr(below: torch.Tensor, target: torch.Tensor, ranks: list[int]) -> dict[str, dict]:
    """Full-rank ridge (``full``) and reduced-rank ridge maps (``r``) of ``target`` on ``below`` (as in
    `fit_layer`)."""
    x, y = below.double(), target.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd
    ones = torch.ones(len(z), 1, dtype=z.dtype)

    def params(mean, **factors):
        sigma = (y - mean).square().mean(0).sqrt().clamp_min(1e-6)
        return {**{k: t.float() for k, t in factors.items()}, "mu": mu.float(), "sd": sd.float(), "sigma": sigma.float()}

    w = ridge(z, y)
    full = torch.cat([ones, z], 1) @ w
    out = {"full": params(full, w=w)}
    res_sd = (y - full).std(0).clamp_min(1e-6)
    oh = top_directions(full / res_sd)
    for r in ranks:
        a = (w[1:] / res_sd) @ oh[:r].T
        b = ridge(z @ a, y)
        out[str(r)] = params(torch.cat([ones, z @ a], 1) @ b, a=a, b=b)
    return out


def lowrank_mean(params: dict, feat: torch.Tensor, own_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Predicted ``[T, 384]`` pre-RoPE K / V of a layer from the layer below's features ``[T, 384]`` (two-phase
    variants: the values also from this layer's decoded pre-RoPE keys ``own_keys`` ``[T, 192]``)."""
    if "k" in params:
        return torch.cat([lowrank_mean(params["k"], feat), lowrank_mean(params["v"], torch.cat([feat, own_keys], 1))], 1)
    z = (feat - params["mu"]) / params["sd"]
    if "w" in params:
        return torch.addmm(params["w"][0], z, params["w"][1:])
    return torch.addmm(params["b"][0], z @ params["a"], params["b"][1:])


def flops_lowrank(name: str, width: int) -> float:
    """Flops per decoded scalar of a low-rank variant (layer >= 1): standardise (2 per feature), project
    (``width * r`` multiply-adds per token), map (``r * width``) and add the bias, shared by ``width`` scalars per
    token; keys also rotate back (~3 flops per key scalar: half the scalars). The unrotation of the layer below's
    keys is counted too (3 per key feature)."""
    half = width // 2
    if name == "below1":
        macs = width * width
    elif name == "below1K":  # keys: 384 -> 192; values: 576 -> 192
        macs = width * half + (width + half) * half
    elif name.startswith("rrrK"):
        r = int(name.split()[1])
        macs = (width * r + r * half) + ((width + half) * r + r * half)
    else:
        r = int(name.split()[1])
        macs = 2 * width * r
    standardise = 2 * width + (2 * (width + half) if "K" in name.split()[0] else 0)
    per_token = 2 * macs + width + standardise + 3 * half + 3 * half + (3 * half if "K" in name.split()[0] else 0)
    return per_token / width


def flops_context(cal: Calibration, name: str, layers: int, heads: int) -> tuple[float, float]:
    """Mean flops per scalar of a library-fitted head set over layers >= 1 and over all layers (2 per feature of
    each stream's weight: the feature count is the weight's rows)."""
    per_layer = []
    for layer in range(layers):
        rows = [cal.stream_heads(name, layer)[s].weight.shape[0] for s in stream_order(heads)]
        per_layer.append(2.0 * sum(rows) / len(rows))
    return sum(per_layer[1:]) / (layers - 1), sum(per_layer) / layers


# ------------------------------------------------------------------------------------------ coding


def code_layer(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, config) -> dict:
    """Code ``x`` ``[N, dim, tokens]`` bf16 (N streams) under mean / std (broadcastable to it), with the encoder's
    per-stream std scale; decode back (timed) and check the bits."""
    scales = [choose_scale(x[i].float(), mean[min(i, mean.shape[0] - 1)], std[min(i, std.shape[0] - 1)])
              for i in range(x.shape[0])]
    factors = torch.tensor([scale_factor(s) for s in scales], dtype=torch.float32)[:, None, None]
    std = (std * factors).contiguous()
    mean = mean.contiguous()
    blobs = encode_batch(x.contiguous(), mean, std, config)
    seconds = math.inf
    for _ in range(2):  # best of two: this machine is shared
        t0 = time.perf_counter()
        y = decode_batch(blobs, mean, std, config)
        seconds = min(seconds, time.perf_counter() - t0)
    exact = bool(torch.equal(y.view(torch.int16), x.contiguous().view(torch.int16)))
    return {"bytes": sum(len(b) for b in blobs) + len(scales), "decode_s": seconds, "exact": exact}


def streams_of(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[1, heads, T, dim]`` K and V of one layer -> ``[blocks * 2 * heads, dim, BLOCK]`` in block, stream order
    (channel-major, as the cache codes them)."""
    both = torch.stack([keys[0], values[0]])  # [2, heads, T, dim]
    blocks = both.shape[2] // BLOCK
    s = both.reshape(2, both.shape[1], blocks, BLOCK, both.shape[3]).permute(2, 0, 1, 4, 3)
    return s.reshape(-1, both.shape[3], BLOCK)


def unflat(t: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 2*heads*dim]`` -> K, V ``[1, heads, T, dim]``."""
    t = t.reshape(t.shape[0], 2, heads, dim).permute(1, 2, 0, 3)
    return t[0:1], t[1:2]


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--eval-offset", type=int, default=0)
    parser.add_argument("--ranks", default="8,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats of the predictors (best kept)")
    parser.add_argument("--out", default="results/predictor_frontier")
    parser.add_argument("--no-cache-check", action="store_true", help="skip the CompressedCache cross-check")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    ranks = [int(r) for r in args.ranks.split(",") if r]
    model, tokenizer = load_model()
    frame = RopeFrame.from_model_config(model.config)
    fit_ids = token_ids(tokenizer, args.fit_tokens, split="calibration")
    eval_ids = token_ids(tokenizer, args.eval_tokens, split="evaluation", offset=args.eval_offset)
    config = LosslessConfig().codec_config()  # generation's codec: lanes, compact header

    cal_kv = capture(model, fit_ids, args.chunk, frame, "calibration K/V", keep_kv=False)
    ev = capture(model, eval_ids, args.eval_tokens, frame, "held-out K/V")
    layers = len(ev)
    _, heads, tokens, dim = ev[0]["keys"].shape
    width = 2 * heads * dim
    blocks = tokens // BLOCK
    scalars_layer = 2 * heads * tokens * dim
    positions = torch.arange(tokens)
    print(f"{layers} layers, {heads} kv heads x {dim}, {tokens} held-out tokens, {blocks} blocks of {BLOCK}")

    # ---- fits
    t0 = time.process_time()
    cal = Calibration.fit(model, tokenizer, ids=fit_ids, tokens=args.fit_tokens, chunk=args.chunk,
                          predictors=("none", "context"), progress=True)
    library_fit_cpu_s = time.process_time() - t0
    t0 = time.process_time()
    fits = [None] + [fit_layer(cal_kv[layer - 1]["feat"], cal_kv[layer]["feat"], ranks)
                     for layer in tqdm(range(1, layers), desc="low-rank fits")]
    lowrank_fit_cpu_s = time.process_time() - t0
    del cal_kv
    lr_names = list(fits[1])

    def numel(params: dict) -> int:
        return sum(numel(t) if isinstance(t, dict) else t.numel() for t in params.values())

    # what a calibrated predictor holds while generating: its fitted parameters, counted at float16
    head_numel = {"generic": 0, **{name: sum(numel(fits[layer][name]) for layer in range(1, layers))
                                   for name in lr_names}}
    for name in ("none", "context"):
        head_numel[name] = sum(t.numel() for key, t in cal.tensors.items() if key.startswith(f"{name}/"))

    # ---- per layer x variant: bytes, decode seconds, exactness; K / V split by coding them as separate calls
    rows: dict[str, dict] = {}

    def add(name: str, layer: int, kind: str, coded: dict, side_bytes: int) -> None:
        row = rows.setdefault(name, {"bytes": {"k": [0] * layers, "v": [0] * layers},
                                     "decode_s": [0.0] * layers, "exact": True})
        row["bytes"][kind][layer] += coded["bytes"] + side_bytes
        row["decode_s"][layer] += coded["decode_s"]
        row["exact"] &= coded["exact"]

    def code_both(name: str, layer: int, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, side: int) -> None:
        """Code a layer's streams (block, kind, head order) as one K call and one V call."""
        n = x.shape[0]
        kind_of = torch.arange(n).reshape(blocks, 2, heads)
        for index, kind in enumerate("kv"):
            sel = kind_of[:, index].reshape(-1)
            m = mean if mean.shape[0] == 1 else mean[sel]
            s = std if std.shape[0] == 1 else std[sel]
            add(name, layer, kind, code_layer(x[sel], m, s, config), side * len(sel) // n)

    predictor_s: dict[str, float] = {}

    # generic (and every layer-0 fallback of the model-free-after-layer-0 variants)
    generic_layers = []
    for layer in tqdm(range(layers), desc="generic"):
        x = streams_of(ev[layer]["keys"], ev[layer]["values"])
        means, stds, side = [], [], 0
        for b in range(blocks):
            sl = slice(b * BLOCK, (b + 1) * BLOCK)
            data = block_stats(ev[layer]["keys"][:, :, sl], ev[layer]["values"][:, :, sl])
            side += sum(t.numel() * t.element_size() for t in data.values())
            inputs = BlockInputs(layer, 1, positions[sl], extras=data)
            m, s = BlockStatsSession(inputs).predict_all(heads)  # [2*heads, 1, 1, dim]
            means.append(m[:, 0].transpose(-1, -2))
            stds.append(s[:, 0].transpose(-1, -2))
        mean, std = torch.cat(means), torch.cat(stds)  # [blocks*2*heads, dim, 1]
        code_both("generic", layer, x, mean, std, side)
        generic_layers.append({k: rows["generic"]["bytes"][k][layer] for k in "kv"} | {"decode_s": rows["generic"]["decode_s"][layer]})
    predictor_s["generic"] = 0.0

    # the library's calibrated predictors, through their own sessions
    for name, cls in (("none", NoPredictor), ("context", ContextPredictor)):
        predictor = cls(cal)
        best = math.inf
        for rep in range(args.repeats):
            below: LayerValues | None = None
            spent = 0.0
            outs = [[None] * blocks for _ in range(layers)]
            for layer in tqdm(range(layers), desc=f"{name} sessions ({rep + 1}/{args.repeats})", leave=False):
                next_below = []
                for b in range(blocks):
                    sl = slice(b * BLOCK, (b + 1) * BLOCK)
                    keys, values = ev[layer]["keys"][:, :, sl], ev[layer]["values"][:, :, sl]
                    t0 = time.perf_counter()
                    session = predictor.session(BlockInputs(layer, 1, positions[sl], below=below[b] if below else None))
                    preds = []
                    for kind, h in stream_order(heads):
                        m, s = session.predict(kind, h)
                        preds.append((m[0], s[0]))
                        session.observe(kind, h, (keys if kind == "k" else values)[:, h])
                    done = session.finish(keys, values)
                    spent += time.perf_counter() - t0
                    next_below.append(done)
                    outs[layer][b] = preds
                below = next_below
            best = min(best, spent)
        predictor_s[name] = best
        for layer in tqdm(range(layers), desc=f"{name} coding"):
            x = streams_of(ev[layer]["keys"], ev[layer]["values"])
            mean = torch.stack([m.T for b in range(blocks) for m, _ in outs[layer][b]])
            std = torch.stack([s.T for b in range(blocks) for _, s in outs[layer][b]])
            code_both(name, layer, x, mean, std, 0)

    # low-rank / below1 variants: the mean of a whole layer in one batched computation
    for name in lr_names:
        best = math.inf
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for layer in range(1, layers):  # features from the decoded layer below, mean and std of all blocks
                p = fits[layer][name]
                feat = torch.cat([flat_heads(frame.unrotate(ev[layer - 1]["keys"], positions)),
                                  flat_heads(ev[layer - 1]["values"])], -1)[0]
                own = (flat_heads(frame.unrotate(ev[layer]["keys"], positions))[0]  # the decoded keys, phase 2
                       if "k" in p else None)
                mk, mv = unflat(lowrank_mean(p, feat, own), heads, dim)
                mk = frame.rotate(mk, positions)
                sk, _ = unflat(p["sigma"][None], heads, dim)
                frame.rotate_variance(sk.square().expand(-1, -1, tokens, -1), positions).sqrt()
            best = min(best, time.perf_counter() - t0)
        predictor_s[name] = best
        for layer in tqdm(range(1, layers), desc=name):
            p = fits[layer][name]
            own = ev[layer]["feat"][:, : width // 2] if "k" in p else None
            mk, mv = unflat(lowrank_mean(p, ev[layer - 1]["feat"], own), heads, dim)
            mk = frame.rotate(mk, positions)
            sk, sv = unflat(p["sigma"][None], heads, dim)  # [1, heads, 1, dim]
            vk = frame.rotate_variance(sk.square().expand(-1, -1, tokens, -1), positions)
            stdk, stdv = vk.sqrt(), sv.expand(-1, -1, tokens, -1)
            x = streams_of(ev[layer]["keys"], ev[layer]["values"])
            mean = streams_of(mk, mv)
            code_both(f"{name}/cal", layer, x, mean, streams_of(stdk, stdv), 0)
            # model-free spread: per-block channel std of the residual, bf16 side data
            res = (x.float() - mean)
            blk_std = res.std(dim=-1, correction=0, keepdim=True).clamp_min(1e-6).to(torch.bfloat16).float()
            code_both(f"{name}/blk", layer, x, mean, blk_std, blk_std.numel() * 2)
        for suffix in ("/cal", "/blk"):  # layer 0: generic
            row = rows[f"{name}{suffix}"]
            for k in "kv":
                row["bytes"][k][0] = generic_layers[0][k]
            row["decode_s"][0] = generic_layers[0]["decode_s"]

    # ---- cross-check against the library's own cache (generic / context in lossless mode, same text)
    cache_check = {}
    if not args.no_cache_check:
        for name in ("generic", "context"):
            cache = CompressedCache(
                CompressionConfig(mode="lossless", block_tokens=BLOCK, residual_tokens=0,
                                  lossless=LosslessConfig(predictor=name, decoded_budget=1.0)),
                model=model, calibration=cal if name == "context" else None)
            with torch.no_grad():
                model(eval_ids, cache=cache, use_cache=True)
            cache_check[name] = round(cache.stats()["bits_per_scalar"], 4)
            print(f"CompressedCache({name}) on the same prompt: {cache_check[name]} bits/scalar", flush=True)

    # ---- summary
    ctx_flops_ge1, ctx_flops_all = flops_context(cal, "context", layers, heads)
    none_flops = 2.0  # one bias add per scalar (and the surprise's few flops per scalar, not counted)
    summary = []
    total_scalars = scalars_layer * layers
    for name, row in rows.items():
        kb, vb = sum(row["bytes"]["k"]), sum(row["bytes"]["v"])
        ge1 = sum(row["bytes"]["k"][1:]) + sum(row["bytes"]["v"][1:])
        base = name.split("/")[0]
        if base == "generic":
            flops = 0.0
        elif base == "none":
            flops = none_flops
        elif base == "context":
            flops = ctx_flops_ge1
        else:
            flops = flops_lowrank(base, width)
        summary.append({
            "variant": name,
            "bits": 8.0 * (kb + vb) / total_scalars,
            "bits_k": 16.0 * kb / total_scalars,
            "bits_v": 16.0 * vb / total_scalars,
            "bits_layers_ge1": 8.0 * ge1 / (scalars_layer * (layers - 1)),
            "flops_per_scalar": flops,
            "heads_mb_fp16": 2 * head_numel[base] / 1e6,
            "predictor_s": predictor_s.get(base, 0.0),
            "codec_decode_s": sum(row["decode_s"]),
            "exact": row["exact"],
            "per_layer_decode_s": [round(s, 4) for s in row["decode_s"]],
            "per_layer_bits": [8.0 * (row["bytes"]["k"][i] + row["bytes"]["v"][i]) / scalars_layer for i in range(layers)],
        })
    summary.sort(key=lambda r: (r["flops_per_scalar"], -r["bits"]))
    header = ("| variant | bits/scalar | K | V | layers >= 1 | predictor flops/scalar | predictor s (cache) "
              "| lanes decode s | heads MB (fp16) | exact |")
    lines = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in summary:
        lines.append(f"| {r['variant']} | {r['bits']:.3f} | {r['bits_k']:.3f} | {r['bits_v']:.3f} | "
                     f"{r['bits_layers_ge1']:.3f} | {r['flops_per_scalar']:.0f} | {r['predictor_s']:.3f} | "
                     f"{r['codec_decode_s']:.3f} | {r['heads_mb_fp16']:.1f} | {r['exact']} |")
    table = "\n".join(lines)
    print(table)
    wall = time.perf_counter() - started
    result = {
        "model": "SmolLM2-135M bf16 (embedded)",
        "fit_tokens": args.fit_tokens, "chunk": args.chunk, "eval_tokens": tokens, "eval_offset": args.eval_offset,
        "block_tokens": BLOCK, "ridge_relative": RIDGE, "ranks": ranks,
        "library_fit_cpu_s": round(library_fit_cpu_s, 1), "lowrank_fit_cpu_s": round(lowrank_fit_cpu_s, 1),
        "context_flops_per_scalar_all_layers": ctx_flops_all,
        "cache_cross_check_bits": cache_check,
        "wall_s": round(wall, 1), "host": platform.node(), "torch_threads": torch.get_num_threads(),
        "rows": summary,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "table.md").write_text(table + "\n")
    plot(summary, out / "frontier.png")
    print(f"wrote {out}/results.json, table.md, frontier.png ({wall:.0f} s)")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, label in ((axes[0], "flops_per_scalar", "predictor flops per decoded scalar (0 plotted at 1)"),
                           (axes[1], "predictor_s", "predictor seconds, whole 2,048-token cache (0 plotted at 1e-4)")):
        floor = 1.0 if key == "flops_per_scalar" else 1e-4
        for family, marker in (("generic", "s"), ("none", "D"), ("context", "*"), ("pca", "o"), ("rrr", "^"),
                               ("below1", "P"), ("rrrK", "v"), ("below1K", "X")):
            for spread, fill in (("/cal", "full"), ("/blk", "none"), ("", "full")):
                pts = [r for r in summary if r["variant"].split(" ")[0].split("/")[0] == family
                       and (r["variant"].endswith(spread) if spread else "/" not in r["variant"])]
                if not pts:
                    continue
                xs = [max(r[key], floor) for r in pts]
                ax.plot(xs, [r["bits"] for r in pts], marker=marker, fillstyle=fill, linestyle="-" if len(pts) > 1 else "",
                        label=f"{family}{spread}")
                for r, xv in zip(pts, xs):
                    if family in ("pca", "rrr", "rrrK"):
                        ax.annotate(r["variant"].split(" ")[1].split("/")[0], (xv, r["bits"]), fontsize=7,
                                    xytext=(3, 3), textcoords="offset points")
        ax.axhline(9.3, color="grey", linestyle=":", linewidth=1)
        ax.text(floor, 9.32, "9.3 (0.6x DynamicCache held)", fontsize=7, color="grey")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("bits / scalar (real lanes bytes, held-out 2,048 tokens)")
        ax.grid(True, which="both", alpha=0.3)
    decode = min(r["codec_decode_s"] for r in summary)
    axes[1].axvline(decode, color="red", linestyle="--", linewidth=1)
    axes[1].text(decode, axes[1].get_ylim()[1], " lanes decode", color="red", fontsize=7, va="top")
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M bf16 K/V: rate against predictor cost (eval/predictor_frontier.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
