"""Start-up time of the command line, the imports and the first calls (issues 31, 40).

Each command runs in a fresh interpreter ``--repeat`` times; the table shows the
median and the fastest wall-clock time, which is what a user waits before anything
happens. Run from the checkout (or anywhere the suite is installed)::

    python benchmarks/startup.py [--repeat 7] [--json results/startup.json]
        [--first-calls] [--cold-repeat 1] [--cold-only]

Targets: ``defense-suite --help`` and ``import defenses.ssd`` under 1 s.

``--first-calls`` times the first call of each compiled kernel path in fresh
interpreters (see :mod:`defenses.jit`): **cold**, each case with its own empty
kernel cache (``DEFENSE_SUITE_CACHE_DIR`` set to a new folder: what a process pays
when nothing compiled the kernels before), then ``python -m defenses.jit`` once (the
install step, timed) and **cached**, each case in a fresh interpreter reading that
cache; ``second`` is the same call again in the same process. On a cold cache SSD's
calls are answered by the kernels' numpy twins while a background process compiles
(:mod:`defenses.ssd.kernels.background`); the probe then waits for it (``ready``:
seconds from the first call until the compiled code is cached), calls once more
(``switch``: the call that loads the compiled code) and once again (``warm``: the
kernel's speed). Target: every first call within 5 s, cold or cached. The load
average is printed: this is a measurement, not a test, and a loaded machine makes
every number larger.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 1.0
FIRST_CALL_TARGET_S = 5.0

SETUP = {
    "k10": "f = rng.dirichlet(np.ones(10), size=2000)",
    "k100": "f = rng.dirichlet(np.ones(100), size=2000)",
}
FIRST_CALLS = {
    "StealthyShield K=10 float64 (row-batched kernel)": (
        "k10",
        "StealthyShield(seed=0).fit(f[:100], np.arange(100) % 10)",
        "shield(f)",
    ),
    "StealthyShield K=10 float32": (
        "k10",
        "StealthyShield(seed=0).fit(f[:100], np.arange(100) % 10)",
        "shield(f.astype(np.float32))",
    ),
    "StealthyShield K=100 float64 (row kernel)": (
        "k100",
        "StealthyShield(seed=0).fit(f[:300], np.arange(300) % 100)",
        "shield(f)",
    ),
    "StealthyShield K=10 input-hash (keyed BLAKE2b)": (
        "k10",
        "StealthyShield(seed=0, seeding='input-hash')"
        ".fit(f[:100], np.arange(100) % 10)",
        "shield(f)",
    ),
    "water_filling K=10": ("k10", "None", "water_filling(f, f[::-1], f[:, 0])"),
}
PROBE = """
import json, time
start = time.perf_counter()
import numpy as np
from defenses.ssd import StealthyShield, water_filling
rng = np.random.default_rng(0)
{setup}
shield = {build}
imported = time.perf_counter()
{call}
first = time.perf_counter()
{call}
second = time.perf_counter()
from defenses.ssd.kernels import background
background.wait(900)
ready = time.perf_counter()
{call}
switch = time.perf_counter()
{call}
warm = time.perf_counter()
print(json.dumps({{"import_s": imported - start, "first_s": first - imported,
                  "second_s": second - first, "ready_s": ready - imported,
                  "switch_s": switch - ready, "warm_s": warm - switch}}))
"""


def commands() -> dict[str, list[str]]:
    """The commands timed, by the name shown in the table."""
    python = sys.executable
    script = shutil.which("defense-suite") or str(
        Path(python).with_name("defense-suite")
    )
    return {
        "python -c pass (interpreter alone)": [python, "-c", "pass"],
        "defense-suite --help": [script, "--help"],
        "defense-suite --version": [script, "--version"],
        "defense-suite list": [script, "list"],
        "import defenses": [python, "-c", "import defenses"],
        "import defense_suite.cli": [python, "-c", "import defense_suite.cli"],
        "import defenses.ssd": [python, "-c", "import defenses.ssd"],
    }


def measure(argv: list[str], repeat: int) -> list[float]:
    """Wall-clock seconds of ``repeat`` fresh runs of ``argv``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def probe(name: str, cache: str) -> dict[str, float]:
    """Run the first-call case ``name`` in a fresh interpreter with ``cache``."""
    key, build, call = FIRST_CALLS[name]
    code = PROBE.format(setup=SETUP[key], build=build, call=call)
    env = dict(os.environ, DEFENSE_SUITE_CACHE_DIR=cache)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr}")
    row: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    row["background"] = done.stderr.count("in a background process")
    row["compiles"] = done.stderr.count(": first call with these types")
    return row


def first_calls(
    cold_repeat: int, cached_repeat: int, cold_only: bool = False
) -> dict[str, object]:
    """Cold and cached first calls of every case, and the install step's time.

    Cold and cached: the median run of ``cold_repeat`` and ``cached_repeat`` runs
    (no cold runs if 0).
    """
    rows: dict[str, dict[str, float]] = {}
    for name in FIRST_CALLS if cold_repeat else ():
        runs = []
        for _ in range(cold_repeat):
            with tempfile.TemporaryDirectory() as empty:
                runs.append(probe(name, empty))
        runs.sort(key=lambda r: r["first_s"])
        rows[f"cold: {name}"] = runs[len(runs) // 2]  # the median run
    if cold_only:
        return {"install_step_s": float("nan"), "rows": rows}
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "defenses.jit"],
            env=dict(os.environ, DEFENSE_SUITE_CACHE_DIR=cache),
            check=True,
            capture_output=True,
        )
        install_s = time.perf_counter() - start
        for name in FIRST_CALLS:
            runs = [probe(name, cache) for _ in range(cached_repeat)]
            runs.sort(key=lambda r: r["first_s"])
            rows[f"cached: {name}"] = runs[len(runs) // 2]  # the median run
    return {"install_step_s": install_s, "rows": rows}


def print_first_calls(result: dict[str, object]) -> None:
    """The first-call table in Markdown."""
    rows = result["rows"]
    assert isinstance(rows, dict)
    print(
        f"\n`python -m defenses.jit` (install step): {result['install_step_s']:.1f} s"
    )
    print(
        "| first call | import (s) | first call (s) | second call (s) | compiled "
        "in the call | in the background | compiled code ready (s) | switching "
        "call (s) | warm call (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['import_s']:.2f} | {row['first_s']:.2f} | "
            f"{row['second_s']:.3f} | {int(row['compiles'])} | "
            f"{int(row['background'])} | {row['ready_s']:.1f} | "
            f"{row['switch_s']:.3f} | {row['warm_s']:.4f} |"
        )


def main() -> int:
    """Time every command and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--first-calls", action="store_true")
    parser.add_argument("--only-first-calls", action="store_true")
    parser.add_argument("--cold-repeat", type=int, default=1, help="0: no cold runs")
    parser.add_argument(
        "--cold-only", action="store_true", help="no install step, no cached runs"
    )
    args = parser.parse_args()
    rows = {}
    for name, argv in commands().items():
        if args.only_first_calls:
            break
        times = measure(argv, args.repeat)
        rows[name] = {"median_s": statistics.median(times), "min_s": min(times)}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.repeat} runs each; load average {load:.1f} on {os.cpu_count()} CPUs")
    print("| command | median (s) | fastest (s) | under 1 s |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        ok = "yes" if row["median_s"] < TARGET_S else "no"
        print(f"| `{name}` | {row['median_s']:.2f} | {row['min_s']:.2f} | {ok} |")
    report: dict[str, object] = {"load": load, "rows": rows}
    if args.first_calls or args.only_first_calls:
        report["first_calls"] = first_calls(
            args.cold_repeat, args.repeat, args.cold_only
        )
        report["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0
        print_first_calls(report["first_calls"])  # type: ignore[arg-type]
        print(f"load average after: {report['load_after']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
