"""SSD's row-batched kernel with its answer at every offset within a cache line.

Run from the repository root::

    .venv/bin/python benchmarks/ssd_answer_offsets.py

The kernel (:func:`defenses.ssd.kernels.small.shield_rows_small`) keeps its block
scratch in the answer's last rows, so the answer's address could decide whether the
scratch's columns lie on 32-byte boundaries. This times the kernel on the
``ssd_perf`` array (Dirichlet(0.3), N = 10,000, K = 10, one thread) writing into an
answer placed at each offset its dtype allows within a 64-byte line, interleaved,
minimum of ``--repeats`` process-CPU times, and prints ns a row per offset and the
slowest over the fastest. Run it on two trees to compare them (0.4.0 took 1.2x at
six of the eight float64 offsets; the scratch now starts on a line, see
docs/ssd.md, "Performance").
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from defenses.jit import compile_in_call
from defenses.ssd.batch import frozen
from defenses.ssd.defense import StealthyShield
from defenses.ssd.kernels.small import shield_rows_small
from defenses.ssd.waterfill import FLOOR, MAX_NEWTON_STEPS
from defenses.threads import single_thread

LINE = 64


def main() -> None:
    """Time the kernel at every answer offset, for float64 and float32 rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    n, k = args.rows, args.classes
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(k, 0.3), n)
    shield = StealthyShield(epsilon=0.5, seed=0, n_threads=1).fit(
        rng.dirichlet(np.full(k, 0.3), 2 * k), np.arange(2 * k) % k
    )
    prototypes = frozen(shield.prototypes_)  # type: ignore[arg-type]
    settings = np.array([0.5, -1.0, shield.temperature_, FLOOR])
    print(f"N = {n}, K = {k}, load {os.getloadavg()[0]:.2f}; ns a row by offset:")
    for dtype in (np.float64, np.float32):
        rows = frozen(probs.astype(dtype))
        size = np.dtype(dtype).itemsize
        buffer = np.empty(n * k + 2 * LINE // size, dtype=dtype)
        first = -buffer.ctypes.data % LINE // size
        answers = {
            offset * size: buffer[first + offset :][: n * k].reshape(n, k)
            for offset in range(LINE // size)
        }

        def call(out: np.ndarray, rows: np.ndarray = rows) -> None:
            shield_rows_small(
                rows, prototypes, frozen(np.empty(0)), shield.key_, np.uint64(0),
                settings, MAX_NEWTON_STEPS, 0, n, out, np.empty(0, dtype=np.int64),
            )  # fmt: skip

        best = dict.fromkeys(answers, np.inf)
        with single_thread(), compile_in_call():
            for out in answers.values():
                call(out)
            for _ in range(args.repeats):
                for offset, out in answers.items():
                    start = time.process_time()
                    call(out)
                    best[offset] = min(best[offset], time.process_time() - start)
        per_row = {offset: 1e9 * t / n for offset, t in best.items()}
        cells = "  ".join(f"{offset}: {t:.1f}" for offset, t in per_row.items())
        spread = max(per_row.values()) / min(per_row.values())
        print(f"{np.dtype(dtype).name}: {cells}  (slowest / fastest {spread:.2f})")


if __name__ == "__main__":
    main()
