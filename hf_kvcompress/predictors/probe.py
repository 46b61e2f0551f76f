"""``probe`` ("early exit"), for storage: it reruns the model's first layers on the cached token ids.

The decoder reruns layers ``0..k-1`` (their K/V is then known almost exactly, coded at a fraction of a bit),
and linear heads map the hidden state entering layer ``k`` — together with the context features — to every
deeper layer's keys (pre-RoPE, then rotated) and values. It needs the model at decode time and a rerun per
decode, so it pays off when a cache is saved and loaded (prefix caching), not for every step inside
``generate()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..validation import check_int, checked
from .base import BlockInputs, PlainSession, PredictorSession, PredictorSettings, register
from .linear import CalibratedLinearPredictor, FeatureRecipe
from .rerun import HIDDEN, CacheExtras, run_decoder
from .rope import RopeFrame

EXACT_K, EXACT_V = "exact_k", "exact_v"


class ExactSession(PlainSession):
    """Layers the decoder recomputes itself: the mean is the recomputed value and the spread a quarter of
    a bf16 ulp (the storage scales it up where the recomputation differs, e.g. for tokens that were
    generated one at a time and are now recomputed in one batch)."""

    independent = True

    def __init__(self, inputs: BlockInputs):
        self.inputs = inputs
        self.keys = inputs.extras[EXACT_K].to(torch.float32)
        self.values = inputs.extras[EXACT_V].to(torch.float32)

    def predict(self, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (self.keys if kind == "k" else self.values)[:, head]
        return mean, mean.abs().clamp_min(1e-6) * 2.0**-9


@dataclass(frozen=True)
class ProbeSettings(PredictorSettings):
    """``probe``'s own setting (`LosslessConfig.probe_layer` sets it): ``probe_layer``, k, the layer whose hidden
    state the heads read; the decoder reruns layers 0..k-1. Default 8 of SmolLM2's 30 layers, the cheapest point measured
    (docs/lossless.md "Results, in brief": k=8 reruns 0.24 of a prefill for 5.67 bits/scalar)."""

    probe_layer: int = checked(8, check_int, minimum=1)


@register
class ProbePredictor(CalibratedLinearPredictor):
    """Early exit at layer ``k`` plus linear heads (see module docstring)."""

    name = "probe"
    practical_in_generation = False
    needs_model = True
    needs_calibration = True
    recipe = FeatureRecipe(below=2, inter_head=True, extras=(HIDDEN,))
    settings = ProbeSettings

    def __init__(self, calibration, model: torch.nn.Module | None, k: int, frame: RopeFrame | None = None, *,
                 portable: bool = False):
        super().__init__(calibration, frame, portable=portable)
        self.model = model
        self.k = k

    @classmethod
    def build(cls, *, calibration=None, model: torch.nn.Module | None = None, settings: PredictorSettings,
              portable: bool = False) -> ProbePredictor:
        assert isinstance(settings, ProbeSettings)  # `registry.make_predictor` checked it
        return cls(calibration, model, settings.probe_layer, portable=portable)

    @classmethod
    def fit_instances(cls, frame: RopeFrame, model: torch.nn.Module,
                      probe_layers: Sequence[int]) -> list[CalibratedLinearPredictor]:
        return [cls(None, None, k, frame) for k in probe_layers]

    @property
    def heads_name(self) -> str:
        return f"probe{self.k}"

    @property
    def first_fitted_layer(self) -> int:
        return self.k

    def features(self, inputs: BlockInputs) -> list[torch.Tensor]:
        return [inputs.extras[HIDDEN]]

    def session(self, inputs: BlockInputs) -> PredictorSession:
        if inputs.layer < self.k:
            return ExactSession(inputs)
        self.require_calibration()
        return super().session(inputs)

    def model_extras(self, token_ids: torch.Tensor) -> CacheExtras:
        cache, hidden = run_decoder(self.model, token_ids, stop_after=self.k)
        layers = {i: {EXACT_K: cache.layers[i].keys.cpu(), EXACT_V: cache.layers[i].values.cpu()} for i in range(self.k)}
        return CacheExtras(layers, hidden[self.k].cpu())

    def fit_hidden_layers(self) -> tuple[int, ...]:
        return (self.k,)

    def fit_extras(self, token_ids: torch.Tensor, hidden: Mapping[int, torch.Tensor]) -> CacheExtras:
        return CacheExtras({}, hidden[self.k])
