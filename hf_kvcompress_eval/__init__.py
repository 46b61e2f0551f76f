"""Evaluation harness: `hf-kvcompress eval --suite quick|full|PATH.toml` measures what each compression mode
costs (bits per scalar, speed, memory, perplexity, needle retrieval, attention error) and writes a results folder
(JSON, Markdown report, PNG plots). See docs/eval.md.

The public names load on first use (PEP 562, as in `hf_kvcompress`): the command line imports this package's
``eval`` and ``bench`` parsers for every ``--help``, which must not wait seconds for torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_PUBLIC = {"EvalError": ".runner", "run_suite": ".runner", "BUILTIN_SUITES": ".suite", "Suite": ".suite",
           "SuiteError": ".suite", "load_suite": ".suite", "parse_suite": ".suite"}

if TYPE_CHECKING:
    from .runner import EvalError, run_suite
    from .suite import BUILTIN_SUITES, Suite, SuiteError, load_suite, parse_suite


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


__all__ = ["BUILTIN_SUITES", "EvalError", "Suite", "SuiteError", "load_suite", "parse_suite", "run_suite"]
