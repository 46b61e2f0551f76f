"""The ANS decoder kernels decode constriction's streams bit for bit: random model sequences (tables, p_hat,
escape flags), empty windows, and malformed input flagged, not crashed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testutil import BACKENDS

from hf_kvcompress import codec, kernels
from hf_kvcompress.codec.ans_coder import device
from hf_kvcompress.codec.ans_coder.device import decode_on_device
from hf_kvcompress.codec.ans_coder.entropy import models_for
from hf_kvcompress.codec.ans_coder.streams import Decoder
from hf_kvcompress.codec.codec_config import CodecConfig
from hf_kvcompress.codec.symbols import BF16, FP16, split_bits, tensor_bits


def _windows(fmt, lengths, seed):
    """Per window: random group ids (any table, p_hat, a flag model), symbols drawn from those models, and
    constriction's compressed words of the sequence."""
    import constriction

    rng = np.random.default_rng(seed)
    tables = device.tables_for(fmt, "cpu")
    models = models_for(fmt, CodecConfig(coder="ans"))
    every = [*models.groups, *models.flags]
    out = []
    for n in lengths:
        groups = rng.integers(0, len(every), n)
        syms = []
        for g in groups:
            lo, size = int(tables.off[g]), int(tables.size[g])
            f = tables.freq[lo : lo + size].numpy().astype(np.float64)
            syms.append(int(rng.choice(size, p=f / f.sum())))
        coder = constriction.stream.stack.AnsCoder()
        for g, s in zip(groups[::-1], syms[::-1]):
            coder.encode_reverse(np.array([s], dtype=np.int32), every[g])
        out.append((groups.astype(np.int32), np.array(syms, dtype=np.int32),
                    coder.get_compressed().astype(np.int64)))
    return tables, out


def _decode(tables, windows):
    words = torch.from_numpy(np.concatenate([w[2] for w in windows]))
    count = torch.tensor([w[2].size for w in windows])
    lo = torch.cumsum(count, 0) - count
    lengths = torch.tensor([w[0].size for w in windows], dtype=torch.int32)
    start = torch.cumsum(lengths.long(), 0) - lengths.long()
    state, pos, ok = device.ans_start(words, lo, count)
    groups = torch.from_numpy(np.concatenate([w[0] for w in windows]))
    syms, state, pos = device.ans_decode(words, lo, state, pos, groups, start, lengths, tables)
    return syms, state, pos, ok, lo


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [BF16, FP16], ids=lambda f: f.name)
def test_decodes_constriction_streams(backend, fmt):
    tables, windows = _windows(fmt, [0, 1, 37, 90, 5], seed=len(fmt.name))
    with kernels.forced(backend):
        syms, state, pos, ok, lo = _decode(tables, windows)
    assert np.array_equal(syms.numpy(), np.concatenate([w[1] for w in windows]))
    assert ok.all() and (state == 0).all() and torch.equal(pos, lo - 1)  # empty coder, every word read


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_words_do_not_crash(backend):
    tables, windows = _windows(BF16, [40, 40], seed=3)
    rng = np.random.default_rng(4)
    bad = [(g, s, w ^ rng.integers(0, 2**32, w.size)) for g, s, w in windows]
    bad[1] = (bad[1][0], bad[1][1], np.concatenate([bad[1][2], [0]]))  # trailing zero word: refused
    with kernels.forced(backend):
        syms, state, _, ok, _ = _decode(tables, bad)
    assert not ok[1]
    assert (syms >= 0).all()
    assert not bool(((state == 0) & ok).all())  # decoding garbage does not leave both coders empty


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_windows_reproduces_the_codec_layout(backend):
    """Flags, then groups in ascending table id, then escapes: the same symbols as the CPU decoder."""
    g = torch.Generator().manual_seed(0)
    mean, std = torch.randn(3, 50, generator=g), torch.rand(3, 50, generator=g) + 0.1
    x = (mean + std * torch.randn(3, 50, generator=g)).bfloat16()
    x.view(-1)[[3, 77]] = torch.tensor([float("nan"), 1e30]).bfloat16()  # two escapes
    cfg = CodecConfig(coder="ans", fixed_window=64)
    blob = codec.encode(x, mean, std, cfg)
    d = Decoder(blob, mean, std, None)
    with kernels.forced(backend):
        bits = decode_on_device(d, mean, std, "cpu")
    keys, _ = split_bits(tensor_bits(x), BF16)
    assert torch.equal(bits, x.reshape(-1).view(torch.int16))
    assert keys.size == bits.numel()
