"""Every predictor by name: the one list that config choices, storage-only names, the names a calibration
fits and `make_predictor` are derived from. Adding a predictor is one module with its class (a `name` and
its traits: `Predictor`'s class attributes, decorated with `base.register`) and its name in the import line below."""

from __future__ import annotations

import torch

# The registry line: importing a predictor module registers its class (`base.register`); a new predictor is a new
# module named here.
from . import below, context, framed, generic, grid, none, probe, selffit, twin  # noqa: F401
from .base import REGISTERED, Predictor

#: name -> class, in name order (the order of error messages, config choices and `Calibration.fit`'s head sets)
PREDICTORS: dict[str, type[Predictor]] = dict(sorted(REGISTERED.items()))

#: every predictor name (``LosslessConfig.predictor`` / ``save_predictor`` choices)
NAMES: tuple[str, ...] = tuple(PREDICTORS)
#: predictors that rerun the model to decode a block: fine for a saved file, impractical at every step
STORAGE_ONLY: tuple[str, ...] = tuple(n for n, cls in PREDICTORS.items() if not cls.practical_in_generation)
#: predictors whose heads `Calibration.fit` fits (``hf-kvcompress calibrate --predictors`` choices)
FITTED: tuple[str, ...] = tuple(n for n, cls in PREDICTORS.items() if cls.fitted_by_calibration)


def predictor_class(name: str) -> type[Predictor]:
    """The class registered as ``name`` (ValueError naming the choices otherwise)."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}; choose one of {list(NAMES)}")
    return PREDICTORS[name]


def head_set(name: str) -> str:
    """The calibration head set the predictor called ``name`` codes with: its own name, or the one it reads of
    another (``grid`` reads ``below``'s: `Predictor.reads_heads_of`), so a fit asked for it fits that one."""
    return predictor_class(name).reads_heads_of or name


def reads_calibration(name: str) -> bool:
    """Whether the predictor called ``name`` codes with a calibration when it has one (``context``, ``none``,
    ``probe``, ``twin``); ``generic``, ``framed`` and ``self`` never read one."""
    cls = predictor_class(name)
    return bool(cls.fitted_by_calibration or cls.needs_calibration)


def make_predictor(
    name: str, *, calibration=None, model: torch.nn.Module | None = None, probe_layer: int = 8, portable: bool = False
) -> Predictor:
    """The predictor called ``name`` (one of `NAMES`); those that rerun the model (``probe``/``twin``) need the
    model and a calibration. ``portable``: statistics every CPU decodes alike (`Predictor.portable`), for bytes
    that leave the process."""
    cls = predictor_class(name)
    if cls.needs_model and model is None:
        raise ValueError(f"the {name} predictor reruns the model: pass model=...")
    if cls.needs_calibration and calibration is None:
        raise ValueError(f"the {name} predictor needs a calibration (hf-kvcompress calibrate)")
    return cls.build(calibration=calibration, model=model, probe_layer=probe_layer, portable=portable)
