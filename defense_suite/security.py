"""A security report for one defended system, arm by arm, in Markdown and JSON.

For every arm whose defense label starts with the system's name (one arm per
defense setting and scenario setting, never pooled across them): the threat models
it was evaluated under, the formal guarantee it states (certificate metrics), its
utility, and every attack run against it beside the undefended system's numbers at
the same scenario and attack settings. The report also says which party enforces
each defense's guarantee: a guarantee is only as good as the side that checks it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from defenses.results import UNDEFENDED, Result, describe, group_by_arm

ENFORCED_BY: dict[str, str] = {
    "ssd": "the model owner's post-processor: SSD runs where the model's scores "
    "become answers, so every query is shielded before it leaves the owner",
    "rps": "the learner: the robust conformal sets are built from the partition "
    "of the training and calibration data that the learner itself makes and votes "
    "over",
    "s3t": "the service and its store: the service deactivates the slices that "
    "saw a deleted row, and its store leaves no copy of deleted rows on disk",
    "civet": "the trainer and certifier: the bound holds for the model the "
    "trainer trained and certified, not for a model swapped in afterwards",
    "federated": "each client: it checks every round the server asks for "
    "against its own budget and privacy ledger, and refuses one that would exceed "
    "it",
    "crypto": "the client holding the secret key: the server receives only "
    "ciphertexts and the public context, and nothing that can reach the key",
    "reference": "the model owner's output layer: answers are rounded or cut to "
    "labels before they leave the owner",
}
"""Per package, the party whose code enforces the package's guarantee."""


def package_of(result: Result) -> str:
    """The package a result's defense comes from (the registry, else its spec)."""
    from defenses.registry import available, load

    name = result.defense.split("(")[0]
    if name in available("defenses"):
        parts = load("defenses", name).__module__.split(".")
        root = [p for p in parts if p not in ("defenses", "defense_suite")]
        if root:
            return str(root[0])
    return str(result.meta.get("spec", "")).split("-")[0].split("_")[0]


def _stats(results: Sequence[Result], section: str) -> dict[str, dict[str, float]]:
    keys = dict.fromkeys(k for r in results for k in getattr(r, section))
    out = {}
    for key in keys:
        summary = describe(
            [getattr(r, section)[key] for r in results if key in getattr(r, section)]
        )
        out[key] = {"mean": summary.mean, "std": summary.std, "n": summary.n}
    return out


def _setting(result: Result) -> str:
    scenario = result.params.get("scenario") or result.params.get("benchmark") or {}
    shown = ", ".join(f"{k}={v}" for k, v in scenario.items())
    return f"{result.scenario}({shown})" if shown else result.scenario


def _baseline(results: Sequence[Result], arm: Sequence[Result]) -> list[Result]:
    first = arm[0]
    seeds = {r.seed for r in arm}
    return [
        r
        for r in results
        if r.defense == UNDEFENDED
        and (r.scenario, r.attack) == (first.scenario, first.attack)
        and r.params.get("scenario") == first.params.get("scenario")
        and r.params.get("benchmark") == first.params.get("benchmark")
        and r.params.get("attack") == first.params.get("attack")
        and r.seed in seeds
    ]


def security_report(results: Sequence[Result], system: str) -> dict[str, Any]:
    """Collect what is known of ``system`` (a defense name or label prefix), per arm."""
    defended = [r for r in results if r.defense.startswith(system)]
    if not defended:
        known = sorted({r.defense.split("(")[0] for r in results})
        raise ValueError(
            f"--system {system!r}: no results for it; defenses in results: {known}"
        )
    threats = list(
        {
            json.dumps(r.threat, sort_keys=True): r.threat for r in defended if r.threat
        }.values()
    )
    packages = sorted({package_of(r) for r in defended})
    arms = []
    for runs in group_by_arm(defended).values():
        first = runs[0]
        base = _baseline(results, runs)
        arms.append(
            {
                "defense": first.defense,
                "setting": _setting(first),
                "attack": first.attack,
                "seeds": sorted({r.seed for r in runs}),
                "guarantee": _stats(runs, "certificate"),
                "utility": _stats(runs, "utility"),
                "defended": _stats(runs, "success"),
                "undefended": _stats(base, "success") if base else {},
            }
        )
    return {
        "system": system,
        "enforced_by": {p: ENFORCED_BY.get(p, "not stated") for p in packages},
        "threat_models": threats,
        "arms": arms,
    }


def _fmt(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "–"
    spread = f" ± {stats['std']:.3f}" if stats["std"] else ""
    return f"{stats['mean']:.3f}{spread} (n={int(stats['n'])})"


def _threat_lines(threats: Sequence[dict[str, Any]]) -> list[str]:
    if not threats:
        return ["- none declared (measurement benchmarks without an attack game)"]
    lines = []
    for threat in threats:
        caps = ", ".join(threat.get("capabilities", [])) or "–"
        budget = {k: v for k, v in threat.get("budget", {}).items() if v is not None}
        lines.append(
            f"- goal {threat.get('goal', '–')}, stage {threat.get('stage', '–')}, "
            f"{threat.get('knowledge', '–')}, capabilities: {caps}, "
            f"budget: {budget or 'unlimited'}, "
            f"adaptive: {threat.get('adaptive', False)}"
        )
    return lines


def security_markdown(report: dict[str, Any]) -> str:
    """Render :func:`security_report` as Markdown, one section per arm."""
    lines = [f"# Security report: `{report['system']}`", "", "## Who enforces it", ""]
    lines += [f"- {p}: {text}" for p, text in report["enforced_by"].items()]
    lines += ["", "## Threat models", "", *_threat_lines(report["threat_models"])]
    for arm in report["arms"]:
        lines += [
            "",
            f"## Arm `{arm['defense']}` on {arm['setting']}, attack {arm['attack']}",
            "",
            f"Seeds {arm['seeds']}.",
            "",
            "Guarantee: "
            + (
                "; ".join(f"{k} {_fmt(v)}" for k, v in arm["guarantee"].items())
                or "none stated (no certificate metrics)"
            ),
            "",
            "Utility: "
            + ("; ".join(f"{k} {_fmt(v)}" for k, v in arm["utility"].items()) or "–"),
        ]
        if arm["defended"]:
            lines += [
                "",
                "| metric | defended | undefended |",
                "|---|---|---|",
                *(
                    f"| {metric} | {_fmt(stats)} "
                    f"| {_fmt(arm['undefended'].get(metric))} |"
                    for metric, stats in arm["defended"].items()
                ),
            ]
    return "\n".join(lines) + "\n"
