"""Model inversion of the classes the user marks private, judged as in the SSD game.

The adversary wants a representative record of each private class. It holds public,
unlabelled records of the *other* classes (by default the non-members outside the
private classes, as in SSD's digits world, where digits 5-9 are public) and queries
the deployed model through the oracle: :class:`~defenses.ssd.attacks.BoundaryRepulsion`
(label-only, BREP-MI style) and :class:`~defenses.ssd.attacks.GeneticInversion`
(soft-label, Mirror style).

The judge is an evaluation classifier trained on the private records (the members,
every class): an MLP of another activation and width than a typical target
(:data:`~defenses.ssd.tasks.EVAL_HIDDEN`, tanh), as in
:func:`defenses.ssd.tasks.build_task`. :func:`judge` reports what
:meth:`defenses.ssd.scenario.DigitsInversion.judge` reports: top-1 (and top-k)
accuracy of the evaluator on the reconstructions, the open-set verified rate, and the
feature distance to the nearest private record of the target class (lower is a
stronger attack).
"""

from __future__ import annotations

import numpy as np
from scipy.spatial.distance import cdist

from defenses.arrays import FloatArray, IntArray
from defenses.data import Dataset
from defenses.ssd.tasks import EVAL_HIDDEN, Evaluator, features, train_mlp
from defenses.threads import single_thread

EVAL_EPOCHS = 200


def top_k(n_classes: int) -> int:
    """The k of the top-k accuracy: 2 up to ten classes, 5 beyond (as SSD's worlds)."""
    return 2 if n_classes <= 10 else 5


def train_evaluator(
    private: Dataset, public: FloatArray, n_classes: int, rng: np.random.Generator
) -> Evaluator:
    """Train the judge on the private records (its reference set adds the public)."""
    with single_thread():
        net = train_mlp(
            private.X,
            private.y,
            n_classes,
            EVAL_HIDDEN,
            rng,
            epochs=EVAL_EPOCHS,
            lr=1e-2,
            activation="tanh",
        )
        reference = np.concatenate([features(net, private.X), features(net, public)])
    labels = np.concatenate([private.y, np.full(public.shape[0], -1, dtype=np.int64)])
    return Evaluator(net, reference, labels)


def judge(
    evaluator: Evaluator, guess: FloatArray, targets: IntArray, n_classes: int
) -> dict[str, float]:
    """Evaluator accuracy, verified rate and feature distance of reconstructions."""
    recon = np.asarray(guess, dtype=np.float64)
    if (
        recon.ndim != 2
        or recon.shape[0] != targets.size
        or not np.all(np.isfinite(recon))
    ):
        raise ValueError(
            f"reconstructions must be finite with {targets.size} rows, "
            f"got {recon.shape}"
        )
    k = top_k(n_classes)
    probs = evaluator.predict_proba(recon)
    ranks = np.argsort(-probs, axis=1, kind="stable")
    hit = ranks == targets[:, None]
    feats = evaluator.features(recon)
    with single_thread():
        dists = cdist(feats, evaluator.reference)
    nearest = evaluator.reference_labels[np.argmin(dists, axis=1)]
    same = evaluator.reference_labels[None, :] == targets[:, None]
    out = {
        "acc@1": float(hit[:, 0].mean()),
        "verified_rate": float(np.mean(nearest == targets)),
        "feature_dist": float(np.where(same, dists, np.inf).min(axis=1).mean()),
    }
    if k < n_classes:
        out[f"acc@{k}"] = float(hit[:, :k].any(axis=1).mean())
    return out


def public_records(
    non_members: Dataset, private: IntArray, given: FloatArray | None
) -> FloatArray:
    """The adversary's public data: ``given``, else the non-private non-members."""
    if given is not None:
        public = np.asarray(given, dtype=np.float64)
        public = public.reshape(public.shape[0], -1) if public.ndim > 1 else public
    else:
        public = non_members.X[~np.isin(non_members.y, private)]
    if (
        public.ndim != 2
        or public.shape[0] < 2
        or public.shape[1] != non_members.X.shape[1]
    ):
        raise ValueError(
            "public must hold >= 2 records of the members' shape (by default the "
            "non-members outside the private classes); got shape "
            f"{public.shape}"
        )
    if not np.all(np.isfinite(public)):
        raise ValueError("public records contain NaN or inf")
    return public
