"""A security report for one defended system, in Markdown and JSON.

For every result whose defense label starts with the system's name: the threat
models it was evaluated under, the formal guarantee it states (certificate metrics),
its utility, and every attack run against it beside the undefended system's numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from defenses.results import UNDEFENDED, Result, describe


def _stats(results: Sequence[Result], section: str) -> dict[str, dict[str, float]]:
    keys = dict.fromkeys(k for r in results for k in getattr(r, section))
    out = {}
    for key in keys:
        summary = describe(
            [getattr(r, section)[key] for r in results if key in getattr(r, section)]
        )
        out[key] = {"mean": summary.mean, "std": summary.std, "n": summary.n}
    return out


def security_report(results: Sequence[Result], system: str) -> dict[str, Any]:
    """Collect what is known of ``system`` (a defense name or label prefix)."""
    defended = [r for r in results if r.defense.startswith(system)]
    if not defended:
        known = sorted({r.defense.split("(")[0] for r in results})
        raise ValueError(
            f"no results for system {system!r}; defenses in results: {known}"
        )
    threats = list(
        {
            json.dumps(r.threat, sort_keys=True): r.threat for r in defended if r.threat
        }.values()
    )
    attacks = []
    for scenario, attack in dict.fromkeys((r.scenario, r.attack) for r in defended):
        mine = [r for r in defended if (r.scenario, r.attack) == (scenario, attack)]
        base = [
            r
            for r in results
            if (r.scenario, r.attack, r.defense) == (scenario, attack, UNDEFENDED)
        ]
        attacks.append(
            {
                "scenario": scenario,
                "attack": attack,
                "defended": _stats(mine, "success"),
                "undefended": _stats(base, "success") if base else {},
            }
        )
    return {
        "system": system,
        "arms": sorted({r.defense for r in defended}),
        "threat_models": threats,
        "guarantee": _stats(defended, "certificate"),
        "utility": _stats(defended, "utility"),
        "attacks": attacks,
    }


def _fmt(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "–"
    return f"{stats['mean']:.3f} ± {stats['std']:.3f} (n={int(stats['n'])})"


def security_markdown(report: dict[str, Any]) -> str:
    """Render :func:`security_report` as Markdown."""
    lines = [
        f"# Security report: `{report['system']}`",
        "",
        "Arms: " + ", ".join(f"`{a}`" for a in report["arms"]),
        "",
        "## Threat models",
        "",
    ]
    if not report["threat_models"]:
        lines.append("- none declared (measurement benchmarks without an attack game)")
    for threat in report["threat_models"]:
        caps = ", ".join(threat.get("capabilities", [])) or "–"
        budget = {k: v for k, v in threat.get("budget", {}).items() if v is not None}
        lines.append(
            f"- goal {threat.get('goal', '–')}, stage {threat.get('stage', '–')}, "
            f"{threat.get('knowledge', '–')}, capabilities: {caps}, "
            f"budget: {budget or 'unlimited'}, "
            f"adaptive: {threat.get('adaptive', False)}"
        )
    lines += ["", "## Guarantee", ""]
    if report["guarantee"]:
        lines += [f"- {k}: {_fmt(v)}" for k, v in report["guarantee"].items()]
    else:
        lines.append("- none stated (no certificate metrics)")
    lines += ["", "## Utility", ""]
    lines += [f"- {k}: {_fmt(v)}" for k, v in report["utility"].items()]
    lines += [
        "",
        "## Attacks",
        "",
        "| scenario | attack | metric | defended | undefended |",
        "|---|---|---|---|---|",
    ]
    for entry in report["attacks"]:
        for metric, stats in entry["defended"].items():
            lines.append(
                f"| {entry['scenario']} | {entry['attack']} | {metric} | {_fmt(stats)} "
                f"| {_fmt(entry['undefended'].get(metric))} |"
            )
    return "\n".join(lines) + "\n"
