"""Lossy mode's per-entry attention scores from reference queries, without the full attention matrix.

For reference queries ``q`` (with weights ``w_q``, 0 for padding) and everything a layer holds (the region's
keys ``k_j`` with logit biases ``b_j``, plus the exact context: sinks and recent window), each query's
attention is ``a_qj = exp(l_qj - lse_q)`` with ``l_qj = scaling * q.k_j + b_j`` and ``lse_q`` the log-sum-exp
over all entries (region and context). Per region entry ``j``, with ``W_qj = w_q a_qj`` and
``S_j = sum_q W_qj``:

- ``mass_j = S_j / sum_q w_q`` (mean attention the entry gets; `hf_kvcompress.lossy.scores.attention_mass`);
- ``entropy_j = -sum_q (W_qj / S_j) log(W_qj / S_j) = log S_j - (sum_q W_qj log W_qj) / S_j`` (nats; 0 when
  ``S_j = 0``), the column entropy `hf_kvcompress.lossy.matching.Kernel.entropy` computes from its matrix.

Two passes over the keys (log-sum-exp per query, then per-entry sums over queries), blockwise: memory is
O(queries + entries), never queries x entries. Triton kernels in `attention_triton`; the torch reference here
processes ``chunk`` entries at a time. Tolerance between them (float32 throughout, other summation order):
|delta entropy| <= 1e-4 nats and |delta mass| <= 1e-5 + 1e-4 * mass (tested).
"""

from __future__ import annotations

import torch

from .dispatch import use_triton

CHUNK = 4096


def _logits(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scaling: float) -> torch.Tensor:
    out = q @ k.float().transpose(-1, -2) * scaling
    return out if bias is None else out + bias.float()[..., None, :]


def _lse(queries, groups, scaling: float, chunk: int) -> torch.Tensor:
    """log-sum-exp over every (keys, bias) group, online over chunks: [b, h, m]."""
    top = torch.full(queries.shape[:-1], float("-inf"), device=queries.device)
    total = torch.zeros_like(top)
    for keys, bias in groups:
        for a in range(0, keys.shape[-2], chunk):
            part = _logits(queries, keys[..., a : a + chunk, :], None if bias is None else bias[..., a : a + chunk],
                           scaling)
            new_top = torch.maximum(top, part.amax(-1))
            safe = torch.where(torch.isfinite(new_top), new_top, 0.0)
            total = total * torch.exp(torch.where(torch.isfinite(top), top - safe, float("-inf"))) + torch.exp(
                part - safe[..., None]).sum(-1)
            top = new_top
    return torch.where(total > 0, torch.where(torch.isfinite(top), top, 0.0) + torch.log(total), float("-inf"))


def attention_scores_reference(queries, query_weight, keys, bias, context_keys, context_bias, scaling: float,
                               chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `attention_scores` (same arguments)."""
    q = queries.float()
    lse = _lse(q, [(keys, bias), (context_keys, context_bias)], scaling, chunk)
    qw = query_weight.float()
    log_qw = torch.where(qw > 0, torch.log(qw.clamp_min(1e-38)), float("-inf"))
    masses, entropies = [], []
    for a in range(0, keys.shape[-2], chunk):
        logit = _logits(q, keys[..., a : a + chunk, :], None if bias is None else bias[..., a : a + chunk], scaling)
        log_w = logit - lse[..., None] + log_qw[..., None]  # log W_qj
        w = torch.where(torch.isfinite(log_w), torch.exp(log_w), 0.0)
        s = w.sum(-2)
        t = torch.where(w > 0, w * log_w, 0.0).sum(-2)
        masses.append(s / qw.sum(-1, keepdim=True).clamp_min(1e-12))
        entropies.append(torch.where(s > 0, torch.log(s.clamp_min(1e-38)) - t / s.clamp_min(1e-38), 0.0))
    return torch.cat(masses, -1), torch.cat(entropies, -1)


def attention_scores(queries: torch.Tensor, query_weight: torch.Tensor, keys: torch.Tensor,
                     bias: torch.Tensor | None, context_keys: torch.Tensor, context_bias: torch.Tensor | None,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, entropy) ``[b, h, n]`` of the region entries (see module docstring).

    ``queries`` ``[b, h, m, d]`` (float32, per KV head), ``query_weight`` ``[b, h, m]``, ``keys`` ``[b, h, n, d]``
    with logit ``bias`` ``[b, h, n]`` (``-inf`` for dead entries; None for none), ``context_keys`` ``[b, h, c, d]``
    and ``context_bias`` likewise, ``scaling`` the attention scale. Dead entries get mass 0 and entropy 0:
    the caller masks them."""
    if use_triton(queries, keys):
        from . import attention_triton

        return attention_triton.attention_scores(queries, query_weight, keys, bias, context_keys, context_bias,
                                                 scaling)
    return attention_scores_reference(queries, query_weight, keys, bias, context_keys, context_bias, scaling)
