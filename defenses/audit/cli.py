"""The ``defense-suite audit SPEC.toml --out DIR`` command.

:func:`add_arguments` declares the command's arguments on the lead's subparser and
:func:`run` executes it: read the spec (:mod:`defenses.audit.spec`), call its loader,
audit the model, write ``report.md``, ``report.json``, ``results.jsonl`` and the
plots to ``DIR``, and print a short summary on stdout: the headline number of every
attack and arm, the arms that make an attack stronger, the input warnings, the
refused attacks and where the report is (:func:`~defenses.audit.verdict.summary_lines`;
``--quiet`` on the command line silences it). A bad spec raises
:class:`~defenses.audit.spec.AuditSpecError` (a ``ValueError`` naming the file and
key), which the CLI prints as ``error: ...``. The spec's loader module may sit next to
the spec (:func:`~defenses.audit.spec.resolve_loader`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from defenses.audit.inputs import AuditInputs
from defenses.audit.report import AuditReport
from defenses.audit.run import audit
from defenses.audit.spec import AuditSpec, load_spec
from defenses.audit.verdict import summary_lines
from defenses.fields import values_of

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``SPEC`` and ``--out`` (and ``--seeds``) on ``parser``."""
    parser.add_argument("spec", type=Path, help="audit spec (TOML)")
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the report and plots"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="override the spec's seeds",
    )


def run_spec(spec: AuditSpec, seeds: list[int] | None = None) -> AuditReport:
    """Load the spec's model and records and audit them."""
    inputs = spec.load()
    config = spec.config
    if seeds is not None:
        config = dataclasses.replace(config, seeds=tuple(seeds))
    if spec.private_class is not None:
        inputs = dataclasses.replace(inputs, private_class=spec.private_class)
    return audit(
        **values_of(AuditInputs, inputs),
        threat=spec.threat,
        defenses=spec.defenses,
        config=config,
        name=spec.name,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``defense-suite audit``; print the summary; return the exit status (0)."""
    spec = load_spec(args.spec)
    report = run_spec(spec, args.seeds)
    written = report.write(args.out)
    for kind, path in written.items():
        logger.info("wrote %s: %s", kind, path)
    if not getattr(args, "quiet", False):
        sys.stdout.write("\n".join(summary_lines(report, written)) + "\n")
    return 0
