"""``python -m defense_suite`` runs the ``defense-suite`` command line."""

from defense_suite.cli import main

raise SystemExit(main())
