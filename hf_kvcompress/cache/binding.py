"""Binding K/V to the tokens and model they claim: layer 0's keys and values (of the first layer that holds K/V)
are a function of the token ids, their positions and the model's first layer only, so recomputing them for a
prefix (the embeddings and one K and one V projection: about 1 % of a prefill, docs/prefix_store.md "Trust")
tells whether a cache, a stored chunk or a saved file holds layer 0's K/V of those tokens under this model. Layers
above the first are not covered (recomputing them is a prefill): that is what the store's ``secret`` is for.

Keys and values computed with other matrix shapes (a prefill of more tokens, decode steps one token at a time)
differ in their last bits, so the comparison has a tolerance: per token and KV head, the largest difference over
the head's channels, relative to the head's largest |key| (|value| for values), at most `tolerance` (4 units in
the last place of the dtype, at least 2^-8: TF32 matmuls on a GPU). Values are one projection of the normed
embedding (no RoPE), so their rounding is no larger than the keys'. Keys or values of another token or of another
model's first layer differ by a large fraction of their size (docs/prefix_store.md "Trust": measured on SmolLM2).
"""

from __future__ import annotations

import torch

from ..predictors.rerun import first_kv

#: units in the last place of the K/V dtype that matmul shapes explain (docs/prefix_store.md "Trust")
ULPS = 4
#: the least tolerance: float32 matmuls on a GPU may run in TF32 (10-bit mantissa)
MIN_TOLERANCE = 2.0**-8


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference of two computations of the same keys or values (module docstring)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(ULPS * eps, MIN_TOLERANCE)


def first_disagreement(expected: torch.Tensor, got: torch.Tensor) -> int | None:
    """The first token (dim 2 of ``[rows, heads, tokens, dim]``) whose keys (or values) in ``got`` are not
    ``expected``'s within `tolerance`, or None. NaN agrees only with NaN, inf only with the same inf."""
    if expected.shape != got.shape:
        return 0
    a, b = expected.float().cpu(), got.float().cpu()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # inf == inf, and NaN payloads where both are NaN
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    scale = torch.where(torch.isfinite(a), a.abs(), torch.zeros_like(a)).amax(dim=-1)
    err = diff.amax(dim=-1) / scale.clamp_min(torch.finfo(torch.float32).tiny)
    bad = ~(err <= tolerance(got.dtype))  # NaN differences (one side NaN) count as disagreeing
    per_token = bad.any(dim=0).any(dim=0)
    found = torch.nonzero(per_token)
    return int(found[0, 0]) if len(found) else None


def binding_problem(model: torch.nn.Module, token_ids: torch.Tensor, layer: int, keys: torch.Tensor,
                    values: torch.Tensor, start: int = 0) -> tuple[int, str] | None:
    """Whether ``keys`` and ``values`` (``[rows, heads, tokens, dim]``, layer ``layer``'s K/V of tokens
    ``start ..``) are what ``model`` computes for ``token_ids`` ``[rows, tokens]`` there: None when they are,
    else the first token (an index into ``token_ids``) where either is not, and why."""
    vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    if token_ids.numel() and (int(token_ids.min()) < 0 or (vocab and int(token_ids.max()) >= vocab)):
        return 0, f"token ids outside the model's vocabulary of {vocab}"
    found = first_kv(model, token_ids)
    if found is None:
        return None  # no layer hands the cache its K/V: nothing to bind (`bindable` says so)
    index, want_keys, want_values = found
    if index != layer:
        return start, f"the model's first K/V layer is {index}, the keys given are of layer {layer}"
    stop = start + keys.shape[2]
    wrong = [(token, what) for what, want, got in (("keys", want_keys, keys), ("values", want_values, values))
             if (token := first_disagreement(want[:, :, start:stop], got.to(want.device))) is not None]
    if not wrong:
        return None
    token, what = min(wrong, key=lambda found: found[0])  # keys first where both disagree at one token
    return start + token, (f"layer {layer}'s {what} of token {start + token} are not what the model computes for "
                           "the token ids (K/V of other tokens, or of another model)")


def bindable(model: torch.nn.Module) -> str | None:
    """Why ``model``'s K/V cannot be bound to their tokens, or None: no layer hands its K/V to the cache in a
    forward, or its first K/V layer's keys do not depend on the token (two tokens, one forward of one position
    each: a degenerate first layer, as in some tiny random models)."""
    vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None) or 2
    found = first_kv(model, torch.tensor([[vocab // 3], [2 * vocab // 3]]))
    if found is None:
        return (f"{type(model).__name__} hands no K/V to the cache in its forward, so its layer-0 keys cannot be "
                "recomputed to bind stored K/V to their tokens")
    if torch.equal(found[1][0], found[1][1]):
        return (f"{type(model).__name__}'s first K/V layer (layer {found[0]}) computes the same keys for different "
                "tokens, so its keys cannot bind stored K/V to their tokens")
    return None
