"""Predictors: where each K/V element's mean and spread come from (see `base`)."""

from __future__ import annotations

import torch

from .base import BlockInputs, LayerValues, Predictor, PredictorSession, stream_order
from .context import ContextPredictor, GenericPredictor, NoPredictor
from .framed import FramedStatsPredictor
from .probe import ProbePredictor, TwinPredictor
from .selffit import SelfFitPredictor

NAMES = ("generic", "framed", "self", "none", "context", "probe", "twin")

__all__ = [
    "NAMES",
    "BlockInputs",
    "ContextPredictor",
    "FramedStatsPredictor",
    "GenericPredictor",
    "LayerValues",
    "NoPredictor",
    "Predictor",
    "PredictorSession",
    "ProbePredictor",
    "SelfFitPredictor",
    "TwinPredictor",
    "make_predictor",
    "stream_order",
]


def make_predictor(
    name: str, *, calibration=None, model: torch.nn.Module | None = None, probe_layer: int = 8
) -> Predictor:
    """The predictor called ``name`` (one of `NAMES`); ``probe``/``twin`` need the model and a calibration."""
    if name == "generic":
        return GenericPredictor()
    if name == "framed":
        return FramedStatsPredictor()
    if name == "self":
        return SelfFitPredictor()
    if name == "none":
        return NoPredictor(calibration)
    if name == "context":
        return ContextPredictor(calibration)
    if name not in ("probe", "twin"):
        raise ValueError(f"unknown predictor {name!r}; choose one of {list(NAMES)}")
    if model is None:
        raise ValueError(f"the {name} predictor reruns the model: pass model=...")
    if calibration is None:
        raise ValueError(f"the {name} predictor needs a calibration (hf-kvcompress calibrate)")
    if name == "probe":
        return ProbePredictor(calibration, model, probe_layer)
    return TwinPredictor(calibration, model)
