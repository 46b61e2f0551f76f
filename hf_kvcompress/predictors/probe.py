"""Model-based predictors, for storage: they rerun (part of) the model on the cached token ids.

``probe`` ("early exit"): the decoder reruns layers ``0..k-1`` (their K/V is then known almost exactly,
coded at a fraction of a bit), and linear heads map the hidden state entering layer ``k`` — together with
the context features — to every deeper layer's keys (pre-RoPE, then rotated) and values.

``twin``: the model with FP8 (e4m3) weights runs on the same tokens; its K/V, with the context features,
predict the real ones.

Both need the model at decode time and a rerun per decode, so they pay off when a cache is saved and
loaded (prefix caching), not for every step inside ``generate()``.
"""

from __future__ import annotations

import torch

from .base import BlockInputs, ExtrasSource, PlainSession, PredictorSession
from .context import CalibratedLinearPredictor
from .linear import FeatureRecipe, _flat_heads
from .runner import build_twin, run_decoder

HIDDEN, EXACT_K, EXACT_V, TWIN_K, TWIN_V = "hidden", "exact_k", "exact_v", "twin_k", "twin_v"


class CacheExtras(ExtrasSource):
    """Extras cut out of per-layer ``[batch, heads, tokens, dim]`` K/V and a ``[batch, tokens, hidden]``
    hidden state computed for the whole sequence."""

    def __init__(self, layers: dict[int, dict[str, torch.Tensor]], hidden: torch.Tensor | None = None):
        self.layers = layers
        self.hidden = hidden

    def extras(self, layer: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {name: t[:, :, start:stop] for name, t in self.layers.get(layer, {}).items()}
        if self.hidden is not None:
            out[HIDDEN] = self.hidden[:, start:stop]
        return out


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


class ProbePredictor(CalibratedLinearPredictor):
    """Early exit at layer ``k`` plus linear heads (see module docstring)."""

    name = "probe"
    practical_in_generation = False

    def __init__(self, calibration, model: torch.nn.Module | None, k: int, frame=None):
        super().__init__(calibration, frame)
        self.model = model
        self.k = k

    @property
    def heads_name(self) -> str:
        return f"probe{self.k}"

    def layer_recipe(self, layer: int) -> FeatureRecipe:
        return FeatureRecipe(below=2, inter_head=True, extras=(HIDDEN,))

    def features(self, inputs: BlockInputs) -> list[torch.Tensor]:
        return [inputs.extras[HIDDEN]]

    def session(self, inputs: BlockInputs) -> PredictorSession:
        if inputs.layer < self.k:
            return ExactSession(inputs)
        _require_calibration(self)
        return super().session(inputs)

    def model_extras(self, token_ids: torch.Tensor) -> CacheExtras:
        cache, hidden = run_decoder(self.model, token_ids, stop_after=self.k)
        layers = {i: {EXACT_K: cache.layers[i].keys.cpu(), EXACT_V: cache.layers[i].values.cpu()} for i in range(self.k)}
        return CacheExtras(layers, hidden[self.k].cpu())


class TwinPredictor(CalibratedLinearPredictor):
    """The FP8-weight twin's K/V plus context features, through calibrated linear maps."""

    name = "twin"
    practical_in_generation = False
    recipe = FeatureRecipe(below=1, inter_head=True, extras=(TWIN_K, TWIN_V))

    def __init__(self, calibration, model: torch.nn.Module | None, twin: torch.nn.Module | None = None, frame=None):
        super().__init__(calibration, frame)
        self.model = model
        self._twin = twin

    @property
    def twin(self) -> torch.nn.Module:
        if self._twin is None:
            self._twin = build_twin(self.model)
        return self._twin

    def features(self, inputs: BlockInputs) -> list[torch.Tensor]:
        twin_k = self.frame.unrotate(inputs.extras[TWIN_K], inputs.positions)
        return [_flat_heads(twin_k), _flat_heads(inputs.extras[TWIN_V])]

    def session(self, inputs: BlockInputs) -> PredictorSession:
        _require_calibration(self)
        return super().session(inputs)

    def model_extras(self, token_ids: torch.Tensor) -> CacheExtras:
        cache, _ = run_decoder(self.twin, token_ids)
        layers = {i: {TWIN_K: layer.keys.cpu(), TWIN_V: layer.values.cpu()} for i, layer in enumerate(cache.layers)}
        return CacheExtras(layers)


def _require_calibration(predictor: CalibratedLinearPredictor) -> None:
    if predictor.calibration is None:
        raise ValueError(
            f"the {predictor.heads_name} predictor needs a calibration that fitted it "
            "(hf-kvcompress calibrate, then Calibration.load)"
        )

