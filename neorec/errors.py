"""The one base of every error a user can cause or fix: bad input, config, data, plan, checkpoint.

The command line prints a ``NeorecError`` as one line (``neorec: error: ...``) and exits 2; any
other exception is a defect of neorec and keeps its traceback. Each subclass also derives from the
builtin it used to be (``ValueError``, ``RuntimeError``), so existing ``except`` clauses still hold.
This module imports nothing, so every layer (``ops`` included) may raise these.
"""

from __future__ import annotations

__all__ = ["NeorecError", "DataError", "ConfigError"]


class NeorecError(Exception):
    """A failure the user can fix; the message alone says what was wrong and where."""

    exit_code = 2


class DataError(NeorecError, ValueError):
    """Input data cannot be read as promised (a path, a file's format, a split); names the file."""


class ConfigError(NeorecError, ValueError):
    """A config value is missing, of the wrong type, or out of range; the message names it."""
