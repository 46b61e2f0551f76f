"""The ``ans`` coder's `encode_with_stats`: sizes, window and locality monitoring, and ideal code lengths to
check the coder against (docs/results/codec.md section 8)."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..codec_config import CodecConfig
from ..interface import CodecStats, bits_of, check_stats, check_x
from ..params import GAUSS_BIAS, ParamSource, sigma_bits_of_code
from ..symbols import FP16, Format, key_to_pattern, split_bits, tensor_bits
from ..tables import TOTAL, W_MAIN, W_WIDE, WIDE_FACTOR
from .entropy import models_for, symbols
from .streams import EncodeTrace, decode_impl, encode_impl
from .windows import Thresholds, block_spread, chunks_of, predicted_spread, window_sigma_bits

# the three-component mixture of speculative KV coding, with the weights of docs/codec_format.md section 3
# (https://fergusfinn.com/blog/kv-entropy-coder/): the escape path in place of the tier weights
BLOG_WEIGHTS = (W_MAIN, W_WIDE, 0.02)


def encode_with_stats(
    x: torch.Tensor,
    mean: torch.Tensor | float | None,
    std: torch.Tensor | float | None,
    config: CodecConfig,
    *,
    decode: bool = True,
    exact: bool = True,
) -> tuple[bytes, CodecStats]:
    """`encode` plus a `CodecStats`. ``decode=True`` also decodes once (checking the round trip) to time
    windows by size; ``exact=True`` computes the exact-mixture ideal (float64, slower than coding).
    ``config``: an ``ans`` config (`AnsCoder.encode_with_stats`)."""
    t0 = time.perf_counter()
    blob, tr = encode_impl(x, mean, std, config, want_costs=True)
    enc_s = time.perf_counter() - t0
    cfg = config
    lengths = tr.lengths
    n = int(lengths.sum())
    per_window_bits = 8.0 * tr.payload_sizes / np.maximum(lengths, 1)
    hist: dict[int, int] = {}
    for w in lengths.tolist():
        hist[w] = hist.get(w, 0) + 1
    tiers: dict[int, int] = {}
    for w in lengths.tolist():
        t = cfg.tier_of_length(w)
        tiers[t] = tiers.get(t, 0) + 1
    model_bits = float(tr.model_bits.sum()) if tr.model_bits is not None else 0.0
    st = CodecStats(
        coder=config.coder, n_elements=n, n_windows=int(lengths.size), total_bytes=len(blob),
        header_bytes=tr.header_bytes,
        table_bytes=tr.table_bytes, payload_bytes=int(tr.payload_sizes.sum()), encode_seconds=enc_s,
        model_bits=model_bits, escapes=_escapes(x, mean, std, cfg, tr),
        window_hist=dict(sorted(hist.items())), tier_hist=dict(sorted(tiers.items())),
        window_bits_mean=float(per_window_bits.mean()) if lengths.size else 0.0,
        window_bits_var=float(per_window_bits.var()) if lengths.size else 0.0,
    )
    if decode:
        timings: list = []
        t0 = time.perf_counter()
        y = decode_impl(blob, mean, std, None, 1, 1, timings, config=cfg)
        st.decode_seconds = time.perf_counter() - t0
        if not torch.equal(bits_of(y), bits_of(x.reshape(y.shape))):
            raise AssertionError("codec round trip failed")  # decode verifies checksums; belt and braces
        by: dict[int, float] = {}
        for length, sec in timings:
            by[length] = by.get(length, 0.0) + sec
        st.decode_seconds_by_window = dict(sorted(by.items()))
    src, fmt, bits = _source(x, mean, std, cfg.mean_steps)
    if tr.res_codes is not None and n:
        st.locality = locality(tr.res_codes, src, cfg, tr.g)
    if exact and n:
        tiers_e = np.repeat([cfg.escape[cfg.tier_of_length(int(w))] for w in lengths], lengths) / 65536.0
        st.exact_bits, st.exact_codec_bits = exact_mixture_bits(bits, fmt, src, tr, cfg, tiers_e)
    return blob, st


def _source(x, mean, std, mean_steps: int = 8) -> tuple[ParamSource, Format, np.ndarray]:
    x, fmt = check_x(x)
    shape = tuple(x.shape)
    src = ParamSource(shape, *check_stats(mean, std, shape), fmt, mean_steps)
    return src, fmt, tensor_bits(x)


def _escapes(x, mean, std, cfg: CodecConfig, tr: EncodeTrace) -> int:
    src, fmt, bits = _source(x, mean, std, cfg.mean_steps)
    keys, _ = split_bits(bits, fmt)
    tables = models_for(fmt, cfg).tables
    count = 0
    for w0, w1, a, b in chunks_of(tr.lengths):
        sig = None if tr.sigma_codes is None else window_sigma_bits(tr.sigma_codes[w0:w1], tr.lengths[w0:w1])
        valid, _ = symbols(keys[a:b], src.params(a, b, sig), tables, fmt)
        count += int((~valid).sum())
    return count


def locality(res_codes: np.ndarray, src: ParamSource, cfg: CodecConfig, g: int) -> dict:
    """Predicted vs actual sigma_local per probe block (log2 units). Predicted: from std when given (what
    the ``predicted`` mode uses), else the previous block's actual spread (what ``causal`` uses)."""
    actual = block_spread(res_codes, cfg.probe, GAUSS_BIAS)
    if src.std_bits is not None:
        pred = predicted_spread(src, res_codes.size, cfg.probe)
        source = "std"
    else:
        pred = np.concatenate([[g], actual[:-1]])
        source = "previous block"
    th = Thresholds(cfg, g)
    err = (pred - actual) / 8.0
    corr = float(np.corrcoef(pred, actual)[0, 1]) if actual.size > 2 and pred.std() > 0 and actual.std() > 0 else None
    return {
        "predictor": source, "blocks": int(actual.size), "mean_abs_error_octaves": float(np.abs(err).mean()),
        "bias_octaves": float(err.mean()), "correlation": corr,
        "tier_agreement": float((th.raw_tier(pred) == th.raw_tier(actual)).mean()),
        "actual_tier_fractions": [float((th.raw_tier(actual) == k).mean()) for k in (0, 1, 2)],
    }


def _values(pattern: np.ndarray, fmt: Format) -> np.ndarray:
    """Coded P-bit patterns -> float64 values."""
    if fmt is FP16:
        return (pattern.astype(np.uint16) << 3).view(np.float16).astype(np.float64)
    return (pattern.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _phi_mass(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    r2 = 2.0**-0.5
    el, eh = torch.special.erfc(lo.abs() * r2), torch.special.erfc(hi.abs() * r2)
    right = 0.5 * (el - eh)
    left = 0.5 * (eh - el)
    mid = 1.0 - 0.5 * el - 0.5 * eh
    return torch.where(lo >= 0, right, torch.where(hi <= 0, left, mid))


def exact_mixture_bits(bits, fmt: Format, src: ParamSource, tr: EncodeTrace, cfg: CodecConfig,
                       escape_w: np.ndarray) -> tuple[float, float]:
    """-sum log2 q(x) under the exact mixture (the blog's weights, `BLOG_WEIGHTS`, and the codec's), float64, bins over the
    coded pattern (round-to-nearest bins for bfloat16, truncation bins for float32 / float16)."""
    keys, _ = split_bits(bits, fmt)
    phat = models_for(fmt, cfg).phat_freq
    z = fmt.zero_key
    top = fmt.n_patterns - 1
    tot_finn = tot_codec = 0.0
    step = 1 << 20
    sig_all = None
    if tr.sigma_codes is not None:
        sig_all = np.repeat(sigma_bits_of_code(tr.sigma_codes), tr.lengths).astype(np.uint32).view(np.float32)
    for a in range(0, keys.size, step):
        b = min(keys.size, a + step)
        k = keys[a:b]
        v = _values(key_to_pattern(k, fmt), fmt)
        vp = _values(key_to_pattern(np.maximum(k - 1, 0), fmt), fmt)
        vn = _values(key_to_pattern(np.minimum(k + 1, top), fmt), fmt)
        with np.errstate(all="ignore"):
            if fmt.truncated:
                pos = k >= z
                up = np.where(np.isfinite(vn), vn, v + (v - vp))
                dn = np.where(np.isfinite(vp), vp, v - (vn - v))
                lo, hi = np.where(pos, v, dn), np.where(pos, up, v)
            else:
                lo = np.where(np.isfinite(vp), 0.5 * (vp + v), v - 0.5 * (vn - v))
                hi = np.where(np.isfinite(vn), 0.5 * (v + vn), v + 0.5 * (v - vp))
        finite = np.isfinite(v) & np.isfinite(lo) & np.isfinite(hi)
        lo, hi = np.where(finite, lo, 0.0), np.where(finite, hi, 0.0)
        m = src.mean_f32(a, b).astype(np.float64)
        s = (src.std_f32(a, b) if sig_all is None else sig_all[a:b]).astype(np.float64)
        lo_t, hi_t, m_t, s_t = (torch.from_numpy(np.ascontiguousarray(t)) for t in (lo, hi, m, s))
        pos_s = s_t > 0
        s_safe = torch.where(pos_s, s_t, torch.ones_like(s_t))
        n1 = _phi_mass((lo_t - m_t) / s_safe, (hi_t - m_t) / s_safe)
        s3 = WIDE_FACTOR * s_safe
        n3 = _phi_mass((lo_t - m_t) / s3, (hi_t - m_t) / s3)
        point = ((lo_t <= m_t) & (m_t < hi_t)).double()
        n1 = torch.where(pos_s, n1, point)
        n3 = torch.where(pos_s, n3, point)
        fin = torch.from_numpy(finite)
        n1, n3 = torch.where(fin, n1, 0.0), torch.where(fin, n3, 0.0)
        ph = torch.from_numpy(phat[key_to_pattern(k, fmt)].astype(np.float64) / TOTAL)
        q_f = BLOG_WEIGHTS[0] * n1 + BLOG_WEIGHTS[1] * n3 + BLOG_WEIGHTS[2] * ph
        e = torch.from_numpy(escape_w[a:b])
        q_c = (1 - e) * (W_MAIN * n1 + W_WIDE * n3) / (W_MAIN + W_WIDE) + e * ph
        tot_finn += float(-torch.log2(q_f).sum())
        tot_codec += float(-torch.log2(q_c).sum())
    raw = fmt.raw_bits * keys.size
    return tot_finn + raw, tot_codec + raw
