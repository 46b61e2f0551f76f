"""Triton kernels of `attention.attention_scores`: pass 1 streams every key block once per query block
(online log-sum-exp per query), pass 2 streams every query block once per key block (per-entry sums);
tiles of [BLOCK_M, BLOCK_N] logits live only in registers.

Reductions go through ``tl.reduce`` with our own combine functions, not ``tl.sum`` / ``tl.max``: those are
``triton.language.standard`` ``@jit`` helpers, fixed when triton is imported, which breaks the interpreter
when torch imported triton before ``TRITON_INTERPRET=1`` was set (as under pytest)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_N = 32


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _lse_update(q, k_ptr, b_ptr, n, scaling, top, total, dd, D: tl.constexpr, HAS_B: tl.constexpr,
                BLOCK_N: tl.constexpr):
    for start in range(0, n, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + rn[:, None] * D + dd[None, :], mask=rn[:, None] < n, other=0.0).to(tl.float32)
        logit = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        if HAS_B:
            logit += tl.load(b_ptr + rn, mask=rn < n, other=0.0)[None, :]
        logit = tl.where(rn[None, :] < n, logit, float("-inf"))
        new_top = tl.maximum(top, tl.reduce(logit, 1, _max))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - safe) + tl.reduce(tl.exp(logit - safe[:, None]), 1, _add)
        top = new_top
    return top, total


@triton.jit
def _lse_kernel(q_ptr, k_ptr, b_ptr, ck_ptr, cb_ptr, lse_ptr, m, n, c, scaling, D: tl.constexpr,
                HAS_B: tl.constexpr, HAS_CB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + bh * m * D + rm[:, None] * D + dd[None, :], mask=rm[:, None] < m, other=0.0)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.full([BLOCK_M], 0.0, tl.float32)
    top, total = _lse_update(q, k_ptr + bh * n * D, b_ptr + bh * n, n, scaling, top, total, dd, D, HAS_B, BLOCK_N)
    top, total = _lse_update(q, ck_ptr + bh * c * D, cb_ptr + bh * c, c, scaling, top, total, dd, D, HAS_CB,
                             BLOCK_N)
    safe = tl.where(top == float("-inf"), 0.0, top)
    lse = tl.where(total > 0, safe + tl.log(total), float("-inf"))
    tl.store(lse_ptr + bh * m + rm, lse, mask=rm < m)


@triton.jit
def _score_kernel(q_ptr, qw_ptr, lse_ptr, k_ptr, b_ptr, mass_ptr, ent_ptr, m, n, scaling, D: tl.constexpr,
                  HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, D)
    k = tl.load(k_ptr + bh * n * D + rn[:, None] * D + dd[None, :], mask=rn[:, None] < n, other=0.0).to(tl.float32)
    if HAS_B:
        bias = tl.load(b_ptr + bh * n + rn, mask=rn < n, other=float("-inf"))
    else:
        bias = tl.where(rn < n, 0.0, float("-inf"))
    s = tl.full([BLOCK_N], 0.0, tl.float32)
    t = tl.full([BLOCK_N], 0.0, tl.float32)
    qw_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    for start in range(0, m, BLOCK_M):
        rm = start + tl.arange(0, BLOCK_M)
        q = tl.load(q_ptr + bh * m * D + rm[:, None] * D + dd[None, :], mask=rm[:, None] < m, other=0.0)
        lse = tl.load(lse_ptr + bh * m + rm, mask=rm < m, other=float("-inf"))
        qw = tl.load(qw_ptr + bh * m + rm, mask=rm < m, other=0.0)
        qw_sum += qw
        logit = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling + bias[None, :]
        valid = (qw[:, None] > 0) & (lse[:, None] > float("-inf")) & (logit > float("-inf"))
        lse_safe = tl.where(lse > float("-inf"), lse, 0.0)  # keep -inf - -inf (NaN) out of the maths
        log_w = tl.where(valid, tl.where(valid, logit, 0.0) - lse_safe[:, None], 0.0)
        log_w = tl.where(valid, log_w + tl.log(tl.where(qw > 0, qw, 1.0))[:, None], 0.0)
        w = tl.where(valid, tl.exp(log_w), 0.0)
        s += tl.reduce(w, 0, _add)
        t += tl.reduce(w * log_w, 0, _add)
    total_qw = tl.maximum(tl.reduce(qw_sum, 0, _add), 1e-12)
    ent = tl.where(s > 0, tl.log(tl.maximum(s, 1e-38)) - t / tl.maximum(s, 1e-38), 0.0)
    tl.store(mass_ptr + bh * n + rn, s / total_qw, mask=rn < n)
    tl.store(ent_ptr + bh * n + rn, ent, mask=rn < n)


def _flat(t: torch.Tensor, d_pad: int) -> torch.Tensor:
    """[b, h, r, d] -> contiguous [b*h, r, d_pad] (zero padding to a power-of-two head dim)."""
    b, h, r, d = t.shape
    t = t.reshape(b * h, r, d)
    if d_pad != d:
        t = torch.nn.functional.pad(t, (0, d_pad - d))
    return t.contiguous()


def attention_scores(queries, query_weight, keys, bias, context_keys, context_bias, scaling: float):
    b, h, m, d = queries.shape
    n, c = keys.shape[-2], context_keys.shape[-2]
    dp = max(16, triton.next_power_of_2(d))
    q = _flat(queries.float(), dp)
    k, ck = _flat(keys, dp), _flat(context_keys, dp)
    qw = query_weight.float().reshape(b * h, m).contiguous()
    bb = None if bias is None else bias.float().reshape(b * h, n).contiguous()
    cb = None if context_bias is None else context_bias.float().reshape(b * h, c).contiguous()
    lse = torch.empty(b * h, m, dtype=torch.float32, device=q.device)
    mass = torch.empty(b * h, n, dtype=torch.float32, device=q.device)
    ent = torch.empty_like(mass)
    if m:
        _lse_kernel[(b * h, triton.cdiv(m, BLOCK_M))](
            q, k, q if bb is None else bb, ck, q if cb is None else cb, lse, m, n, c, float(scaling), D=dp,
            HAS_B=bb is not None, HAS_CB=cb is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    if n:
        _score_kernel[(b * h, triton.cdiv(n, BLOCK_N))](
            q, qw, lse, k, q if bb is None else bb, mass, ent, m, n, float(scaling), D=dp, HAS_B=bb is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return mass.reshape(b, h, n), ent.reshape(b, h, n)
