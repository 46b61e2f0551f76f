"""`JsonConfig`: the dict/JSON round trip the config dataclasses share (`CompressionConfig`, `LosslessConfig`,
`LossyConfig`). Apart from `validation`, which the configs call while they are built: this module builds them."""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any, ClassVar

from .validation import check_keys


class JsonConfig:
    """Shared dict/JSON round trip for the config dataclasses (unknown keys are an error, not ignored); a nested
    config (`_nested`) is written and read by its own `to_dict` / `from_dict`."""

    _nested: ClassVar[dict[str, type]] = {}

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for field in fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            out[field.name] = value.to_dict() if isinstance(value, JsonConfig) else copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        # init-only shortcuts (e.g. CompressionConfig.budget) are accepted too; to_dict never writes them
        known = {f.name for f in fields(cls)} | set(getattr(cls, "_shortcuts", ()))  # type: ignore[arg-type]
        check_keys(cls.__name__, data, known)
        kwargs = dict(data)
        for name, sub in cls._nested.items():
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = sub.from_dict(kwargs[name])
        return cls(**kwargs)
