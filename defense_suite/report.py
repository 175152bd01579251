"""The benchmark report: ``results/REPORT.md`` with tables and PNG plots.

Results are grouped by the spec that produced them (``Result.meta["spec"]``); each
spec's TOML file supplies the section's title, the paper's claim, the columns and the
plot axes. Packages add their own figures through the ``figures`` registry.

The plots are most of the report's time (about 50 figures). Each section's plots and
each package's figures are one :class:`Part`, drawn by :func:`draw_part` from plain
data (JSON-ready), so that ``defense-suite bench`` can hand the parts to its idle
worker processes and draw them in parallel (``write_report(..., draw=...)``); by
default they are drawn here, one after another. The report's text is the same
either way.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from defense_suite.output import read_results
from defense_suite.plots import delta_plot, tradeoff_plot
from defense_suite.spec import Spec, load_spec
from defense_suite.summary import SummaryRow, markdown_summary, summary_row
from defense_suite.tables import (
    check_metrics,
    default_columns,
    markdown_deltas,
    markdown_table,
    show,
)
from defenses.registry import available, load
from defenses.results import Result

logger = logging.getLogger(__name__)

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"


GLOSSARY = [
    "How to read the summary:",
    "",
    "- **defended** / **baseline**: the metric's mean for the defense and for what "
    "it is compared with (the undefended system unless the row names another "
    "method), over seeds.",
    "- **paired Δ**: defended minus baseline at the same seed and setting; "
    "negative means the metric fell.",
    "- **utility Δ**: the same paired change in the utility the defense costs "
    "(accuracy, coverage...).",
    "- **peers**: the same metric for the other defenses the paper compares with.",
    "- **guarantee**: what the defense certifies or measures about itself (a DP "
    "budget, a certified fraction, exactness).",
    "- **verdict**: see above; a claim that does not reproduce is shown as "
    "measured, never hidden.",
    "",
]
"""The glossary under the summary table: one line per column a newcomer meets."""


def _specs_by_name(spec_dir: Path) -> dict[str, Spec]:
    return {p.stem: load_spec(p) for p in sorted(spec_dir.glob("*.toml"))}


def _group(results: Sequence[Result]) -> dict[str, list[Result]]:
    groups: dict[str, list[Result]] = defaultdict(list)
    for result in results:
        groups[str(result.meta.get("spec", "unspecified"))].append(result)
    return dict(groups)


def _columns(spec: Spec | None, results: Sequence[Result]) -> list[str]:
    if spec is not None and spec.report.columns:
        return spec.report.columns
    return default_columns(results)


def _section(
    name: str, spec: Spec | None, results: Sequence[Result], plot_dir: Path, root: Path
) -> list[str]:
    title = spec.title if spec else name
    lines = [f"## {title}", "", f"Spec `{name}`, {len(results)} runs."]
    if spec and spec.claim:
        lines += ["", f"**Paper's claim:** {spec.claim}"]
    if spec and spec.report.notes:
        lines += ["", spec.report.notes]
    columns = _columns(spec, results)
    if spec is not None:  # a spec's metric that none of its results report: a typo
        check_metrics(results, columns, f"spec {name!r}: report.columns")
        for axis in ("x", "y"):
            if (metric := getattr(spec.report, axis)) is not None:
                check_metrics(results, [metric], f"spec {name!r}: report.{axis}")
    lines += [
        "",
        "Mean ± standard deviation over seeds (a number alone: no spread, every "
        "seed gave the same value):",
        "",
        markdown_table(results, columns),
    ]
    if spec is None or spec.report.delta:
        deltas = markdown_deltas(results, columns)
        if deltas:
            lines += [
                "",
                "Paired deltas (defended minus undefended, same seed), mean ± std:",
                "",
                deltas,
            ]
    if spec and spec.report.x and spec.report.y:
        path = tradeoff_plot(
            results, spec.report.x, spec.report.y, plot_dir / f"{name}.png", title
        )
        lines += ["", f"![{title}]({path.relative_to(root).as_posix()})"]
        delta = delta_plot(
            results,
            spec.report.y,
            plot_dir / f"{name}-delta.png",
            f"{title}: paired deltas",
        )
        if delta is not None:
            lines += ["", f"![paired deltas]({delta.relative_to(root).as_posix()})"]
    return [*lines, ""]


def _figures(
    package: str, results: list[Result], plot_dir: Path, root: Path
) -> list[str]:
    if package not in available("figures"):
        return []
    lines = []
    for caption, path in load("figures", package)(results, plot_dir):
        lines += [
            f"![{caption}]({Path(path).relative_to(root).as_posix()})",
            "",
            f"*{caption}*",
            "",
        ]
    return lines


@dataclass(frozen=True)
class Part:
    """One drawn piece of the report: a spec's section or a package's figures.

    ``kind`` is ``"section"`` (``name`` a spec's name, ``spec`` its file or "" if
    none is found) or ``"figures"`` (``name`` a package); ``records`` the results it
    shows (:meth:`~defenses.results.Result.to_dict`); ``plot_dir`` and ``root`` the
    plots' folder and the folder the report's links are relative to.
    """

    kind: str
    name: str
    spec: str
    records: list[dict[str, object]]
    plot_dir: str
    root: str


Draw = Callable[[Sequence[Part]], list[list[str]]]
"""Draws parts and returns their Markdown lines, in order (:func:`draw_parts`)."""


def _part(
    kind: str,
    name: str,
    spec: Path | None,
    results: Sequence[Result],
    plot_dir: Path,
    root: Path,
) -> Part:
    records = [r.to_dict() for r in results]
    return Part(kind, name, str(spec or ""), records, str(plot_dir), str(root))


def draw_part(part: Part) -> list[str]:
    """The Markdown lines of ``part``, its plots written to ``part.plot_dir``."""
    results = [Result.from_dict(r) for r in part.records]
    plot_dir, root = Path(part.plot_dir), Path(part.root)
    if part.kind == "section":
        spec = load_spec(Path(part.spec)) if part.spec else None
        return _section(part.name, spec, results, plot_dir, root)
    if part.kind == "figures":
        figures = _figures(part.name, results, plot_dir, root)
        return [f"## Figures: {part.name}", "", *figures] if figures else []
    raise ValueError(f"report part: unknown kind {part.kind!r}")


def draw_parts(parts: Sequence[Part]) -> list[list[str]]:
    """Draw ``parts`` here, one after another (the default :data:`Draw`)."""
    return [draw_part(part) for part in parts]


def summary_table(groups: dict[str, list[Result]], specs: dict[str, Spec]) -> str:
    """The summary table over every spec that declares a ``[report.summary]``."""
    rows: list[SummaryRow] = []
    metrics: list[str] = []
    for name, results in groups.items():
        spec = specs.get(name)
        row = summary_row(spec, results) if spec else None
        if row is not None and spec is not None and spec.report.summary is not None:
            rows.append(row)
            metrics.append(spec.report.summary.metric)
    return markdown_summary(rows, metrics) if rows else ""


def readme_table(groups: dict[str, list[Result]], specs: dict[str, Spec]) -> str:
    """A compact results table for the README: first two columns of each spec."""
    lines = [
        "| benchmark | attack | defense | metric 1 | metric 2 |",
        "|---|---|---|---|---|",
    ]
    for name, results in groups.items():
        spec = specs.get(name)
        columns = _columns(spec, results)[:2]
        if len(columns) < 2:
            continue
        from defenses.results import summarize

        for first, cells in summarize(results, columns):
            values = [
                f"{c}: {show(v)}" if (v := cells[c]) else f"{c}: –" for c in columns
            ]
            lines.append(
                f"| {name} | {first.attack} | {first.defense} | "
                f"{values[0]} | {values[1]} |"
            )
    return "\n".join(lines)


def check_readme(readme: Path) -> None:
    """Refuse a README without a results block (before anything is written).

    Raises
    ------
    ValueError
        ``--readme PATH: ...`` naming the missing file or the missing marker lines.
    """
    if not readme.is_file():
        raise ValueError(f"--readme {readme}: no such file")
    text = readme.read_text(encoding="utf-8")
    if README_START not in text or README_END not in text:
        raise ValueError(
            f"--readme {readme}: no results block (the lines {README_START} and "
            f"{README_END})"
        )


def update_readme(readme: Path, table: str) -> bool:
    """Replace the README's results block (between the markers); False if absent."""
    if not readme.exists():
        return False
    text = readme.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        return False
    block = f"{README_START}\n{table}\n{README_END}"
    readme.write_text(pattern.sub(lambda _: block, text), encoding="utf-8")
    return True


def write_report(
    result_files: Sequence[Path],
    spec_dir: Path,
    out: Path,
    readme: Path | None = None,
    draw: Draw = draw_parts,
) -> Path:
    """Write the Markdown report (and its plots beside it); return its path.

    ``draw`` draws the sections' and packages' :class:`Part` s (default: here, in
    order); any function returning each part's :func:`draw_part` lines in order
    gives the same report.
    """
    results = read_results(*result_files)
    if not results:
        raise ValueError(f"no results in {[str(p) for p in result_files]}")
    specs = _specs_by_name(spec_dir)
    groups = _group(results)
    root = out.parent
    plot_dir = root / "plots"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# defense-suite benchmark report",
        "",
        f"Generated {stamp} from {len(results)} runs in {len(groups)} benchmarks.",
        "Every number below was measured in this run; claims that do not reproduce "
        "are shown as measured.",
        "",
    ]
    summary = summary_table(groups, specs)
    if summary:
        lines += [
            "## Summary",
            "",
            "Mean ± standard deviation over seeds (a number alone: no spread); the "
            "paired Δ is defended minus undefended at the same seed. The verdict "
            "compares the measured change with the direction and size the paper "
            "claims: *reproduced* (the right direction, significant over seeds, "
            "and, where the paper states a size, a mean change that reaches it), "
            "*direction reproduced, magnitude not* (ours against the paper's "
            "number is stated), *partly* (the right direction, less than "
            "claimed or not significant), *not reproduced*; *projected* where the "
            "numbers come from a model extrapolating measurements (the measured "
            "range is stated), never a measurement at the paper's scale.",
            "",
            summary,
            "",
            *GLOSSARY,
        ]
    lines += [
        "| benchmark | title | runs |",
        "|---|---|---|",
    ]
    for name, group in groups.items():
        spec = specs.get(name)
        lines.append(f"| `{name}` | {spec.title if spec else name} | {len(group)} |")
    lines.append("")
    by_package: dict[str, list[Result]] = defaultdict(list)
    parts = []
    for name, group in groups.items():
        spec_file = spec_dir / f"{name}.toml" if name in specs else None
        parts.append(_part("section", name, spec_file, group, plot_dir, root))
        package = specs[name].package if name in specs else name
        by_package[package].extend(group)
    for package, group in by_package.items():
        parts.append(_part("figures", package, None, group, plot_dir, root))
    logger.info("drawing %d report parts", len(parts))
    for part_lines in draw(parts):
        lines += part_lines
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    if readme is not None:
        update_readme(readme, summary or readme_table(groups, specs))
    return out
