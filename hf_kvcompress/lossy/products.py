"""float32 matrix products of the summary fit through oneDNN when this torch build has it.

On a CPU, ``torch.matmul`` of float32 tensors runs MKL's sgemm. On the AMD EPYC machines this project is measured
on, MKL's float32 kernels reached a third of what oneDNN's (also part of torch's CPU builds, the library
``torch.nn.Linear`` uses for bfloat16) did on the same core: for the summary's shapes (``[768, 64] x [64, 1980]``
logits, ``[768, 1980] x [1980, 64]`` outputs, the ``600 x 600`` Gram of ``768`` queries) 2.5-2.9x faster, with the
same float32 arithmetic (products exact in float32, float32 accumulation; relative error of a ``600 x 600`` Gram
1e-6 against float64, MKL's 5e-7; docs/lossy.md, *Speed and queries*, *Fourth look*). oneDNN's float32 matrix
product is reached per call through ``torch.ops.mkldnn._linear_pointwise`` (``x @ w.T``, one 2-D ``w``), which
changes no global state (``torch.set_float32_matmul_precision("medium")`` also routes products to oneDNN, but for
the whole process, and allows them to drop to bfloat16 where the hardware has fast bfloat16 kernels).

`linear` checks once per process that the operator exists and agrees with ``torch.matmul`` on a small product
(a float32 product, not a bfloat16 one); where it does not, where ``torch.backends.mkldnn.enabled`` is off, off
the CPU, or for a product the operator refuses, it is ``torch.matmul``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: None: not checked yet; then whether oneDNN's float32 product is used (`_onednn_ok`)
_ONEDNN: bool | None = None
#: per product path, how many 2-D products ran (tests count work, never time)
COUNTS = {"onednn": 0, "matmul": 0}
#: the shapes ``(m, k, n)`` oneDNN's products ran at, after `shape_bucket` (tests count them; a few hundred at most)
SHAPES: set[tuple[int, int, int]] = set()


def _onednn_ok() -> bool:
    """Whether ``torch.ops.mkldnn._linear_pointwise`` exists here and computes a float32 product (the last bits
    of ``1 + 2**-12`` survive it; a bfloat16 product would drop them) equal to ``torch.matmul``'s."""
    global _ONEDNN
    if _ONEDNN is None:
        try:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(16, 64, generator=gen)
            w = torch.randn(8, 64, generator=gen)
            x[0, 0], w[0] = 1 + 2**-12, 0.0
            w[0, 0] = 1.0
            out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            ref = x @ w.T
            _ONEDNN = (
                out.dtype == torch.float32 and out.shape == ref.shape and float(out[0, 0]) == 1 + 2**-12
                and bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-5))
            )
        # what a torch build without the operator raises: missing (AttributeError), refused for this CPU or
        # build (RuntimeError), no kernel for these inputs (NotImplementedError); every one means "use matmul"
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN = False
    return _ONEDNN


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.transpose(-1, -2)`` for ``x`` ``[..., m, k]`` and ``w`` ``[..., n, k]`` (broadcastable leading
    dimensions), in float32 (float64 if an input is): float32 products on a CPU are one oneDNN product per leading
    index, everything else ``torch.matmul``."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, w.dtype), torch.float32)  # bfloat16 -> float32
    x, w = x.to(dtype), w.to(dtype)
    if (
        dtype != torch.float32 or x.device.type != "cpu" or not torch.backends.mkldnn.enabled or not _onednn_ok()
        or x.shape[-2] == 0 or w.shape[-2] == 0 or x.shape[-1] == 0
    ):
        COUNTS["matmul"] += 1
        return x @ w.transpose(-1, -2)
    try:
        if w.dim() == 2:
            out = _onednn(x, w)
            COUNTS["onednn"] += 1
            return out
        lead = x.shape[:-2] if x.shape[:-2] == w.shape[:-2] else torch.broadcast_shapes(x.shape[:-2], w.shape[:-2])
        xs = x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
        ws = w.expand(*lead, *w.shape[-2:]).reshape(-1, *w.shape[-2:])
        out = x.new_empty(xs.shape[0], x.shape[-2], w.shape[-2])
        for i in range(xs.shape[0]):
            out[i] = _onednn(xs[i], ws[i])
        COUNTS["onednn"] += xs.shape[0]
        return out.reshape(*lead, x.shape[-2], w.shape[-2])
    except RuntimeError:  # a shape or layout the operator refuses: the same product by torch.matmul
        COUNTS["matmul"] += 1
        return x @ w.transpose(-1, -2)


def shape_bucket(size: int) -> int:
    """``size`` rounded up to its bucket: as it is below 16, a multiple of 16 up to 64, then a multiple of an eighth
    of its power-of-two octave (at most 12.5 % more: 2,048 stays, 2,049 becomes 2,304).

    oneDNN builds a primitive per product shape and keeps it in its primitive cache (1,024 by default), with the
    allocations it made; a chunked prefill's summaries meet new region sizes at every chunk, and the process grew
    by ~48 MB per chunk of 512 tokens that no tensor held (docs/results/lossy.md, "Chunked prefill (issue 36)").
    Below 16 rows a product may take another kernel (one row: a matrix-vector product) whose bits differ, so small
    sizes keep their own shapes; above, padding with zeros left every bit of 400 random products unchanged here."""
    if size <= 16:
        return size
    if size <= 64:
        return -(-size // 16) * 16
    step = 1 << (size.bit_length() - 4)
    return -(-size // step) * step


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` by oneDNN at the bucket's shape (`shape_bucket`: zero-padded copies where a size is not its
    bucket's), so that a few primitives serve every size; a padded result is copied out (no view pins it)."""
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    x = x.reshape(-1, k)  # leading dimensions folded into the rows
    m = x.shape[0]
    rows, inner, cols = shape_bucket(m), shape_bucket(k), shape_bucket(n)
    SHAPES.add((rows, inner, cols))
    out = torch.ops.mkldnn._linear_pointwise(_padded(x, rows, inner), _padded(w, cols, inner), None, "none", [], "")
    if (rows, cols) != (m, n):
        out = out[:m, :n].clone()
    return out.reshape(*lead, n)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` (2-D) in a zero ``[rows, cols]`` tensor, or itself (contiguous) where it has that shape already."""
    if x.shape == (rows, cols):
        return x.contiguous()
    out = x.new_zeros(rows, cols)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (float32, or float64 if an input is) for ``a`` ``[..., m, k]``, ``b`` ``[..., k, n]`` through
    `linear` (``b`` is transposed into a contiguous copy: cheap where ``n`` is small, as the summary's value
    products' ``head_dim``)."""
    return linear(a, b.transpose(-1, -2))


def linear_each(x: torch.Tensor, w: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(i, x[i] @ w[i].T)`` for every index ``i`` of the flattened leading dimensions (the same for ``x``
    ``[..., m, k]`` and ``w`` ``[..., n, k]``), each a fresh float32 ``[m, n]`` tensor the caller may change in
    place: lets a caller finish one product while it is in cache and write it where it belongs (`linear` must copy
    the products of all indices into one output)."""
    if x.shape[:-2] != w.shape[:-2]:
        raise ValueError(f"linear_each: leading dimensions differ: {tuple(x.shape)} and {tuple(w.shape)}")
    xs, ws = x.reshape(-1, *x.shape[-2:]), w.reshape(-1, *w.shape[-2:])
    for i in range(xs.shape[0]):
        yield i, linear(xs[i], ws[i])
