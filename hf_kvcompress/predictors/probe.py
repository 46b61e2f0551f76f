"""``probe`` ("early exit"), for storage: it reruns the model's first layers on the cached token ids.

The decoder reruns layers ``0..k-1`` (their K/V is then known almost exactly, coded at a fraction of a bit),
and linear heads map the hidden state entering layer ``k`` — together with the context features — to every
deeper layer's keys (pre-RoPE, then rotated) and values. It needs the model at decode time and a rerun per
decode, so it pays off when a cache is saved and loaded (prefix caching), not for every step inside
``generate()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .base import BlockInputs, PlainSession, PredictorSession, register
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


@register
class ProbePredictor(CalibratedLinearPredictor):
    """Early exit at layer ``k`` plus linear heads (see module docstring)."""

    name = "probe"
    practical_in_generation = False
    needs_model = True
    needs_calibration = True
    recipe = FeatureRecipe(below=2, inter_head=True, extras=(HIDDEN,))

    def __init__(self, calibration, model: torch.nn.Module | None, k: int, frame: RopeFrame | None = None, *,
                 portable: bool = False):
        super().__init__(calibration, frame, portable=portable)
        self.model = model
        self.k = k

    @classmethod
    def build(cls, *, calibration=None, model: torch.nn.Module | None = None, probe_layer: int = 8,
              portable: bool = False) -> ProbePredictor:
        return cls(calibration, model, probe_layer, portable=portable)

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
