"""``none``: a calibration's per-channel mean and spread, no features: the baseline a predictor has to beat
(without a calibration: `generic`'s block statistics)."""

from __future__ import annotations

from .base import register
from .linear import CalibratedLinearPredictor, FeatureRecipe


@register
class NoPredictor(CalibratedLinearPredictor):
    """Per-channel mean and spread: what a predictor has to beat."""

    name = "none"
    recipe = FeatureRecipe(below=0, inter_head=False)
