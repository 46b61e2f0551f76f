"""The coder registry: every coder by its `CodecConfig.coder` name. A coder is a module with an `interface.Coder`
subclass decorated with `register`; `coders` imports them all (the registry line) and `CodecConfig` asks the
named coder whether it takes the rest of the config (`check_coder`)."""

from __future__ import annotations

from typing import Any

#: name -> coder (one `interface.Coder` instance each), in registration order
REGISTERED: dict[str, Any] = {}


def register(cls: type) -> type:
    """Class decorator: register a coder (an `interface.Coder` subclass) under its ``name``, one instance."""
    if cls.name in REGISTERED:
        raise ValueError(f"codec coder {cls.name!r} is registered twice")
    REGISTERED[cls.name] = cls()
    return cls


def check_coder(config: Any) -> None:
    """``config.coder`` must name a registered coder that takes ``config`` (`Coder.check_config`: window modes)."""
    coder = REGISTERED.get(config.coder) if isinstance(config.coder, str) else None
    if coder is None:
        raise ValueError(f"CodecConfig.coder must be one of {sorted(REGISTERED)}, got {config.coder!r}")
    coder.check_config(config)
