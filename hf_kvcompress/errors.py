"""Errors shared across the package's entry points (a module of its own, so that the command lines of the
library and of the evaluation harness both raise them without importing each other)."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing problem of a command line: printed as one line, exit status 2."""
