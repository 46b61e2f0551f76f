"""The ``ans`` coder: adaptive windows coded with constriction's ANS coder (`ans.AnsCoder`)."""

from . import ans  # noqa: F401 (registers the coder)
