"""The ``defense-suite`` command line (also ``python -m benchmarks``).

Sub-commands: ``list`` what is registered, ``run`` a spec, ``table`` and ``plot``
result files, ``report`` all results, and ``bench`` a whole profile then report.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.plots import tradeoff_plot
from benchmarks.report import write_report
from benchmarks.runner import run_spec
from benchmarks.security import security_markdown, security_report
from benchmarks.spec import SpecError, load_spec
from benchmarks.tables import default_columns, markdown_deltas, markdown_table
from defenses.registry import KINDS, available
from defenses.results import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
SPEC_DIR = Path(__file__).resolve().parent / "specs"


def _cmd_list(args: argparse.Namespace) -> int:
    for kind in KINDS:
        print(f"{kind}:")
        for name in available(kind):
            print(f"  {name}")
    return 0


def _run_to(
    spec_path: Path, out: Path, seeds: Sequence[int] | None, append: bool
) -> int:
    spec = load_spec(spec_path)
    if out.exists() and not append:
        out.unlink()
    return write_jsonl(run_spec(spec, seeds), out)


def _cmd_run(args: argparse.Namespace) -> int:
    n = _run_to(Path(args.spec), Path(args.out), args.seeds, args.append)
    print(f"wrote {n} results to {args.out}")
    return 0


def _cmd_table(args: argparse.Namespace) -> int:
    results = read_jsonl(*args.files)
    columns = args.cols or default_columns(results)
    if args.delta:
        print(
            markdown_deltas(results, columns)
            or "no defended arm has an undefended partner"
        )
    else:
        print(markdown_table(results, columns))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    results = read_jsonl(*args.files)
    print(tradeoff_plot(results, args.x, args.y, Path(args.out), args.title))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    results_dir = Path(args.results)
    files = sorted(results_dir.glob("*.jsonl"))
    if not files:
        print(f"no result files (*.jsonl) in {results_dir}", file=sys.stderr)
        return 1
    if args.system:
        report = security_report(read_jsonl(*files), args.system)
        text = json.dumps(report, indent=2) if args.json else security_markdown(report)
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
        print(text)
        return 0
    readme = None if args.no_readme else Path(args.readme)
    out = write_report(
        files, Path(args.specs), Path(args.out or results_dir / "REPORT.md"), readme
    )
    print(f"wrote {out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    spec_dir = Path(args.specs)
    paths = sorted(spec_dir.glob(f"*-{args.profile}.toml"))
    if args.only:
        paths = [p for p in paths if load_spec(p).package in args.only]
    if not paths:
        print(f"no *-{args.profile}.toml specs in {spec_dir}", file=sys.stderr)
        return 1
    results_dir = Path(args.results)
    for path in tqdm(paths, desc=f"{args.profile} profile", disable=None):
        tqdm.write(f"running {path.name}")
        _run_to(path, results_dir / f"{path.stem}.jsonl", None, append=False)
    readme = None if args.no_readme else Path(args.readme)
    out = write_report(
        sorted(results_dir.glob("*.jsonl")), spec_dir, results_dir / "REPORT.md", readme
    )
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``defense-suite`` command."""
    parser = argparse.ArgumentParser(prog="defense-suite", description=__doc__)
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="list registered components").set_defaults(
        func=_cmd_list
    )

    run = sub.add_parser("run", help="run one spec")
    run.add_argument("spec", help="a spec TOML file")
    run.add_argument("--out", required=True, help="JSON Lines file to write")
    run.add_argument("--seeds", type=int, nargs="+", help="override the spec's seeds")
    run.add_argument(
        "--append", action="store_true", help="append instead of overwriting"
    )
    run.set_defaults(func=_cmd_run)

    table = sub.add_parser("table", help="Markdown table of result files")
    table.add_argument("files", nargs="+")
    table.add_argument("--cols", nargs="+", help="metric paths, e.g. success.auc")
    table.add_argument(
        "--delta", action="store_true", help="paired deltas to undefended"
    )
    table.set_defaults(func=_cmd_table)

    plot = sub.add_parser("plot", help="utility vs. success scatter")
    plot.add_argument("files", nargs="+")
    plot.add_argument("--x", required=True)
    plot.add_argument("--y", required=True)
    plot.add_argument("--out", required=True)
    plot.add_argument("--title", default="")
    plot.set_defaults(func=_cmd_plot)

    for name, helptext, func in (
        ("report", "write results/REPORT.md from every results/*.jsonl", _cmd_report),
        ("bench", "run every spec of a profile, then write the report", _cmd_bench),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--results", default="results", help="results folder")
        p.add_argument("--specs", default=str(SPEC_DIR), help="spec folder")
        p.add_argument("--readme", default=str(ROOT / "README.md"))
        p.add_argument("--no-readme", action="store_true", help="leave README.md alone")
        p.set_defaults(func=func)
    report = sub.choices["report"]
    report.add_argument("--out", help="report path")
    report.add_argument("--system", help="security report of one defense (name prefix)")
    report.add_argument(
        "--json", action="store_true", help="with --system: JSON output"
    )
    bench = sub.choices["bench"]
    bench.add_argument("--profile", choices=("quick", "full"), default="quick")
    bench.add_argument("--only", nargs="+", help="packages to run (e.g. ssd rps)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``defense-suite`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except (SpecError, KeyError, ValueError, FileNotFoundError) as error:
        print(f"defense-suite: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
