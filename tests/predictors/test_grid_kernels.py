"""The grid predictor's compiled quantization loops against the torch expressions they replace, bit for bit
(special values, subnormal channels, odd shapes), and used where the grid computes on the CPU."""

from __future__ import annotations

import pytest
import torch

from hf_kvcompress.predictors import grid, grid_kernels


def special_features(rows: int, tokens: int, features: int, seed: int) -> torch.Tensor:
    """Random float32 features over many octaves with NaN, infinities, -0.0, all-zero, all-subnormal, tiny and
    huge channels and exact .5 ties after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, tokens, features, generator=g) * torch.exp2(torch.randint(-30, 30, (1, 1, features),
                                                                                    generator=g).float())
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-45, -3e-39, 3.0e38, 2.5, -0.5])
    flat[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    if features > 3:
        x[..., 0] = 0.0
        x[..., 1] = torch.randn(rows, tokens, generator=g) * 1e-40  # subnormal channel: the two-step scaling
        x[..., 2] = torch.tensor(-0.0)
        x[..., 3] = torch.arange(tokens, dtype=torch.float32) * 0.5 + 0.5  # ties at several scales
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.int64: torch.int64}[a.dtype]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(view),
                                                                      b.contiguous().view(view))


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 129, 67), (16, 128, 384), (4, 1, 33)])
def test_compiled_feature_quantization_is_the_torch_bits(shape):
    x = special_features(*shape, seed=sum(shape))
    q, exponent = grid.quantize_features(x)  # the CPU dispatch: the compiled loop
    ref_q, ref_exponent = grid.quantize_features_torch(x)
    assert same(exponent, ref_exponent) and same(q, ref_q)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous input reads the same
    assert same(grid.quantize_features(strided)[0], ref_q)


@pytest.mark.parametrize("rows,n,out", [(1, 1, 1), (3, 5, 7), (16, 576, 192), (2, 33, 65)])
def test_compiled_weight_folding_is_the_torch_bits(rows, n, out):
    g = torch.Generator().manual_seed(rows * n + out)
    weight = torch.randn(n, out, generator=g) * torch.exp2(torch.randint(-40, 40, (n, 1), generator=g).float())
    weight[0, 0] = -0.0
    if n > 2:
        weight[1] = 0.0  # an all-zero row
        weight[2, : out // 2] = 1e-44  # subnormal float32 weights
    weight[:, 0] = 0.0  # an all-zero column: frexp(0)'s exponent
    exponent = torch.randint(-148, 130, (rows, 1, n), generator=g)
    qw, shift = grid.quantized_weights(weight, exponent)
    ref_qw, ref_shift = grid.quantized_weights_torch(weight, exponent)
    assert same(shift, ref_shift) and same(qw, ref_qw)
    assert same(grid.quantized_weights(weight.to(torch.float64), exponent)[0], ref_qw)


def test_weights_with_a_nan_take_the_torch_path():
    weight = torch.randn(4, 3)
    weight[1, 2] = float("nan")
    exponent = torch.randint(-10, 10, (2, 1, 4))
    qw, shift = grid.quantized_weights(weight, exponent)
    ref_qw, ref_shift = grid.quantized_weights_torch(weight, exponent)
    assert same(qw, ref_qw) and same(shift, ref_shift)


def test_the_grid_runs_the_compiled_loops_on_the_cpu(monkeypatch):
    calls = {"features": 0, "weights": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(grid, "quantize_features_compiled", count("features", grid_kernels.quantize_features_compiled))
    monkeypatch.setattr(grid, "quantize_folded_compiled", count("weights", grid_kernels.quantize_folded_compiled))
    g = torch.Generator().manual_seed(5)
    q, exponent = grid.quantize_features(torch.randn(2, 9, 6, generator=g))
    means = grid.grid_means([(q, exponent)], torch.randn(7, 4, generator=g))
    assert calls == {"features": 1, "weights": 1} and means.shape == (2, 9, 4)


@pytest.mark.parametrize("rows,heads,tokens,dim", [(1, 1, 1, 1), (3, 2, 7, 5), (16, 3, 128, 64)])
def test_compiled_error_sums_are_the_torch_sums(rows, heads, tokens, dim):
    g = torch.Generator().manual_seed(rows + heads + tokens + dim)
    x = special_features(rows * heads, tokens, dim, seed=dim).view(rows, heads, tokens, dim)
    means = torch.randn(rows, tokens, heads * dim, generator=g) * 3
    means.view(-1)[:: max(1, means.numel() // 7)] = float("nan")
    sigma = torch.rand(heads, dim, generator=g) * 2 + 1e-3
    sigma.view(-1)[0] = 1e-38  # huge errors: the cap
    got = grid_kernels.error_sums_compiled(x, means, sigma, grid.E2_CAP, grid.E2_BITS)
    predicted = means.view(rows, tokens, heads, dim).transpose(1, 2)
    want = grid.squared_error_sums(((x - predicted) / sigma[:, None, :]).unsqueeze(0)).view(rows, tokens)
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize("blocks,rows,tokens,dim", [(1, 1, 1, 2), (3, 2, 7, 5), (16, 3, 128, 64)])
def test_compiled_unrotation_is_the_frames_bits(blocks, rows, tokens, dim):
    frame = grid.ExactRopeFrame(1.0 / 10000 ** (torch.arange(0, dim - dim % 2, 2, dtype=torch.float32) / dim))
    if dim % 2:  # an odd width: the tables of the frame's even one, one channel more
        frame = grid.ExactRopeFrame(torch.cat([frame.inv_freq, frame.inv_freq[-1:]]))
    tables = [frame.cos_sin(torch.arange(b * tokens, (b + 1) * tokens)) for b in range(blocks)]
    cos, sin = (torch.stack([t[i][..., :dim] for t in tables]).view(blocks, 1, 1, tokens, dim) for i in (0, 1))
    x = special_features(blocks * rows, tokens, dim, seed=tokens).view(blocks, 1, rows, tokens, dim)
    got = grid_kernels.unrotate_compiled(x, cos, sin)
    want = frame.unrotate_by(x, cos, sin)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # a NaN's payload aside (the grid reads NaN keys as 0)
    assert same(torch.where(nan, 0.0, got), torch.where(nan, 0.0, want))
