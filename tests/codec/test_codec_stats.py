"""encode_with_stats: consistent monitoring, and the real stream within 1 % of the ideal plus headers."""

from __future__ import annotations

import json

import pytest
import torch
from codec_testutil import realistic

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig


@pytest.mark.parametrize("mode", ["fixed", "metadata", "predicted", "causal"])
def test_stats_are_consistent(mode):
    x, offset, scale = realistic((1, 3, 256, 64), seed=1)
    cfg = CodecConfig(coder="ans", window=mode, short_tokens=0)
    blob, st = codec.encode_with_stats(x, offset, scale, cfg)
    assert blob == codec.encode(x, offset, scale, cfg)  # deterministic, and stats do not change the stream
    assert st.total_bytes == len(blob) == st.header_bytes + st.table_bytes + st.payload_bytes
    assert sum(st.window_hist.values()) == st.n_windows == sum(st.tier_hist.values())
    assert sum(k * v for k, v in st.window_hist.items()) == x.numel()
    assert set(st.decode_seconds_by_window) <= set(st.window_hist)
    assert st.decode_seconds and st.decode_seconds > 0
    assert st.window_bits_var >= 0
    # the ANS coder itself: payload within 1 % of -sum log2 q (plus a few flush bits per window)
    assert 8 * st.payload_bytes <= 1.01 * st.model_bits + 32 * st.n_windows
    assert st.exact_bits is not None and st.exact_codec_bits is not None
    assert abs(st.model_bits - st.exact_codec_bits) / st.n_elements < 0.02
    loc = st.locality
    assert loc is not None and loc["predictor"] == "std" and 0 <= loc["tier_agreement"] <= 1
    json.dumps(st.to_dict())


def test_stats_without_mean_and_std():
    x, _, _ = realistic((1, 2, 128, 64), seed=2, dtype=torch.float32)
    _blob, st = codec.encode_with_stats(x, None, None, CodecConfig(coder="ans", fixed_window=1024))
    assert st.locality is not None and st.locality["predictor"] == "previous block"
    assert st.model_bits / st.n_elements > 16  # float32: 16 raw bits + the coded top half
    assert 8 * st.payload_bytes <= 1.01 * st.model_bits + 32 * st.n_windows


@pytest.mark.parametrize("coder", sorted(codec.CODERS))
def test_stats_empty(coder):
    blob, st = codec.encode_with_stats(torch.zeros(0, dtype=torch.bfloat16), config=CodecConfig(coder=coder))
    assert st.n_elements == 0 and st.n_windows == 0 and st.total_bytes == len(blob)
    assert st.coder == coder  # every coder's stats name it (no default to fall back on)
