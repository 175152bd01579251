"""Benchmark specs, runner, tables, plots and the report (console script ``defense-suite``)."""
