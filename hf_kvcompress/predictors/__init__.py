"""Predictors: where each K/V element's mean and spread come from (see `base`); one module per predictor,
all of them listed in `registry`."""

from __future__ import annotations

from .base import BlockInputs, LayerValues, Predictor, PredictorSession, stream_order
from .context import ContextPredictor
from .framed import FramedStatsPredictor
from .generic import GenericPredictor
from .none import NoPredictor
from .probe import ProbePredictor
from .registry import FITTED, NAMES, PREDICTORS, STORAGE_ONLY, make_predictor, predictor_class
from .selffit import SelfFitPredictor
from .twin import TwinPredictor

__all__ = [
    "FITTED",
    "NAMES",
    "PREDICTORS",
    "STORAGE_ONLY",
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
    "predictor_class",
    "stream_order",
]
