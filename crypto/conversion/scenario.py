"""Harness wiring of the bring-your-own-transformer benchmark (``crypto-byo``).

The suite's registry imports every built-in package's ``scenario`` module; this one
registers :func:`~crypto.benchmark.byo.byo_benchmark`. ``transformers`` and
``tokenizers`` are imported only when the benchmark runs.
"""

from __future__ import annotations

from defenses.registry import register_package

from ..benchmark.byo import byo_benchmark

register_package(benchmarks={"crypto-byo": byo_benchmark})
