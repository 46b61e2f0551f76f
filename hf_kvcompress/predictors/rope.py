"""Rotary position frames: predictors work on keys in un-rotated ("pre-RoPE") space, where a linear map
between layers does not depend on the position, and rotate the predicted mean back."""

from __future__ import annotations

import numpy as np
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RopeFrame:
    """Rotation by position for ``rotate_half`` RoPE (Llama, Qwen, Mistral...), computed in ``dtype``.

    Encoder and decoder call the same code on the same positions, so the frame only has to be
    deterministic, not identical to the model's own kernels. ``inv_freq=None`` is the identity frame
    (models without RoPE). In float32 (the default) its ``cos`` / ``sin`` differ in their last bits between
    CPUs; predictors whose means must travel use the float64 frame (`in_float64`) and `codec.params.settle`.
    """

    def __init__(self, inv_freq: torch.Tensor | None, dtype: torch.dtype = torch.float32):
        self.inv_freq = None if inv_freq is None else inv_freq.detach().to(torch.float32).cpu()
        self.dtype = dtype
        self._memo: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._float64: RopeFrame | None = None

    def in_float64(self) -> RopeFrame:
        """The same frequencies (their float32 values, exactly), rotating in float64 (one twin per frame, so that
        its memo of cos / sin serves every session)."""
        if self.dtype == torch.float64:
            return self
        if self._float64 is None:
            self._float64 = RopeFrame(self.inv_freq, torch.float64)
        return self._float64

    def tensors(self) -> list[torch.Tensor]:
        """Its frequencies and the cos / sin tables it remembers (its float64 twin's too, which shares the
        frequencies): memory its owner holds."""
        frames = [self] if self._float64 is None else [self, self._float64]
        tables = [t for frame in frames for pair in frame._memo.values() for t in pair]
        return tables + ([self.inv_freq] if self.inv_freq is not None else [])

    @classmethod
    def standard(cls, base: float, head_dim: int) -> RopeFrame:
        """The frame of standard (unscaled) RoPE: frequencies ``base ** (-2i / head_dim)`` (Su et al.,
        "RoFormer", https://arxiv.org/abs/2104.09864)."""
        return cls(1.0 / (float(base) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)))

    @classmethod
    def from_model_config(cls, config) -> RopeFrame:
        """The frame of a transformers config (identity if it has no rotary parameters)."""
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        params = getattr(config, "rope_parameters", None) or {}
        if not params and getattr(config, "rope_theta", None) is None:
            return cls(None)
        rope_type = params.get("rope_type", "default")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if rope_type == "default":
            inv_freq = cls.standard(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)), head_dim).inv_freq
        else:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial != 1.0 or inv_freq.numel() * 2 != head_dim:
            return cls(None)  # partial rotary: leave keys in the cached frame rather than guess
        return cls(inv_freq)

    @property
    def is_identity(self) -> bool:
        return self.inv_freq is None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` / ``sin`` ``[tokens, head_dim]`` of ``positions`` in the frame's dtype (not for the identity frame)."""
        # blocks are contiguous position ranges, asked for once per stream: remember the last few
        # checked on the host array: a handful of torch operations here measured ~3 % of a `below` decode step
        steps = positions.numpy() if positions.device.type == "cpu" else positions.cpu().numpy()
        key = (int(steps[0]), int(steps.shape[0])) if steps.size else (0, 0)
        contiguous = steps.size < 2 or bool((np.diff(steps) == 1).all())
        if contiguous and key in self._memo:
            return self._memo[key]
        angles = positions.to(self.dtype)[:, None] * self.inv_freq.to(self.dtype)[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        result = (emb.cos(), emb.sin())
        if contiguous:
            if len(self._memo) >= 64:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = result
        return result

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[..., tokens, head_dim]`` cached keys -> keys in the pre-RoPE frame, in the frame's dtype."""
        keys = keys.to(self.dtype)
        if self.is_identity:
            return keys
        return self.unrotate_by(keys, *self.cos_sin(positions))

    def unrotate_by(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`unrotate` of keys in the frame's dtype with tables from `cos_sin` (broadcast against ``keys``: the
        tables of several blocks stacked rotate them all in one pass, each element as `unrotate` does)."""
        return keys * cos - self._rotate_half(keys) * sin

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys ``[..., tokens, head_dim]`` (the frame's dtype) -> the cached frame."""
        if self.is_identity:
            return keys
        return self.rotate_by(keys, *self.cos_sin(positions))

    def rotate_by(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`rotate` with tables from `cos_sin` (broadcast, as `unrotate_by`)."""
        return keys * cos + self._rotate_half(keys) * sin

    def rotate_bound(self, size: torch.Tensor) -> torch.Tensor:
        """A bound on ``|rotate(x)|`` per element from a bound ``size`` on ``|x|`` (``[..., head_dim]``): a rotated
        element mixes a pair of channels."""
        if self.is_identity:
            return size
        return size + self._rotate_half(size).abs()

    def rotate_tolerance(self, tolerance: torch.Tensor, size: torch.Tensor, positions: torch.Tensor,
                         rounding: float) -> torch.Tensor:
        """A bound on how far another CPU's `rotate` of ``x`` lies from this one's, for an ``x`` known within
        ``tolerance`` whose magnitude is at most ``size`` (``[..., tokens, head_dim]``): the pair's tolerances plus
        ``rounding`` of the pair's magnitude, except at angle 0 (position 0: cos = 1 and sin = 0 on every CPU, so
        the rotation is exact)."""
        if self.is_identity:
            return tolerance
        moving = (positions != 0).to(size.dtype).unsqueeze(-1)
        return self.rotate_bound(tolerance) + rounding * self.rotate_bound(size) * moving

    def rotate_variance(self, variance: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-element variance in the cached frame of independent pre-RoPE errors with ``variance``
        (``[..., head_dim]`` or ``[..., tokens, head_dim]``): each rotated pair mixes its two channels."""
        if self.is_identity:
            return variance
        return self.rotate_variance_by(variance, *self.cos_sin(positions))

    def rotate_variance_by(self, variance: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`rotate_variance` with tables from `cos_sin` (broadcast, as `unrotate_by`)."""
        half = variance.shape[-1] // 2
        paired = torch.cat([variance[..., half:], variance[..., :half]], dim=-1)
        return variance * cos * cos + paired * sin * sin

