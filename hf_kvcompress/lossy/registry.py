"""Every lossy method by name: what `LossyConfig.method` is checked against and what `LossyLayer` runs.

A method is one module in ``hf_kvcompress/lossy/methods/`` (one small file per method, as in kvpress,
https://github.com/NVIDIA/kvpress) whose ``compress`` function is decorated with `register`, naming its settings
(a frozen `MethodSettings` dataclass citing its paper, as a kvpress press is a dataclass of its parameters) and its
traits; ``methods/__init__.py`` imports the modules, and that import line is the list of methods. This module
imports only `validation` of the package, so `settings` (LossyConfig) reads it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..validation import Validated

#: ``compress(region, budget, context)``: the blocks (`layer.storage.Block`) that replace ``region``
#: (`region.Region`) within ``budget`` bytes per batch row, fitted with ``context`` (`region.FitContext`). Typed
#: loosely because this module imports nothing of the package: `settings` (LossyConfig) reads it.
Compress = Callable[[Any, int, Any], list]

#: ``LossyConfig.entry_format`` values: the cache dtype as it is, 8-bit codes with a float16 scale per vector,
#: 4-bit codes with a float16 scale and offset per vector, or 4-bit with the most important entries in 8 bits
#: (`hf_kvcompress.lossy.packed` implements them)
ENTRY_FORMATS: tuple[str, ...] = ("model", "int8", "fp8", "int4", "mixed")


@dataclass(frozen=True)
class MethodSettings(Validated):
    """A method's own settings: a frozen dataclass whose fields declare their checks (`validation.checked`), run at
    construction. `LossyConfig` holds what every method shares and one of these (``LossyConfig.settings``); a
    method reads its own as ``ctx.config.settings``. Its fields are written into the lossy config's dict beside the
    shared ones (`LossyConfig.to_dict`), so their names must differ from those. ``PAPER``: where the method and its
    defaults come from."""

    PAPER: ClassVar[str] = ""


@dataclass(frozen=True)
class LossyMethod:
    """One registered method: its ``LossyConfig.method`` name, its ``compress`` function, the paper (or page) it
    comes from, and whether it scores entries by the model's queries (then `CompressedCache` refuses it without a
    model: the cache alone never sees queries, and key stand-ins lose to the query-free methods, docs/lossy.md).

    ``own_positions``: the method gets the reference queries at the positions they were computed at, with those
    positions (`region.FitContext.positions`), instead of moved over the next ``query_horizon`` positions (the
    papers of SnapKV, TOVA and Expected Attention score with the prompt's own queries). ``layer_share``: ``(layer,
    layers, settings) -> share`` of the uniform per-layer budget this layer gets (PyramidKV's layer budgets); the shares
    of a model's layers sum to its layer count, so the whole cache keeps the same bytes. None: every layer gets the
    uniform budget. ``context_replay``: the method runs under KVzip's context replay (`methods.kvzip.compress_context`:
    the context held whole, re-read after a repeat prompt, pruned across layers): ``"scores"`` (it reads the replay's
    scores, `region.FitContext.scores`) or ``"queries"`` (also a sample of the replay's queries, its reference
    queries); None: not. ``settings``: the method's `MethodSettings` class (its defaults: ``settings()``)."""

    name: str
    compress: Compress
    paper: str
    needs_queries: bool
    own_positions: bool = False
    layer_share: Callable[[int, int, Any], float] | None = None
    settings: type[MethodSettings] = MethodSettings
    context_replay: str | None = None


#: `LossyMethod.context_replay` values
REPLAYS: tuple[str | None, ...] = (None, "scores", "queries")

#: name -> method, in the order ``methods/__init__.py`` imports them
METHODS: dict[str, LossyMethod] = {}


def register(
    name: str, *, needs_queries: bool, settings: type[MethodSettings] = MethodSettings, paper: str | None = None,
    own_positions: bool = False, layer_share: Callable[[int, int, Any], float] | None = None,
    context_replay: str | None = None,
) -> Callable[[Compress], Compress]:
    """Decorator: register ``compress`` as lossy method ``name`` with its ``settings`` class (``paper``: its
    ``PAPER`` unless given; traits: `LossyMethod`)."""

    def add(compress: Compress) -> Compress:
        if name in METHODS:
            raise ValueError(f"lossy method {name!r} is registered twice")
        if context_replay not in REPLAYS:
            raise ValueError(f"lossy method {name!r}: context_replay must be one of {list(REPLAYS)}, got {context_replay!r}")
        source = paper if paper is not None else settings.PAPER
        METHODS[name] = LossyMethod(name, compress, source, needs_queries, own_positions, layer_share, settings,
                                    context_replay)
        return compress

    return add
