"""Evaluation harness: `hf-kvcompress eval --suite quick|full|PATH.toml` measures what each compression mode
costs (bits per scalar, speed, memory, perplexity, needle retrieval, attention error) and writes a results folder
(JSON, Markdown report, PNG plots). See docs/eval.md."""

from .runner import EvalError, run_suite
from .suite import BUILTIN_SUITES, Suite, SuiteError, load_suite, parse_suite

__all__ = ["BUILTIN_SUITES", "EvalError", "Suite", "SuiteError", "load_suite", "parse_suite", "run_suite"]
