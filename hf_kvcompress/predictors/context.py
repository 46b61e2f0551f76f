"""``context``: the layer below at the same positions, earlier heads of the same layer and (for values) the
keys, through calibrated linear maps (without a calibration: `generic`'s block statistics). Model-free: it
reads only what the cache holds."""

from __future__ import annotations

from .base import register
from .linear import CalibratedLinearPredictor, FeatureRecipe


@register
class ContextPredictor(CalibratedLinearPredictor):
    """The layer below, earlier heads and the keys, through calibrated linear maps."""

    name = "context"
    recipe = FeatureRecipe(below=2, inter_head=True)
