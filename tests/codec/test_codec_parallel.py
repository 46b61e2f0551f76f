"""Parallel decoding (threads, forked workers) gives the same bits and the same errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_testutil import assert_bit_exact, realistic

from hf_kvcompress import codec
from hf_kvcompress.codec import CodecConfig, CorruptStreamError
from hf_kvcompress.codec.ans_coder.entropy import fork_available, split_balanced


@pytest.fixture(scope="module")
def big():
    x, offset, scale = realistic((2, 3, 1024, 64), seed=9)
    return x, offset, scale, codec.encode(x, offset, scale, CodecConfig(coder="ans", fixed_window=1024))


@pytest.mark.parametrize("kw", [{"threads": 2}, {"threads": 3}, {"workers": 2}, {"workers": 3}])
def test_parallel_decode_is_identical(big, kw):
    x, offset, scale, blob = big
    assert_bit_exact(codec.decode(blob, offset, scale, **kw), x)


def test_worker_errors_propagate(big):
    if not fork_available():
        pytest.skip("no fork on this platform")
    _x, offset, scale, blob = big
    b = bytearray(blob)
    b[-10] ^= 0x40  # the last window belongs to the last worker
    with pytest.raises(CorruptStreamError):
        codec.decode(bytes(b), offset, scale, workers=2)
    with pytest.raises(CorruptStreamError):
        codec.decode(bytes(b), offset, scale, threads=2)


def test_split_balanced():
    groups = split_balanced([5, 5, 5, 5, 100], 2)
    assert [i for g in groups for i in g] == list(range(5))
    assert split_balanced([1], 4) == [[0]]
    assert len(split_balanced(list(np.ones(10, dtype=int)), 3)) == 3


def test_causal_streams_decode_serially_with_workers():
    x, offset, scale = realistic((1, 2, 300, 64), seed=4)
    blob = codec.encode(x, offset, scale, CodecConfig(coder="ans", window="causal", short_tokens=0))
    assert_bit_exact(codec.decode(blob, offset, scale, workers=2), x)
    assert_bit_exact(codec.decode_range(blob, 100, 5000, offset, scale), x.reshape(-1)[100:5000])
    assert codec.decode(blob, offset, scale, threads=2).dtype == torch.bfloat16
