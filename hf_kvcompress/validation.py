"""Field checks for every config of the package: `CompressionConfig` and its parts, the codec's `CodecConfig` and
the evaluation harness's suite files. One wording ("<where> must ..., got ...") and one exception policy.

It imports only `errors` (a leaf), so the model-independent codec can use it too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn

from .errors import ConfigTypeError


def fail(where: str, problem: str) -> NoReturn:
    """Raise ``ValueError("<where> <problem>")``; ``where`` names the field, e.g. ``"LosslessConfig.window"``."""
    raise ValueError(f"{where} {problem}")


def _wrong_type(where: str, want: str, value: Any) -> NoReturn:
    raise ConfigTypeError(f"{where} must be {want}, got {type(value).__name__} {value!r}")


def check_int(where: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> None:
    """An ``int`` (not a ``bool``) in ``[minimum, maximum]`` (either bound may be left open)."""
    if isinstance(value, bool) or not isinstance(value, int):
        _wrong_type(where, "an integer", value)
    if minimum is not None and maximum is not None:
        if not minimum <= value <= maximum:
            fail(where, f"must lie in [{minimum}, {maximum}], got {value}")
    elif minimum is not None and value < minimum:
        fail(where, f"must be >= {minimum}, got {value}")
    elif maximum is not None and value > maximum:
        fail(where, f"must be <= {maximum}, got {value}")


def check_number(where: str, value: Any, *, low: float, high: float, low_open: bool = False) -> None:
    """A finite ``int`` or ``float`` (not a ``bool``) in ``[low, high]``, or ``(low, high]`` with ``low_open``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _wrong_type(where, "a number", value)
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        fail(where, f"must lie in {'(' if low_open else '['}{low}, {high}], got {value}")


def check_bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        _wrong_type(where, "a bool", value)


def check_choice(where: str, value: Any, choices: Iterable[Any]) -> None:
    """One of ``choices`` (a ``bool`` never passes for a number: ``True == 1``)."""
    options = list(choices)
    if (isinstance(value, bool) and not any(isinstance(c, bool) for c in options)) or value not in options:
        fail(where, f"must be one of {options}, got {value!r}")
