"""The conversion's one error type."""

from __future__ import annotations


class ConversionError(ValueError):
    """The model cannot be converted; the message names the layer or setting."""
