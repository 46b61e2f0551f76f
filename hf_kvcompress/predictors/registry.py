"""Every predictor by name: the one list that config choices, storage-only names, the names a calibration
fits and `make_predictor` are derived from. Adding a predictor is one module with its class (a `name` and
its traits: `Predictor`'s class attributes, decorated with `base.register`) and its name in the import line below."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

# The registry line: importing a predictor module registers its class (`base.register`); a new predictor is a new
# module named here.
from . import below, context, framed, generic, grid, none, probe, selffit, twin  # noqa: F401
from .base import REGISTERED, Predictor, PredictorSettings

#: name -> class, in name order (the order of error messages, config choices and `Calibration.fit`'s head sets)
PREDICTORS: dict[str, type[Predictor]] = dict(sorted(REGISTERED.items()))

#: every predictor name (``LosslessConfig.predictor`` / ``save_predictor`` choices)
NAMES: tuple[str, ...] = tuple(PREDICTORS)
#: predictors that rerun the model to decode a block: fine for a saved file, impractical at every step
STORAGE_ONLY: tuple[str, ...] = tuple(n for n, cls in PREDICTORS.items() if not cls.practical_in_generation)
#: predictors whose heads `Calibration.fit` fits (``hf-kvcompress calibrate --predictors`` choices)
FITTED: tuple[str, ...] = tuple(n for n, cls in PREDICTORS.items() if cls.fitted_by_calibration)


#: the storage paths' default name (`LosslessConfig.save_predictor`, `PrefixStore`'s ``predictor``): calibrated
#: storage where a calibration allows it (`storage_predictor`)
AUTO = "auto"
#: what calibrated storage codes with: the point of the measured frontier chosen for files and stored chunks
#: (docs/results/lossless.md, "Calibrated storage (issue 48)"): the `below` maps on integer grids, whose statistics
#: every CPU computes alike, so a file or chunk is coded once, with no settled listing
CALIBRATED_STORAGE = "grid"


def storage_predictor(name: str, calibration, *, every_token_everywhere: bool = True) -> str:
    """The predictor a storage path (a save, a store's chunks) codes with: ``name`` itself, or for `AUTO`
    `CALIBRATED_STORAGE` where ``calibration`` holds the heads it reads and ``every_token_everywhere`` (every
    layer holds every token: it reads the layer below), else ``"generic"``."""
    if name != AUTO:
        predictor_class(name)  # an unknown name: ValueError naming the choices
        return name
    if calibration is None or not every_token_everywhere:
        return "generic"
    return CALIBRATED_STORAGE if head_set(CALIBRATED_STORAGE) in calibration.predictors else "generic"


def predictor_class(name: str) -> type[Predictor]:
    """The class registered as ``name`` (ValueError naming the choices otherwise)."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}; choose one of {list(NAMES)}")
    return PREDICTORS[name]


def head_set(name: str) -> str:
    """The calibration head set the predictor called ``name`` codes with: its own name, or the one it reads of
    another (``grid`` reads ``below``'s: `Predictor.reads_heads_of`), so a fit asked for it fits that one."""
    return predictor_class(name).reads_heads_of or name


#: the head sets a first-use calibration fits (`calibration.calibration_for`): the ones calibrated storage reads
FIRST_USE: tuple[str, ...] = (head_set(CALIBRATED_STORAGE),)


def reads_calibration(name: str) -> bool:
    """Whether the predictor called ``name`` codes with a calibration when it has one (``context``, ``none``,
    ``probe``, ``twin``; `AUTO`, calibrated storage, where one is found); ``generic``, ``framed`` and ``self`` never
    read one."""
    if name == AUTO:
        return True
    cls = predictor_class(name)
    return bool(cls.fitted_by_calibration or cls.needs_calibration)


def settings_for(name: str, values: Mapping[str, Any]) -> PredictorSettings:
    """The settings of the predictor called ``name`` (`Predictor.settings`) from ``values``, a `LosslessConfig`'s
    dict or a file header's predictor object: the fields its settings declare (their defaults where absent), the
    rest ignored; validated (``probe_layer=0``: ValueError naming ``ProbeSettings.probe_layer``)."""
    own = predictor_class(name).settings
    return own(**{f.name: values[f.name] for f in dataclasses.fields(own) if f.name in values})


def make_predictor(
    name: str, *, calibration=None, model: torch.nn.Module | None = None, settings: PredictorSettings | None = None,
    portable: bool = False
) -> Predictor:
    """The predictor called ``name`` (one of `NAMES`); those that rerun the model (``probe``/``twin``) need the
    model and a calibration. ``settings``: its own (`settings_for`; None: their defaults). ``portable``: statistics
    every CPU decodes alike (`Predictor.portable`), for bytes that leave the process."""
    cls = predictor_class(name)
    if settings is None:
        settings = cls.settings()
    elif not isinstance(settings, cls.settings):
        raise TypeError(f"the {name} predictor's settings are a {cls.settings.__name__}, got "
                        f"{type(settings).__name__}")
    if cls.needs_model and model is None:
        raise ValueError(f"the {name} predictor reruns the model: pass model=...")
    if cls.needs_calibration and calibration is None:
        raise ValueError(f"the {name} predictor needs a calibration (hf-kvcompress calibrate)")
    return cls.build(calibration=calibration, model=model, settings=settings, portable=portable)
