"""Start-up time of the command line and of the packages' imports (issue 31).

Each command runs in a fresh interpreter ``--repeat`` times; the table shows the
median and the fastest wall-clock time, which is what a user waits before anything
happens. Run from the checkout (or anywhere the suite is installed)::

    python benchmarks/startup.py [--repeat 7] [--json results/startup.json]

Targets: ``defense-suite --help`` and ``import defenses.ssd`` under 1 s. This is a
measurement, not a test: a loaded machine makes every number larger.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 1.0


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


def main() -> int:
    """Time every command and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    rows = {}
    for name, argv in commands().items():
        times = measure(argv, args.repeat)
        rows[name] = {"median_s": statistics.median(times), "min_s": min(times)}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.repeat} runs each; load average {load:.1f} on {os.cpu_count()} CPUs")
    print("| command | median (s) | fastest (s) | under 1 s |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        ok = "yes" if row["median_s"] < TARGET_S else "no"
        print(f"| `{name}` | {row['median_s']:.2f} | {row['min_s']:.2f} | {ok} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
