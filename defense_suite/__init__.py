"""The ``defense-suite`` command line: benchmark specs, runner, tables, plots, report.

This import package belongs to the defense-suite distribution alone (the folder
``benchmarks/`` of the checkout holds only the spec files; opacus's wheel ships a
top-level ``benchmarks`` package of its own, which would shadow a package of that
name). The suite's federated and crypto packages are installed as
``defense_suite.federated`` and ``defense_suite.crypto`` for the same reason: the names
``crypto`` and ``federated`` belong to other distributions on PyPI.
"""

__version__ = "0.5.0"
"""The distribution's version (the same as :data:`defenses.__version__`; a test
checks that the two and the installed metadata agree)."""
