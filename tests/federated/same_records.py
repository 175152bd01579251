"""Are two results files the same records, bit for bit, times aside?

``python -m tests.federated.same_records before.jsonl after.jsonl`` compares two
JSON Lines results of one spec record by record and field by field (floats by
their ``repr``, so one ulp is a difference), skipping only what a run measures
about itself: the ``cost`` fields that are times (``*_s``) or memory
(``peak_rss_mb``). It prints the differing fields and exits 1 if there is any.
A speed-up of the numpy backend must leave every record of the federated specs
unchanged (issue 42).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _measured(path: str, key: str) -> bool:
    return path.endswith(".cost") and (key.endswith("_s") or key == "peak_rss_mb")


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """The paths at which ``a`` and ``b`` differ (run times and memory skipped)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if _measured(path, key):
                continue
            if key not in a or key not in b:
                out.append(f"{path}.{key} (missing on one side)")
            else:
                out += differences(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if repr(a) == repr(b) else [f"{path}: {a!r} != {b!r}"]


def compare(first: Path, second: Path) -> list[str]:
    """Every differing field of two results files, record by record."""
    a = [json.loads(line) for line in first.read_text().splitlines() if line]
    b = [json.loads(line) for line in second.read_text().splitlines() if line]
    if len(a) != len(b):
        return [f"{len(a)} records != {len(b)} records"]
    return [
        d
        for i, (x, y) in enumerate(zip(a, b, strict=True))
        for d in differences(x, y, f"record {i}")
    ]


if __name__ == "__main__":
    found = compare(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(found[:20]))
    print(f"{len(found)} differing fields")
    sys.exit(1 if found else 0)
