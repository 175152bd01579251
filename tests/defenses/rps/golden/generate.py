"""Writes ``radii.npz``: the galloping reference's radii on the test inputs.

Run once, from the repository root, while ``tests/defenses/rps/galloping_reference.py``
(the radius searches before the one-pass scan, a verbatim transcription of the old
kernels) still existed::

    .venv/bin/python -m tests.defenses.rps.golden.generate

Both files were removed in the commit after the one that added ``radii.npz``; check
out that commit to run it again. The archive holds the inputs (vote matrices,
threshold bounds, the variants' random choices) and the reference's outputs per
(point, class), so ``test_radii_reference.py`` needs neither the reference nor the
random generator's stream to compare the live kernels with it, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from defenses.rps.certificate import TIE, PartThresholds, certify_batch
from defenses.rps.scores import VoteGeometry, vote_geometry
from tests.defenses.rps import galloping_reference as ref
from tests.defenses.rps.test_radii_reference import (
    SHAPES,
    ceiling_of,
    digest,
    random_votes,
    thresholds_of,
    variants,
)

OUT = Path(__file__).with_name("radii.npz")


class Packer:
    """Arrays of one kind concatenated flat, with a JSON table of where each is."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {"i": [], "f": [], "d": []}
        self.sizes = {"i": 0, "f": 0, "d": 0}
        self.table: dict[str, list[object]] = {}

    def put(self, name: str, array: np.ndarray, kind: str = "") -> None:
        kind = kind or ("f" if array.dtype.kind == "f" else "i")
        dtype = {"i": np.int64, "f": np.float64, "d": np.uint8}[kind]
        flat = np.ascontiguousarray(array, dtype)
        self.table[name] = [kind, self.sizes[kind], list(array.shape)]
        self.parts[kind].append(flat.ravel())
        self.sizes[kind] += flat.size

    def save(self, path: Path) -> None:
        ints = np.concatenate(self.parts["i"])
        assert ints.min() >= -128
        assert ints.max() <= 127
        np.savez_compressed(
            path,
            table=np.array(json.dumps(self.table)),
            ints=ints.astype(np.int8),
            floats=np.concatenate(self.parts["f"]),
            digests=np.concatenate(self.parts["d"]),
        )


def reference_radii(
    geometry: VoteGeometry, bounds: PartThresholds
) -> dict[str, np.ndarray]:
    """The galloping search's training, joint and ``largest`` radii per (p, c)."""
    tables = ref.Tables(
        bounds.lower,
        bounds.upper,
        bounds.tau_hat,
        bounds.guard,
        TIE,
        geometry.n_voters,
        geometry.softmax,
    )
    in_set = geometry.score() >= bounds.cut
    calibration = bounds.calibration_radius(geometry, in_set, 0)
    training, joint = ref.training_and_joint(
        geometry.own, geometry.others, in_set, bounds.radius, calibration, tables
    )
    capped = np.minimum(ceiling_of(geometry, bounds.radius), bounds.radius)
    out = {"training": training, "joint": joint}
    for is_joint in (False, True):
        out[f"largest{int(is_joint)}"] = ref.largest_radius(
            geometry.own, geometry.others, in_set, capped, is_joint, tables
        )
    return {name: radii[geometry.index] for name, radii in out.items()}


def put_thresholds(pack: Packer, name: str, bounds: PartThresholds) -> None:
    pack.put(f"{name}/lower", bounds.lower)
    pack.put(f"{name}/upper", bounds.upper)
    pack.put(f"{name}/ints", np.array([bounds.tau_hat, bounds.guard]))


def radii_cases(pack: Packer) -> None:
    """``test_radii_equal_the_galloping_search``'s 48 ensembles, 2 sources, 7
    variants of the thresholds each."""
    for seed in range(12):
        for softmax in (True, False):
            for abstain in (False, True):
                rng = np.random.default_rng([seed, softmax, abstain])
                k_t, k = SHAPES[seed % len(SHAPES)]
                case = f"case/{seed}/{int(softmax)}/{int(abstain)}"
                votes = random_votes(rng, 120, k_t, k, abstain)
                other = random_votes(rng, 120, k_t, k, abstain)
                pack.put(f"{case}/votes", votes)
                geometry = vote_geometry(votes, k_t, softmax, abstain)
                sources = (vote_geometry(other, k_t, softmax, abstain), geometry)
                for s, source in enumerate(sources):
                    bounds = thresholds_of(rng, source, 120, k, k_t)
                    put_thresholds(pack, f"{case}/{s}", bounds)
                    guard = int(rng.integers(-1, 3))
                    cut = int(rng.integers(0, bounds.radius + 1))
                    pack.put(f"{case}/{s}/choices", np.array([guard, cut]))
                    for v, variant in enumerate(variants(bounds, guard, cut)):
                        for name, radii in reference_radii(geometry, variant).items():
                            pack.put(f"{case}/{s}/{v}/{name}", radii)


def benchmark_case(pack: Packer) -> None:
    """k_t = 50 parts, 10 classes, 600 points."""
    rng = np.random.default_rng(42)
    votes = random_votes(rng, 600, 50, 10, False)
    geometry = vote_geometry(votes, 50, True)
    bounds = thresholds_of(rng, geometry, 600, 10, 50)
    pack.put("bench/votes", votes)
    put_thresholds(pack, "bench", bounds)
    for name, radii in reference_radii(geometry, bounds).items():
        pack.put(f"bench/{name}", radii)


def bound_cases(pack: Packer) -> None:
    """Both bounds at every radius, 8 shapes, with and without abstentions: a
    digest of each radius's (n, K) float64 bits (:func:`digest`)."""
    rng = np.random.default_rng(7)
    for abstain in (False, True):
        for k_t, k in SHAPES:
            votes = random_votes(rng, 80, k_t, k, abstain)
            geometry = vote_geometry(votes, k_t, True, abstain)
            zero = np.zeros((1, 1))
            tables = ref.Tables(zero, zero, 0, 0, TIE, k_t, True)
            name = f"bounds/{int(abstain)}/{k_t}/{k}"
            pack.put(f"{name}/votes", votes)
            for upper in (False, True):
                digests = [
                    digest(
                        ref.bounds_at(geometry.own, geometry.others, r, upper, tables)[
                            geometry.index
                        ]
                    )
                    for r in range(k_t + 2)
                ]
                pack.put(f"{name}/{int(upper)}", np.stack(digests), "d")


def calibration_cases(pack: Packer) -> None:
    """The old numpy calibration radius at every training radius, per (p, c)."""
    for seed in range(6):
        rng = np.random.default_rng([seed, 5])
        k_t, k = SHAPES[(seed + 3) % len(SHAPES)]
        votes = random_votes(rng, 150, k_t, k, seed % 2 == 1)
        geometry = vote_geometry(votes, k_t, True, seed % 2 == 1)
        bounds = thresholds_of(rng, geometry, 150, k, k_t)
        thresholds = certify_batch(geometry, bounds, bounds.radius).thresholds
        name = f"calibration/{seed}"
        pack.put(f"{name}/votes", votes)
        put_thresholds(pack, name, thresholds)
        in_set = geometry.score() >= thresholds.cut
        scores = geometry.score()
        rows = []
        for r in range(bounds.radius + 1):
            low = scores if r == 0 else geometry.lower(r)
            high = scores if r == 0 else geometry.upper(r)
            want = ref.calibration_radius(
                scores,
                low,
                high,
                in_set,
                thresholds.lower,
                thresholds.upper,
                r,
                thresholds.tau_hat,
                thresholds.guard,
                TIE,
            )
            rows.append(want[geometry.index])
        pack.put(f"{name}/radii", np.stack(rows))


def main() -> None:
    pack = Packer()
    radii_cases(pack)
    benchmark_case(pack)
    bound_cases(pack)
    calibration_cases(pack)
    pack.save(OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(pack.table)} arrays)")


if __name__ == "__main__":
    main()
