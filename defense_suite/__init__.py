"""Benchmark specs, runner, tables, plots and report (the ``defense-suite`` CLI)."""
