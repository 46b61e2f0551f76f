"""General-purpose baselines: every one round-trips, and the numbers mean what they say."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress_eval.baselines import baseline_bits, baselines, exponent_bound_bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_baseline_round_trips(dtype):
    torch.manual_seed(0)
    tensors = [torch.randn(2, 3, 40, 16).to(dtype) for _ in range(3)]
    raw_bits = 8 * tensors[0].element_size()
    for method in ("zstd-3", "exponent-bound", "zipnn"):
        row = baseline_bits(tensors, method)
        if not row["available"]:
            assert "not installed" in row["reason"]
            continue
        assert len(row["bits"]) == 3
        assert 0 < row["bits_per_scalar"] < raw_bits + 1


def test_exponent_bound_of_a_constant_is_the_raw_mantissa():
    t = torch.full((1000,), 1.5, dtype=torch.bfloat16)
    assert exponent_bound_bits(t) == pytest.approx(8 * 1000)  # exponent entropy 0, 8 raw bits per bf16


def test_codec_benchmark_table_shape():
    torch.manual_seed(1)
    rows = baselines([torch.randn(4, 64).to(torch.bfloat16), torch.randn(4, 64).to(torch.bfloat16)])
    names = [r["method"] for r in rows]
    assert names[0] == "raw bf16" and names[-1].startswith("exponent-Huffman bound")
    assert any(n.startswith("zstd -19") for n in names)
