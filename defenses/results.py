"""The result record shared by every package, its JSON Lines I/O and summaries.

Conventions: ``success`` metrics are higher for a stronger attack; ``utility`` metrics
are higher for a better system unless the name says otherwise (``set_size``, ``mse``,
``loss``). Paired deltas (defended minus undefended at the same seed) remove the
between-seed variance that unpaired means carry.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SECTIONS = ("utility", "success", "cost", "certificate")
UNDEFENDED = "none"


@dataclass(frozen=True, slots=True)
class Result:
    """One run of one arm: an attack against a (possibly defended) system."""

    scenario: str
    attack: str
    defense: str
    seed: int
    threat: Mapping[str, Any]
    utility: Mapping[str, float]
    success: Mapping[str, float]
    cost: Mapping[str, float]
    certificate: Mapping[str, float] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("scenario", "attack", "defense"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(
                    f"Result.{name} must be a string, got {getattr(self, name)!r}"
                )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"Result.seed must be an integer, got {self.seed!r}")
        for name in ("threat", "params", "meta", *SECTIONS):
            if not isinstance(getattr(self, name), Mapping):
                raise TypeError(
                    f"Result.{name} must be a mapping, got {getattr(self, name)!r}"
                )
        for section in SECTIONS:
            values = getattr(self, section)
            for key, value in values.items():
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise TypeError(
                        f"Result.{section}[{key!r}] must be a number, got {value!r}"
                    )
                if not math.isfinite(value):
                    raise ValueError(
                        f"Result.{section}[{key!r}] is {value}; metrics must be finite"
                    )

    def get(self, path: str) -> float:
        """Return a metric by dotted path, e.g. ``"success.auc"``."""
        section, _, key = path.partition(".")
        if section not in SECTIONS or not key:
            raise KeyError(
                f"metric path must be '<section>.<name>' with section in {SECTIONS}, "
                f"got {path!r}"
            )
        values: Mapping[str, float] = getattr(self, section)
        if key not in values:
            raise KeyError(
                f"{path!r} not in this result; {section} has {sorted(values)}"
            )
        return float(values[key])

    @property
    def arm(self) -> tuple[str, str, str, str]:
        """The arm this run belongs to: scenario, attack, defense, parameters."""
        return (
            self.scenario,
            self.attack,
            self.defense,
            json.dumps(self.params, sort_keys=True),
        )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(data))


def write_jsonl(results: Iterable[Result], path: str | Path) -> int:
    """Append results to a JSON Lines file; return how many were written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with target.open("a", encoding="utf-8") as handle:
        for result in results:
            handle.write(json.dumps(result.to_dict(), sort_keys=True) + "\n")
            n += 1
    return n


def read_jsonl(*paths: str | Path) -> list[Result]:
    """Read every result from the given JSON Lines files.

    Raises
    ------
    ValueError
        Naming the file (and the line) when a path is not a readable file or a
        line is not a valid result record.
    """
    results: list[Result] = []
    for path in map(Path, paths):
        if path.is_dir():
            raise ValueError(f"{path}: is a directory, not a results file")
        if not path.is_file():
            raise ValueError(f"{path}: no such results file")
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    if not isinstance(data, dict):
                        raise TypeError(f"expected a JSON object, got {data!r:.60}")
                    results.append(Result.from_dict(data))
                except (json.JSONDecodeError, TypeError, ValueError) as error:
                    raise ValueError(
                        f"{path}:{number}: not a result record: {error}"
                    ) from error
    return results


@dataclass(frozen=True, slots=True)
class Summary:
    """Mean, sample standard deviation and count of one metric over seeds."""

    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.std:.3f}"


def describe(values: Sequence[float]) -> Summary:
    """Summarize values (std is 0 for a single value)."""
    if not values:
        raise ValueError("cannot summarize an empty list of values")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return Summary(statistics.fmean(values), std, len(values))


def group_by_arm(
    results: Iterable[Result],
) -> dict[tuple[str, str, str, str], list[Result]]:
    """Group results by arm, keeping first-seen order."""
    groups: dict[tuple[str, str, str, str], list[Result]] = defaultdict(list)
    for result in results:
        groups[result.arm].append(result)
    return dict(groups)


def summarize(
    results: Iterable[Result], columns: Sequence[str]
) -> list[tuple[Result, dict[str, Summary | None]]]:
    """Per arm: a representative result and each column's summary over seeds.

    A column an arm does not report summarizes to None.
    """
    rows = []
    for runs in group_by_arm(results).values():
        cells: dict[str, Summary | None] = {}
        for column in columns:
            values = [r.get(column) for r in runs if _has(r, column)]
            cells[column] = describe(values) if values else None
        rows.append((runs[0], cells))
    return rows


def _has(result: Result, path: str) -> bool:
    section, _, key = path.partition(".")
    return section in SECTIONS and key in getattr(result, section)


def _baseline_key(result: Result) -> tuple[str, str, str, int]:
    scenario_params = json.dumps(result.params.get("scenario", {}), sort_keys=True)
    attack_params = json.dumps(result.params.get("attack", {}), sort_keys=True)
    return (
        result.scenario,
        result.attack,
        scenario_params + attack_params,
        result.seed,
    )


def paired_deltas(
    results: Iterable[Result], columns: Sequence[str]
) -> list[tuple[Result, dict[str, Summary | None]]]:
    """Per defended arm: summaries of (defended - undefended) at the same seed.

    The undefended run paired with a defended one shares scenario, attack, their
    parameters and the seed. Defended arms without any undefended partner are left
    out.
    """
    materialized = list(results)
    baseline = {_baseline_key(r): r for r in materialized if r.defense == UNDEFENDED}
    rows = []
    for runs in group_by_arm(
        r for r in materialized if r.defense != UNDEFENDED
    ).values():
        pairs = [
            (r, baseline[_baseline_key(r)])
            for r in runs
            if _baseline_key(r) in baseline
        ]
        if not pairs:
            continue
        cells: dict[str, Summary | None] = {}
        for column in columns:
            diffs = [
                d.get(column) - u.get(column)
                for d, u in pairs
                if _has(d, column) and _has(u, column)
            ]
            cells[column] = describe(diffs) if diffs else None
        rows.append((pairs[0][0], cells))
    return rows


@dataclass(frozen=True, slots=True)
class Interval:
    r"""A mean with its two-sided Student-t confidence interval over ``n`` values.

    For values :math:`x_1, \dots, x_n` with mean :math:`\bar x` and sample standard
    deviation :math:`s`, the interval is
    :math:`\bar x \pm t_{(1+\ell)/2,\, n-1}\, s / \sqrt n` at level :math:`\ell`.
    With paired differences (defended minus baseline at the same seed and setting)
    it is the paired t-interval.
    """

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95

    def __str__(self) -> str:
        return (
            f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] "
            f"({self.level:.0%}, n={self.n})"
        )

    @property
    def excludes_zero(self) -> bool:
        """Whether 0 lies outside the interval."""
        return self.low > 0.0 or self.high < 0.0


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The Student-t interval of the mean of ``values`` (at least two) at ``level``.

    Raises
    ------
    ValueError
        For fewer than two values, a non-finite value, or ``level`` outside (0, 1).
    """
    from scipy import stats

    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    data = [float(v) for v in values]
    if len(data) < 2:
        raise ValueError(
            f"a t-interval needs at least 2 values (paired seeds), got {len(data)}"
        )
    if not all(math.isfinite(v) for v in data):
        raise ValueError(f"values must be finite, got {data}")
    mean = statistics.fmean(data)
    half = float(stats.t.ppf(0.5 + level / 2, len(data) - 1)) * (
        statistics.stdev(data) / math.sqrt(len(data))
    )
    return Interval(mean, mean - half, mean + half, len(data), level)


def pair_key(result: Result) -> str:
    """What a paired run shares with its partner: the seed and the scenario params."""
    return json.dumps([result.seed, result.params.get("scenario", {})], sort_keys=True)


def paired_differences(
    defended: Iterable[Result], baseline: Iterable[Result], metric: str
) -> list[float]:
    """``metric`` of each defended run minus its baseline partner (:func:`pair_key`).

    Runs without a partner, or where either side lacks the metric, are left out.
    Raises ValueError if two baseline runs share a key (the pairing is ambiguous).
    """
    base: dict[str, Result] = {}
    for r in baseline:
        key = pair_key(r)
        if key in base:
            raise ValueError(f"two baseline runs share the pairing key {key}")
        base[key] = r
    return [
        d.get(metric) - base[pair_key(d)].get(metric)
        for d in defended
        if pair_key(d) in base and _has(d, metric) and _has(base[pair_key(d)], metric)
    ]


def interval_outcome(interval: Interval, direction: str) -> str:
    """What a paired interval says about a claimed direction of the difference.

    ``direction = "higher"``: ``"reproduced"`` if the interval lies above 0,
    ``"contradicted"`` if it lies below, else ``"inconclusive"``; ``"lower"`` is the
    mirror image.
    """
    if direction not in ("higher", "lower"):
        raise ValueError(f"direction must be 'higher' or 'lower', got {direction!r}")
    sign = 1.0 if direction == "higher" else -1.0
    low, high = sorted((sign * interval.low, sign * interval.high))
    if low > 0.0:
        return "reproduced"
    if high < 0.0:
        return "contradicted"
    return "inconclusive"


def paired_interval(
    defended: Iterable[Result],
    baseline: Iterable[Result],
    metric: str,
    direction: str,
    level: float = 0.95,
) -> tuple[Interval, str] | None:
    """The paired t-interval of ``metric`` (defended minus baseline) and its outcome.

    The outcome is :func:`interval_outcome`'s (``"reproduced"``, ``"contradicted"``
    or ``"inconclusive"``) for a claimed ``direction`` ("higher" or "lower"). None
    when fewer than two runs pair up (no interval can be formed).
    """
    diffs = paired_differences(defended, baseline, metric)
    if len(diffs) < 2:
        return None
    interval = t_interval(diffs, level)
    return interval, interval_outcome(interval, direction)
