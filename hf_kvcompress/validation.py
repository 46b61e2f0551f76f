"""Field checks for every config of the package: `CompressionConfig` and its parts, the lossy methods' settings, the
codec's `CodecConfig` and the evaluation harness's suite files. One wording ("<where> must ..., got ...") and one
exception policy; and the one validator of declared checks (`checked` fields, `validate`, `Validated`) the config
dataclasses run at construction. The dict/JSON round trip they share is `jsonconfig.JsonConfig`: it constructs
configs, and so calls into their modules, which call in here (kept apart, the calls go one way).

It imports only `errors` (a leaf), so the model-independent codec can use it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
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


def check_instance(where: str, value: Any, kinds: type | tuple[type, ...], want: str, *,
                   optional: bool = False) -> None:
    """An instance of ``kinds`` (``want`` says what that is in words, e.g. ``"a torch.nn.Module"``); ``optional``:
    None passes too."""
    if not (optional and value is None) and not isinstance(value, kinds):
        _wrong_type(where, want + (" or None" if optional else ""), value)


def check_path(where: str, value: Any) -> Path:
    """A file system path given as ``str`` or ``os.PathLike`` (not empty: ``""`` would name the working folder), as
    a `Path`."""
    if not isinstance(value, (str, os.PathLike)):
        _wrong_type(where, "a file path (str or os.PathLike)", value)
    text = os.fspath(value)
    if text in ("", b""):
        fail(where, "is empty; name a file")
    return Path(os.fsdecode(text))


def check_choice(where: str, value: Any, choices: Iterable[Any]) -> None:
    """One of ``choices`` (a ``bool`` never passes for a number: ``True == 1``)."""
    options = list(choices)
    if (isinstance(value, bool) and not any(isinstance(c, bool) for c in options)) or value not in options:
        fail(where, f"must be one of {options}, got {value!r}")


def check_fraction(where: str, value: Any, *, count_hint: str) -> None:
    """A fraction in (0, 1] given as a float; an int is refused (pointing to ``count_hint``, formatted with the
    value) because ``1`` reads as "everything" to some and "one token" to others (earlier versions read an int
    budget as tokens)."""
    if isinstance(value, int) and not isinstance(value, bool):
        fail(where, f"is a fraction of the full cache, a float in (0, 1], got the int {value}; for a count of "
                           f"token-equivalents per layer use {count_hint.format(value)}"
                           + (" (for the whole cache write 1.0)" if value == 1 else ""))
    check_number(where, value, low=0.0, high=1.0, low_open=True)


def checked(default: Any, check: Callable[..., None], *, optional: bool = False, **bounds: Any) -> Any:
    """A dataclass field (default ``default``) that `validate` checks with ``check(where, value, **bounds)``, e.g.
    ``window: int = checked(32, check_int, minimum=1)``: the check is declared beside the field it concerns.
    ``optional``: None passes too."""
    return dataclasses.field(default=default, metadata={"check": (check, bounds, optional)})


def checked_as(owner: type, name: str) -> Any:
    """A dataclass field declared as the dataclass ``owner``'s field ``name`` (same default, same check): a setting
    that ``owner`` declares, exposed under the same name by another class (`LosslessConfig.probe_layer`)."""
    source = next(f for f in dataclasses.fields(owner) if f.name == name)
    return dataclasses.field(default=source.default, metadata=source.metadata)


def validate(config: Any, owner: str | None = None) -> None:
    """Run the declared check (`checked`) of every field of the dataclass ``config``, in field order; errors name
    ``<owner>.<field>`` (owner: the class name)."""
    owner = owner or type(config).__name__
    for field in dataclasses.fields(config):
        rule = field.metadata.get("check")
        if rule is not None:
            check, bounds, optional = rule
            value = getattr(config, field.name)
            if not (optional and value is None):
                check(f"{owner}.{field.name}", value, **bounds)


def check_keys(owner: str, data: Any, known: Iterable[str]) -> None:
    """``data`` is a dict whose keys are all ``known`` (unknown keys are an error, not ignored)."""
    if not isinstance(data, dict):
        raise TypeError(f"{owner}.from_dict expects a dict, got {type(data).__name__}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{owner}: unknown field(s) {unknown}; known fields are {sorted(known)}")


class Validated:
    """Base of a dataclass whose fields are all checked by their declarations (`checked`), at construction."""

    def __post_init__(self) -> None:
        validate(self)


# ---------------------------------------------------------------------- command-line argument types
# argparse ``type=`` functions of every command (`hf_kvcompress.cli`, the harness's eval and bench): a bad value is
# argparse's one-line usage error and exit status 2 at parse time, before any model loads, in the wording above.


def _arg(convert: Callable[[str], Any], expected: str, check: Callable[[Any], object]) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert`` the text (else "expected ``expected``"), then ``check`` the value."""

    def parse(text: str) -> Any:
        try:
            value = convert(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        try:
            check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    return parse


def int_arg(*, minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` taking one integer in ``[minimum, maximum]`` (`check_int`'s bounds)."""
    return _arg(int, "an integer", lambda value: check_int("value", value, minimum=minimum, maximum=maximum))


def int_list_arg(*, minimum: int | None = None, maximum: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` taking comma-separated integers, each in ``[minimum, maximum]`` ('' is none)."""
    one = int_arg(minimum=minimum, maximum=maximum)

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(one(part) for part in text.split(",") if part.strip())
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{err} (in the comma-separated list {text!r})") from None

    return parse


def number_arg(*, low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` taking one finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    return _arg(float, "a number", lambda value: check_number("value", value, low=low, high=high, low_open=low_open))
