"""``python -m benchmarks`` runs the ``defense-suite`` command line."""

from benchmarks.cli import main

raise SystemExit(main())
