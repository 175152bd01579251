"""Benchmark specs: TOML files that say what to run.

A *game* spec pits attacks against defenses on a scenario::

    title = "Reference: membership inference on digits"
    claim = "Rounding and label-only outputs lower membership AUC."
    scenario = "digits-membership"
    attacks = ["loss-mia", "label-only-mia"]
    defenses = ["none", "rounding", "label-only"]      # "none" = undefended arm
    seeds = [0, 1, 2]

    [params.scenario]
    members = 0.1

    [params.defense.rounding]
    decimals = [0, 1, 2]                               # a list is a sweep

    [report]
    columns = ["utility.accuracy", "success.auc"]
    x = "utility.accuracy"
    y = "success.auc"

A *measurement* spec runs a registered benchmark function instead::

    title = "SSD water-filling speed"
    benchmark = "ssd-speed"
    seeds = [0]
    [params.benchmark]
    K = [10, 100, 1000]

A list-valued parameter is a sweep over its values (Cartesian product across
parameters); to pass a list as a single value, nest it: ``hidden = [[64, 64]]``.
``[run] exclusive = true`` makes ``bench`` run the spec alone (a timing; by default
decided by its claim: :func:`defense_suite.bench.exclusive`). Unknown keys and wrong
types are errors that name the key.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from defense_suite.magnitude import MAGNITUDE_KEYS, magnitude_problem

TOP_KEYS = {
    "title",
    "claim",
    "scenario",
    "attacks",
    "defenses",
    "seeds",
    "benchmark",
    "params",
    "report",
    "run",
}
RUN_KEYS = {"exclusive"}
PARAM_KEYS = {"scenario", "attack", "defense", "benchmark"}
REPORT_KEYS = {"columns", "x", "y", "delta", "notes", "summary"}
SUMMARY_KEYS = {
    "threat",
    "attack",
    "defense",
    "metric",
    "paper",
    "direction",
    "relative_change",
    "peers",
    "guarantee",
    "baseline",
    "utility",
    "basis",
    "measured_range",
    "interval",
    "paper_baseline",
    "paper_defended",
    "paper_ratio",
}

METRIC_SECTIONS = ("utility", "success", "cost", "certificate")
"""The sections of a result record a metric path (``section.key``) can name."""


class SpecError(ValueError):
    """A benchmark spec is malformed."""


def _expect(where: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, kind) or (
        isinstance(value, bool)
        and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise SpecError(f"{where} must be {what}, got {value!r}")


def _refuse_unknown(where: str, what: str, given: Any, allowed: set[str]) -> None:
    bad = sorted(set(given) - allowed)
    if bad:
        raise SpecError(f"{where}: unknown {what} {bad}; allowed: {sorted(allowed)}")


def _str_list(where: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    _expect(where, value, list, "a list of strings")
    for item in value:
        _expect(where, item, str, "a list of strings")
    return list(value)


def sweep(params: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Expand list-valued parameters into the Cartesian product of settings."""
    keys = list(params)
    values = [v if isinstance(v, list) else [v] for v in params.values()]
    for combo in itertools.product(*values):
        yield dict(zip(keys, combo, strict=True))


def check_metric(where: str, value: Any) -> str:
    """Refuse ``value`` unless it is a metric path ``section.key`` naming a section.

    Raises
    ------
    SpecError
        Naming ``where`` and the value, with the allowed sections.
    """
    _expect(where, value, str, "a metric path like 'success.auc'")
    section, dot, key = value.partition(".")
    if not dot or not key or section not in METRIC_SECTIONS:
        raise SpecError(
            f"{where} must be a metric path 'section.key' with section one of "
            f"{METRIC_SECTIONS}, got {value!r}"
        )
    return str(value)


DIRECTIONS = ("lower", "higher", "same", "within")
"""How a summary row's metric must move for the claim to hold."""

BASES = ("measured", "projected")
"""What a summary row's numbers rest on: measurements, or a model projecting them."""


@dataclass(frozen=True)
class SummarySettings:
    """One row of the report's summary table: the headline claim and its verdict.

    The row compares the arm whose defense label starts with ``defense`` against the
    arm whose label starts with ``baseline`` (the undefended arm ``"none"`` unless
    the claim is against another method) on ``metric``, paired by seed and setting,
    for the attack whose label starts with ``attack``; ``utility`` names the metric
    whose paired change shows what the defense costs. The verdict is *reproduced*
    when the defended mean moved in ``direction`` ("lower" or "higher") by at least
    ``relative_change`` of the baseline's mean, *partly* when it moved that way by
    less, *not reproduced* otherwise. With ``direction = "same"`` the claim is that
    the metric does not move: *reproduced* within ``relative_change``, *partly*
    within twice that, *not reproduced* beyond. With ``direction = "within"`` the
    claim is a cost budget: the defended mean exceeds the baseline's by at most
    ``relative_change`` of it (e.g. 0.5: at most 1.5x), *partly* within twice that.

    With ``basis = "projected"`` the row's numbers are a model's projection beyond
    what was measured (e.g. a cost model fitted on small widths, evaluated at the
    paper's): the verdict is *projected*, never *reproduced*, and states
    ``measured_range`` (what the measurements cover) and what the projection would
    give; ``interval`` (two metric paths, low and high, of the defended arm) adds
    the projection's interval to that statement.

    Where the paper states a size, the row carries it and the verdict checks it
    (:func:`defense_suite.summary.magnitude`): ``paper_baseline`` and
    ``paper_defended``, the paper's values of the metric without and with the
    defense (BREP-MI accuracy 26.8 % -> 1.8 %: 0.268 and 0.018), claim the relative
    change :math:`c = (d_p - b_p) / |b_p|`; ``paper_defended`` alone claims that
    value itself; ``paper_ratio`` (a speed-up such as 6.94x) claims :math:`b / d`
    (``direction = "lower"``) or :math:`d / b` (``"higher"``) of at least that.
    *Reproduced* then also needs the measured change to reach the stated size.
    """

    threat: str
    metric: str
    defense: str
    attack: str = ""
    paper: str = ""
    direction: str = "lower"
    relative_change: float = 0.0
    peers: list[str] = field(default_factory=list)
    guarantee: str = ""
    baseline: str = "none"
    utility: str = ""
    basis: str = "measured"
    measured_range: str = ""
    interval: list[str] = field(default_factory=list)
    paper_baseline: float | None = None
    paper_defended: float | None = None
    paper_ratio: float | None = None

    @property
    def has_magnitude(self) -> bool:
        """Whether the claim states a size (one of :data:`MAGNITUDE_KEYS` is set)."""
        return any(getattr(self, key) is not None for key in MAGNITUDE_KEYS)

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise SpecError(
                f"report.summary.direction must be one of {DIRECTIONS}, "
                f"got {self.direction!r}"
            )
        if (
            isinstance(self.relative_change, bool)
            or not isinstance(self.relative_change, int | float)
            or not math.isfinite(self.relative_change)
            or self.relative_change < 0
        ):
            raise SpecError(
                f"report.summary.relative_change must be a finite number >= 0, "
                f"got {self.relative_change!r}"
            )
        for key in ("threat", "metric", "defense"):
            if not getattr(self, key).strip():
                raise SpecError(f"report.summary.{key} must not be empty")
        check_metric("report.summary.metric", self.metric)
        for key in ("utility",):
            if getattr(self, key):
                check_metric(f"report.summary.{key}", getattr(self, key))
        if self.basis not in BASES:
            raise SpecError(
                f"report.summary.basis must be one of {BASES}, got {self.basis!r}"
            )
        if self.basis == "projected" and not self.measured_range.strip():
            raise SpecError(
                "report.summary.measured_range is required with basis = "
                "'projected' (what the measurements cover, e.g. 'd = 2..5')"
            )
        if self.basis == "measured" and (self.measured_range or self.interval):
            raise SpecError(
                "report.summary.measured_range and interval belong to basis = "
                "'projected' rows"
            )
        if self.interval:
            if len(self.interval) != 2:
                raise SpecError(
                    "report.summary.interval must be two metric paths [low, high], "
                    f"got {self.interval!r}"
                )
            for metric in self.interval:
                check_metric("report.summary.interval", metric)
        problem = magnitude_problem(
            self.direction, self.paper_baseline, self.paper_defended, self.paper_ratio
        )
        if problem:
            raise SpecError(f"report.summary.{problem}")


@dataclass(frozen=True)
class ReportSettings:
    """How the report shows a spec's results."""

    columns: list[str] = field(default_factory=list)
    x: str | None = None
    y: str | None = None
    delta: bool = True
    notes: str = ""
    summary: SummarySettings | None = None


@dataclass(frozen=True)
class Spec:
    """A parsed, validated benchmark spec."""

    name: str
    title: str
    claim: str
    seeds: list[int]
    scenario: str | None = None
    attacks: list[str] = field(default_factory=list)
    defenses: list[str] = field(default_factory=list)
    benchmark: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    report: ReportSettings = field(default_factory=ReportSettings)
    exclusive: bool | None = None
    """``[run] exclusive``: run alone in ``bench`` (None: decided by its claim)."""

    @property
    def package(self) -> str:
        """The package a spec belongs to: its name up to the first '-' or '_'."""
        return self.name.split("-")[0].split("_")[0]

    def scenario_settings(self) -> Iterator[dict[str, Any]]:
        """Every scenario parameter setting of the sweep."""
        return sweep(self.params.get("scenario", {}))

    def component_settings(self, role: str, name: str) -> Iterator[dict[str, Any]]:
        """Every parameter setting of the attack or defense ``name``."""
        return sweep(self.params.get(role, {}).get(name, {}))

    def benchmark_settings(self) -> Iterator[dict[str, Any]]:
        """Every parameter setting of the measurement benchmark."""
        return sweep(self.params.get("benchmark", {}))


def parse(data: Mapping[str, Any], name: str) -> Spec:
    """Validate a spec's TOML data."""
    _refuse_unknown(f"spec {name!r}", "key(s)", data, TOP_KEYS)
    title = data.get("title", name)
    _expect(f"spec {name!r}: title", title, str, "a string")
    claim = data.get("claim", "")
    _expect(f"spec {name!r}: claim", claim, str, "a string")
    seeds = data.get("seeds", [0])
    _expect(f"spec {name!r}: seeds", seeds, list, "a non-empty list of integers >= 0")
    if not seeds or any(
        not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds
    ):
        raise SpecError(
            f"spec {name!r}: seeds must be a non-empty list of integers >= 0, "
            f"got {seeds!r}"
        )
    scenario = data.get("scenario")
    benchmark = data.get("benchmark")
    if (scenario is None) == (benchmark is None):
        raise SpecError(
            f"spec {name!r}: give exactly one of 'scenario' (a game) or "
            "'benchmark' (a measurement)"
        )
    attacks: list[str] = []
    defenses: list[str] = []
    if scenario is not None:
        _expect(f"spec {name!r}: scenario", scenario, str, "a string")
        attacks = _str_list(f"spec {name!r}: attacks", data.get("attacks", []))
        if not attacks:
            raise SpecError(f"spec {name!r}: a game spec needs at least one attack")
        defenses = _str_list(f"spec {name!r}: defenses", data.get("defenses", ["none"]))
        for key, names in (("attacks", attacks), ("defenses", defenses)):
            if len(set(names)) != len(names):
                raise SpecError(
                    f"spec {name!r}: {key} must not repeat a name, got {names} "
                    "(a sweep goes in its [params] table)"
                )
    else:
        _expect(f"spec {name!r}: benchmark", benchmark, str, "a string")
        for key in ("attacks", "defenses"):
            if key in data:
                raise SpecError(
                    f"spec {name!r}: '{key}' belongs to game specs, "
                    "not to a benchmark spec"
                )
    params = data.get("params", {})
    _expect(f"spec {name!r}: params", params, dict, "a table")
    _refuse_unknown(f"spec {name!r}", "params section(s)", params, PARAM_KEYS)
    for role, names in (("attack", attacks), ("defense", defenses)):
        section = params.get(role, {})
        _expect(f"spec {name!r}: params.{role}", section, dict, "a table of tables")
        extra = sorted(set(section) - set(names))
        if extra:
            raise SpecError(
                f"spec {name!r}: params.{role} names {extra}, "
                f"which the spec does not run ({names})"
            )
        for key, value in section.items():
            _expect(f"spec {name!r}: params.{role}.{key}", value, dict, "a table")
    for role in ("scenario", "benchmark"):
        _expect(f"spec {name!r}: params.{role}", params.get(role, {}), dict, "a table")
    run = data.get("run", {})
    _expect(f"spec {name!r}: run", run, dict, "a table")
    _refuse_unknown(f"spec {name!r}", "run key(s)", run, RUN_KEYS)
    if "exclusive" in run:
        _expect(
            f"spec {name!r}: run.exclusive", run["exclusive"], bool, "true or false"
        )
    raw_report = data.get("report", {})
    _expect(f"spec {name!r}: report", raw_report, dict, "a table")
    _refuse_unknown(f"spec {name!r}", "report key(s)", raw_report, REPORT_KEYS)
    where = f"spec {name!r}: report"
    columns = _str_list(f"{where}.columns", raw_report.get("columns", []))
    for column in columns:
        check_metric(f"{where}.columns", column)
    if len(set(columns)) != len(columns):
        raise SpecError(f"{where}.columns must not repeat a metric, got {columns}")
    for key in ("x", "y"):
        if key in raw_report:
            check_metric(f"{where}.{key}", raw_report[key])
    if ("x" in raw_report) != ("y" in raw_report):
        raise SpecError(f"{where}: give both 'x' and 'y' (the plot's axes) or neither")
    delta = raw_report.get("delta", True)
    _expect(f"{where}.delta", delta, bool, "true or false")
    notes = raw_report.get("notes", "")
    _expect(f"{where}.notes", notes, str, "a string")
    report = ReportSettings(
        summary=_summary(name, raw_report.get("summary")),
        columns=columns,
        x=raw_report.get("x"),
        y=raw_report.get("y"),
        delta=delta,
        notes=notes,
    )
    return Spec(
        name=name,
        title=title,
        claim=claim,
        seeds=list(seeds),
        scenario=scenario,
        attacks=attacks,
        defenses=defenses,
        benchmark=benchmark,
        params=dict(params),
        report=report,
        exclusive=run.get("exclusive"),
    )


def _summary(name: str, raw: Any) -> SummarySettings | None:
    if raw is None:
        return None
    where = f"spec {name!r}: report.summary"
    _expect(where, raw, dict, "a table")
    _refuse_unknown(where, "key(s)", raw, SUMMARY_KEYS)
    for key in ("threat", "metric", "defense"):
        if key not in raw:
            raise SpecError(f"{where}: '{key}' is required")
    for key in sorted(raw.keys() - {"relative_change", "peers", "interval"}):
        if key not in MAGNITUDE_KEYS:
            _expect(f"{where}.{key}", raw[key], str, "a string")
    for key in ("relative_change", *MAGNITUDE_KEYS):
        if key in raw:
            _expect(f"{where}.{key}", raw[key], (int, float), "a number")
    peers = _str_list(f"{where}.peers", raw.get("peers", []))
    interval = _str_list(f"{where}.interval", raw.get("interval", []))
    try:
        return SummarySettings(**{**raw, "peers": peers, "interval": interval})
    except SpecError as error:
        raise SpecError(f"spec {name!r}: {error}") from None


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file; its name is the file's stem."""
    p = Path(path)
    try:
        with p.open("rb") as handle:
            data = tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise SpecError(f"{p}: not valid TOML: {error}") from error
    return parse(data, p.stem)
