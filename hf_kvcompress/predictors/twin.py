"""``twin``, for storage: the model with FP8 (e4m3) weights runs on the cached token ids; its K/V, with the
context features, predict the real ones through calibrated linear maps.

The predictor model of Fergus Finn's "Speculative KV coding" (https://fergusfinn.com/blog/kv-entropy-coder/,
2026): an FP8 copy of the target model whose K/V the coder uses as the mean. It needs the model at decode
time and a full rerun per decode, so it pays off when a cache is saved and loaded (prefix caching), not for
every step inside ``generate()``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from .base import BlockInputs, PredictorSession, PredictorSettings, register
from .linear import CalibratedLinearPredictor, FeatureRecipe, flat_heads
from .rerun import CacheExtras, decoder_layers, run_decoder
from .rope import RopeFrame

TWIN_K, TWIN_V = "twin_k", "twin_v"

#: the largest float8 e4m3 value (448): per-channel absmax scaling maps each weight row onto the format's
#: full range (Micikevicius et al., "FP8 Formats for Deep Learning", https://arxiv.org/abs/2209.05433)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def build_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose decoder linear weights are rounded to float8 e4m3 with one float32 scale
    per output channel (absmax / 448), computing in the model's dtype (see module docstring)."""
    # the caches' token-recorder hooks (before and after a forward) stay with the original: a cache collected while
    # deepcopy walks the hook dicts removes its hooks from them ("OrderedDict mutated during iteration")
    names = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
             "_forward_hooks_always_called")
    kept = {name: getattr(model, name) for name in names}
    for name, hooks in kept.items():
        setattr(model, name, type(hooks)())
    try:
        twin = copy.deepcopy(model)
    finally:
        for name, hooks in kept.items():
            setattr(model, name, hooks)
    for module in decoder_layers(twin).modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.data.to(torch.float32)
            scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
            rounded = (weight / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
            module.weight.data = rounded.to(module.weight.dtype)
    return twin.eval()


@register
class TwinPredictor(CalibratedLinearPredictor):
    """The FP8-weight twin's K/V plus context features, through calibrated linear maps."""

    name = "twin"
    practical_in_generation = False
    needs_model = True
    needs_calibration = True
    recipe = FeatureRecipe(below=1, inter_head=True, extras=(TWIN_K, TWIN_V))

    def __init__(self, calibration, model: torch.nn.Module | None, twin: torch.nn.Module | None = None,
                 frame: RopeFrame | None = None, *, portable: bool = False):
        super().__init__(calibration, frame, portable=portable)
        self.model = model
        self._twin = twin

    @classmethod
    def build(cls, *, calibration=None, model: torch.nn.Module | None = None, settings: PredictorSettings,
              portable: bool = False) -> TwinPredictor:
        return cls(calibration, model, portable=portable)

    @classmethod
    def fit_instances(cls, frame: RopeFrame, model: torch.nn.Module,
                      probe_layers: Sequence[int]) -> list[CalibratedLinearPredictor]:
        return [cls(None, model, None, frame)]

    @property
    def twin(self) -> torch.nn.Module:
        if self._twin is None:
            self._twin = build_twin(self.model)
        return self._twin

    def features(self, inputs: BlockInputs) -> list[torch.Tensor]:
        twin_k = self.frame.unrotate(inputs.extras[TWIN_K], inputs.positions)
        return [flat_heads(twin_k), flat_heads(inputs.extras[TWIN_V])]

    def session(self, inputs: BlockInputs) -> PredictorSession:
        self.require_calibration()
        return super().session(inputs)

    def model_extras(self, token_ids: torch.Tensor) -> CacheExtras:
        cache, _ = run_decoder(self.twin, token_ids)
        layers = {i: {TWIN_K: layer.keys.cpu(), TWIN_V: layer.values.cpu()} for i, layer in enumerate(cache.layers)}
        return CacheExtras(layers)

    def fit_extras(self, token_ids: torch.Tensor, hidden: Mapping[int, torch.Tensor]) -> CacheExtras:
        return self.model_extras(token_ids)
