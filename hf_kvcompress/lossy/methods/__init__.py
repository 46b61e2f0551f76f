"""The lossy methods, one module each; importing a module registers its method (`..registry.register`).

To add a method: a new module here with a ``compress`` function under ``@register(...)``, and its name in the
import line below (the registry line). Every method works per batch row and KV head on the *region* (everything
between the sinks and the recent window) and returns the blocks that replace it within the bytes left for it."""

from ..registry import METHODS

# importing a method module registers it
from . import (  # noqa: F401
    adakv,
    expected_attention,
    kvzip,
    pyramidkv,
    snapkv,
    streaming,
    summary,
    summary_replay,
    svd,
    topk,
    tova,
)

__all__ = ["METHODS"]
