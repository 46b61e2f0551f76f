"""`JsonConfig`: the dict/JSON round trip the config dataclasses share (`CompressionConfig`, `LosslessConfig`,
`LossyConfig`). Apart from `validation`, which the configs call while they are built: this module builds them."""

from __future__ import annotations

import copy
from dataclasses import asdict, fields
from typing import Any, ClassVar

from .validation import check_keys


class JsonConfig:
    """Shared dict/JSON round trip for the config dataclasses (unknown keys are an error, not ignored); a nested
    config (`_nested`) is written and read by its own `to_dict` / `from_dict`. ``_flat``: fields holding a dataclass
    whose fields are written flat beside the others (`LossyConfig.settings`), ``_key_order``: the order keys are
    written in (others follow in field order), so a layout written before keeps its bytes."""

    _nested: ClassVar[dict[str, type]] = {}
    _flat: ClassVar[tuple[str, ...]] = ()
    _key_order: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for field in fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if field.name in self._flat:
                out.update(asdict(value))
            else:
                out[field.name] = value.to_dict() if isinstance(value, JsonConfig) else copy.deepcopy(value)
        if self._key_order:
            rank = {name: i for i, name in enumerate(self._key_order)}
            out = dict(sorted(out.items(), key=lambda item: rank.get(item[0], len(rank))))
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
