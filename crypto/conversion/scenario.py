"""Harness wiring of the bring-your-own-transformer benchmarks.

The suite's registry imports every built-in package's ``scenario`` module; this one
registers :func:`~crypto.benchmark.byo.byo_benchmark` (``crypto-byo``) and
:func:`~crypto.benchmark.convert_error.convert_error_benchmark`
(``crypto-convert-error``). ``transformers`` and ``tokenizers`` are imported only
when a benchmark runs.
"""

from __future__ import annotations

from defenses.registry import register_package

from ..benchmark.byo import byo_benchmark
from ..benchmark.convert_error import convert_error_benchmark

register_package(
    benchmarks={
        "crypto-byo": byo_benchmark,
        "crypto-convert-error": convert_error_benchmark,
    }
)
