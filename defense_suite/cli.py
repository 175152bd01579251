"""The ``defense-suite`` command line (also ``python -m defense_suite``).

Sub-commands: ``list`` what is registered, ``run`` a spec, ``table`` and ``plot``
result files, ``report`` all results, ``bench`` a whole profile then report, ``audit``
a user's own model (:mod:`defenses.audit`), and ``federated run`` a Flower app with its
final status as the exit code (:mod:`defense_suite.federated.__main__`).
A user error (a bad spec, flag or file) is one ``error:`` line and exit code 2; an
interrupted run exits 130 and leaves its results file as it was.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from defense_suite import __version__
from defense_suite.locations import audit_dir, default_readme, resolve_spec, spec_dir
from defense_suite.logs import configure, flower_level

if TYPE_CHECKING:
    from defense_suite.runner import Plan

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Run the defense-suite benchmarks and report their results.

  defense-suite list [--components] [--json]      the shipped specs
  defense-suite run SPEC --out FILE               run one spec into a results file
  defense-suite table FILE... [--delta]           Markdown table of results
  defense-suite plot FILE... --x M --y M --out P  scatter of two metrics
  defense-suite report [--readme]                 results/REPORT.md and its plots
  defense-suite bench [--profile quick|full]      run a profile, then report
  defense-suite audit SPEC --out DIR              audit your own fitted model
  defense-suite federated run [APP] [CONNECTION]  flwr run, validated, exit = status
  defense-suite federated supernode ARGS...       a SuperNode, app verification on

A metric is named by its section and key, e.g. success.auc or utility.accuracy.
"""


class UserError(ValueError):
    """A mistake in what the user asked for: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``error:`` line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` (no usage block) and exit with 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"seeds must be integers >= 0, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seeds must be integers >= 0, got {value}")
    return value


def _spec_file(path: Path) -> Path:
    try:
        return resolve_spec(str(path), spec_dir())
    except ValueError as error:
        raise UserError(str(error)) from None


def _say(args: argparse.Namespace, message: str) -> None:
    """A status line on stdout (what was written where), unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(message)


def _cmd_list(args: argparse.Namespace) -> int:
    from defense_suite.listing import listing

    if args.components and not args.quiet and sys.stderr.isatty():
        print("importing every package to find its components...", file=sys.stderr)
    print(listing(spec_dir(), args.components, args.json))
    return 0


def _plan_run(
    spec_path: Path, out: Path, seeds: Sequence[int] | None, mode: str
) -> tuple[Plan, set[tuple[str, str, str, str, str, int]]]:
    """Check everything a run needs before it starts; return its plan and skips."""
    from defense_suite.output import check_output, read_results
    from defense_suite.runner import plan, record_key
    from defense_suite.spec import load_spec

    spec = load_spec(_spec_file(spec_path))
    check_output(out)
    chosen = plan(spec, seeds, str(spec_path))
    existing = read_results(out) if mode != "overwrite" and out.exists() else []
    keys = {record_key(r) for r in existing}
    if mode == "append":
        clash = [g for g in chosen.games if g.key in keys]
        if clash:
            raise UserError(
                f"--append: {out} already holds {len(clash)} of this run's records "
                f"(first: {clash[0].describe()}); --resume skips them"
            )
    return chosen, keys


def _execute(chosen: Plan, out: Path, skip: set[Any], mode: str) -> int:
    from defense_suite.output import interrupt_watch, write_results
    from defense_suite.runner import run_plan

    with interrupt_watch() as check:
        return write_results(
            out, run_plan(chosen, skip, check), keep_existing=mode != "overwrite"
        )


def _mode(args: argparse.Namespace) -> str:
    return "append" if args.append else "resume" if args.resume else "overwrite"


def _cmd_run(args: argparse.Namespace) -> int:
    out, mode = Path(args.out), _mode(args)
    chosen, skip = _plan_run(Path(args.spec), out, args.seeds, mode)
    n = _execute(chosen, out, skip, mode)
    _say(args, f"wrote {n} results to {out}")
    return 0


def _results(files: Sequence[str]) -> list[Any]:
    from defense_suite.output import read_results

    results = read_results(*files)
    if not results:
        raise UserError(f"no result records in {', '.join(files)}")
    return results


def _cmd_table(args: argparse.Namespace) -> int:
    from defense_suite.tables import (
        check_metrics,
        default_columns,
        markdown_deltas,
        markdown_table,
    )

    results = _results(args.files)
    columns = args.cols or default_columns(results)
    check_metrics(results, columns, "--cols")
    if args.delta:
        print(
            markdown_deltas(results, columns)
            or "no defended arm has an undefended partner"
        )
    else:
        print(markdown_table(results, columns))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from defense_suite.output import check_output
    from defense_suite.plots import tradeoff_plot
    from defense_suite.tables import check_metrics

    results = _results(args.files)
    check_metrics(results, [args.x], "--x")
    check_metrics(results, [args.y], "--y")
    out = Path(args.out)
    check_output(out)
    print(tradeoff_plot(results, args.x, args.y, out, args.title))
    return 0


def _result_files(results_dir: Path) -> list[Path]:
    files = sorted(results_dir.glob("*.jsonl")) if results_dir.is_dir() else []
    if not files:
        where = "no such folder" if not results_dir.is_dir() else "no *.jsonl files"
        raise UserError(
            f"--results {results_dir}: {where}, so nothing to report yet; run a "
            f"spec first (defense-suite run reference-quick --out "
            f"{results_dir / 'reference-quick.jsonl'}; the folder is created) or "
            "pass --results FOLDER holding result files"
        )
    return files


def _cmd_report(args: argparse.Namespace) -> int:
    from defense_suite.output import check_output, read_results
    from defense_suite.report import check_readme, write_report
    from defense_suite.security import security_markdown, security_report

    files = _result_files(Path(args.results))
    _spec_folder(Path(args.specs))
    if args.out:
        check_output(Path(args.out))
    if args.system:
        report = security_report(read_results(*files), args.system)
        text = json.dumps(report, indent=2) if args.json else security_markdown(report)
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
        print(text)
        return 0
    readme = None if args.readme is None else Path(args.readme)
    if readme is not None:
        check_readme(readme)
    out = Path(args.out or Path(args.results) / "REPORT.md")
    _say(args, f"wrote {write_report(files, Path(args.specs), out, readme)}")
    if readme is not None:
        _say(args, f"refreshed the results block of {readme}")
    return 0


def _spec_folder(specs: Path) -> Path:
    if not specs.is_dir():
        raise UserError(f"--specs {specs}: no such folder")
    if not any(specs.glob("*.toml")):
        raise UserError(f"--specs {specs}: no spec files (*.toml)")
    return specs


def _cmd_bench(args: argparse.Namespace) -> int:
    """Check every spec, run them (:mod:`defense_suite.bench`), then the report.

    Exit code 1 when a spec failed (named on its line; no report is written).
    """
    from defense_suite.bench import run_bench
    from defense_suite.report import Draw, write_report
    from defense_suite.spec import load_spec

    specs = _spec_folder(Path(args.specs))
    paths = sorted(specs.glob(f"*-{args.profile}.toml"))
    if args.only:
        paths = [p for p in paths if load_spec(p).package in args.only]
    if not paths:
        raise UserError(f"--specs {specs}: no *-{args.profile}.toml specs")
    results, mode = Path(args.results), "resume" if args.resume else "overwrite"

    def check() -> None:  # every spec is checked before any of them runs
        for path in paths:
            _plan_run(path, results / f"{path.stem}.jsonl", None, mode)

    start = time.perf_counter()

    def report(draw: Draw) -> None:  # only when every spec succeeded
        _say(args, f"ran {len(paths)} specs in {time.perf_counter() - start:.0f} s")
        files, out = _result_files(results), results / "REPORT.md"
        _say(args, f"wrote {write_report(files, specs, out, draw=draw)}")

    done = run_bench(
        paths, results, mode, args.jobs, lambda s: _say(args, s), check, report
    )
    if failed := [o.name for o in done if not o.ok]:
        message = f"{len(failed)} of {len(paths)} specs failed ({', '.join(failed)})"
        print(f"defense-suite: error: {message}; no report", file=sys.stderr)
        return 1
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from defenses.audit.cli import run

    try:  # a shipped example audit by name: defense-suite audit digits-cnn
        args.spec = resolve_spec(str(args.spec), audit_dir(), "audit spec")
    except ValueError as error:
        raise UserError(str(error)) from None
    return run(args)


def _cmd_federated(args: argparse.Namespace) -> int:
    from defense_suite.federated.__main__ import main as federated_main

    return federated_main([args.action, *args.rest])


def build_parser(audit: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``defense-suite`` command.

    With ``audit=False`` the ``audit`` sub-command's own arguments are left out:
    declaring them imports :mod:`defenses.audit` (torch, scikit-learn: seconds),
    which only ``defense-suite audit ...`` needs.
    """
    parser = Parser(
        prog="defense-suite",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"defense-suite {__version__}"
    )
    noise = parser.add_mutually_exclusive_group()
    noise.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more logging (-v: progress, -vv: debugging details)",
    )
    noise.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="errors only: no progress, warnings or status lines",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listed = sub.add_parser("list", help="the shipped specs (--components: more)")
    listed.add_argument(
        "--components",
        action="store_true",
        help="registered scenarios, attacks, defenses (imports every package)",
    )
    listed.add_argument("--json", action="store_true", help="as one JSON object")
    listed.set_defaults(func=_cmd_list)

    run = sub.add_parser("run", help="run one spec into a results file")
    run.add_argument(
        "spec", help="a spec TOML file, or the name of a shipped spec (ssd-quick)"
    )
    run.add_argument("--out", required=True, help="JSON Lines results file")
    run.add_argument(
        "--seeds", type=_seed, nargs="+", help="seeds to run instead of the spec's"
    )
    how = run.add_mutually_exclusive_group()
    how.add_argument(
        "--append",
        action="store_true",
        help="add to the file; refused if it holds one of this run's records",
    )
    how.add_argument(
        "--resume",
        action="store_true",
        help="add to the file, skipping the records it already holds",
    )
    run.set_defaults(func=_cmd_run)

    table = sub.add_parser("table", help="Markdown table of result files")
    table.add_argument("files", nargs="+", help="JSON Lines results files")
    table.add_argument("--cols", nargs="+", help="metrics, e.g. success.auc")
    table.add_argument(
        "--delta", action="store_true", help="paired deltas to the undefended arm"
    )
    table.set_defaults(func=_cmd_table)

    plot = sub.add_parser("plot", help="scatter of two metrics, one point per arm")
    plot.add_argument("files", nargs="+", help="JSON Lines results files")
    plot.add_argument("--x", required=True, help="metric on the x axis")
    plot.add_argument("--y", required=True, help="metric on the y axis")
    plot.add_argument("--out", required=True, help="PNG file to write")
    plot.add_argument("--title", default="", help="figure title")
    plot.set_defaults(func=_cmd_plot)

    for name, helptext, func in (
        ("report", "write results/REPORT.md from every results/*.jsonl", _cmd_report),
        ("bench", "run every spec of a profile, then write the report", _cmd_bench),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--results", default="results", help="results folder")
        p.add_argument("--specs", default=str(spec_dir()), help="spec folder")
        p.set_defaults(func=func)
    report = sub.choices["report"]
    report.add_argument("--out", help="report path (default RESULTS/REPORT.md)")
    report.add_argument(
        "--readme",
        nargs="?",
        const=str(default_readme()),
        help="also refresh the results block of this README (default: the "
        "checkout's README.md)",
    )
    report.add_argument("--system", help="security report of one defense, per arm")
    report.add_argument("--json", action="store_true", help="with --system: JSON")
    audit_parser = sub.add_parser(
        "audit", help="audit your own fitted model (a spec TOML or a shipped name)"
    )
    if audit:
        from defenses.audit.cli import add_arguments as audit_arguments

        audit_arguments(audit_parser)
    audit_parser.set_defaults(func=_cmd_audit)

    federated = sub.add_parser(
        "federated", help="run a Flower app; the exit code is its final status"
    )
    federated.add_argument("action", choices=("run", "supernode"), help="what to do")
    federated.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        help="run: as for flwr run; supernode: as for flower-supernode",
    )
    federated.set_defaults(func=_cmd_federated)

    from defense_suite.bench import add_arguments as bench_arguments

    bench_arguments(sub.choices["bench"])
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The sub-command word of ``argv`` (the first argument not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``defense-suite`` console script."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(audit=_command(words) == "audit").parse_args(words)
    except SystemExit as stop:  # --help (0) or a bad flag (2, already printed)
        return int(stop.code or 0)
    configure(args.verbose, args.quiet)
    with flower_level(args.quiet):
        return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    """Run the chosen sub-command; a user error is one line and exit code 2."""
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(
            "defense-suite: interrupted; the results file being written was left "
            "as it was",
            file=sys.stderr,
        )
        return 130
    except KeyError as error:
        message = error.args[0] if error.args else repr(error)
        print(f"defense-suite: error: {message}", file=sys.stderr)
    except ImportError as error:  # an optional library met late: name its extra
        from defense_suite.extras import explain_import_error

        if (message := explain_import_error(error)) is None:
            raise
        logger.debug("details", exc_info=True)
        print(f"defense-suite: error: {message}", file=sys.stderr)
    except (ValueError, TypeError, OSError) as error:
        logger.debug("details", exc_info=True)
        print(f"defense-suite: error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
