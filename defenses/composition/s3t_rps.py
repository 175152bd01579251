r"""An S3T-trained sharded ensemble serving as the part classifiers of RPS.

One set of models gives both exact unlearning (S3T, Chowdhury et al., ICLR 2025)
and reliable conformal prediction sets (RPS, Scholten & Günnemann, ICLR 2025). The
``m`` shards of an :class:`~defenses.s3t.defense.Unlearner` (S3T, or SISA) are the
``k_t = m`` training parts of RPS: shard ``s`` votes for the arg-max of the model it
serves, or abstains once deletions left it without a model
(:meth:`~defenses.s3t.defense.Unlearner.shard_predictions`). RPS hash-partitions the
calibration data into ``k_c`` parts, keeps a class when more than
:math:`\hat\tau(\alpha, k_c)` part sets hold it, and certifies each (point, class)
against poisoned training and calibration points. A deletion goes through S3T (no
gradient step) and the thresholds are recomputed on the stored calibration data, so
the sets and certificates served are those of the post-deletion models.

Why the training certificate holds, before and after deletions
----------------------------------------------------------------
RPS's training certificate needs one thing of the parts: a poisoned training point
(inserted, removed or relabelled) changes at most one part's classifier, so ``r``
of them change at most ``r`` votes (each to any class or to abstain;
:mod:`defenses.rps.scores` bounds the scores over all such changes).

* **One point, one shard.** S3T assigns each sample to a (shard, slice) by a salted
  hash of its id (or of its group key, :mod:`defenses.s3t.partition`), never of its
  features, label or of other samples; a shard's stages are trained on that shard's
  rows only, with seeds of (seed, shard, prefix), from a frozen backbone shared by
  all shards. Inserting, removing or relabelling a point therefore changes the data
  of exactly one shard and leaves every other shard's model bit for bit the same.
  (A feature modification keeps the id, hence the shard, unlike RPS's own
  feature-hash partition, where it counts as two parts.)
* **After deletions.** Deleting an id switches off, in its shard only, every stage
  trained on its slice; the shard serves its longest surviving prefix, whose slices
  lost no rows. So each shard's served model is a function of its own remaining data
  and of which of its slices were hit (a fact about the deletion log, not about the
  remaining data); S3T's exactness (the twin test of :mod:`defenses.s3t.attacks`)
  makes it equal, bit for bit, to the same deactivation of a model trained from
  scratch without the deleted ids. For a fixed deletion log, ``r`` poisoned points
  among the remaining training data still change at most ``r`` shards, which is
  what the certificate assumes: it is valid for the post-deletion training set.
  :meth:`ReliableUnlearner.retrain` brings every shard back to a fresh fit on the
  remaining data, and the certificate with it.
* **Deletion requests as perturbations.** A deletion touches only its own shard, so
  ``r`` further deletion requests (in ``r`` shards) change at most ``r`` votes, some
  perhaps to abstain: a (point, class) certified at training radius ``r`` also keeps
  its membership under any ``r`` further deletions.

Assumptions: the backbone was pretrained on clean, non-deletable data; calibration
data are held out, hash-partitioned by RPS and not deletable through S3T;
exchangeability of calibration and test data for coverage. With every shard dead all
classes score alike and every set is full (sound, useless: :meth:`retrain`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from sklearn.exceptions import NotFittedError

from defenses.arrays import BoolArray, FloatArray, IntArray
from defenses.rps import Certificate, ReliableConformalClassifier
from defenses.rps.inputs import check_inputs
from defenses.rps.quantile import QuantileMode
from defenses.rps.settings import check_settings
from defenses.s3t.defense import DeletionReceipt, RetrainReceipt, Slot, Unlearner


class ShardVoter:
    """An S3T or SISA unlearner seen as RPS part classifiers (a ``PartVoter``).

    ``n_parts`` is the number of shards, fixed for the unlearner's life;
    :meth:`part_votes` reads the shards' current models at every call, so votes
    after a deletion are those of the post-deletion shards.
    """

    def __init__(self, unlearner: Unlearner) -> None:
        if not isinstance(unlearner, Unlearner):
            raise ValueError(
                "unlearner must be a defenses.s3t Unlearner (S3T, SISA, ...), got "
                f"{type(unlearner).__name__}"
            )
        self.unlearner = unlearner
        self.n_parts: int = unlearner.shards

    def part_votes(self, X: FloatArray) -> IntArray:
        """Each shard's class index per point, -1 for a dead shard: (n_parts, n)."""
        return np.asarray(self.unlearner.shard_predictions(X), dtype=np.int64)


@dataclass(frozen=True)
class _Calibration:
    X: FloatArray
    y: IntArray
    max_train_radius: int | None


class ReliableUnlearner:
    """Exact unlearning and reliable conformal sets from one sharded ensemble.

    Parameters
    ----------
    unlearner : Unlearner
        An unfitted (or fitted) :class:`~defenses.s3t.S3T` or
        :class:`~defenses.s3t.SISA`; its shards are RPS's ``k_t`` training parts.
    n_calib_parts : int
        ``k_c``, hash parts of the calibration data.
    confidence_level : float
        Target coverage in (0, 1).
    quantile : {"exact", "official", "markov"}
        RPS's per-part rank rule.
    softmax : bool
        Smooth the vote fractions with a softmax (RPS's default).

    Notes
    -----
    Life cycle (MAPIE 1.x's vocabulary): :meth:`fit` (S3T trains the shards) ->
    :meth:`conformalize` (RPS) -> :meth:`predict_set` / :meth:`certify` ->
    :meth:`delete` (S3T switches stages off, then RPS conformalizes again on the
    kept calibration data) -> :meth:`predict_set` / :meth:`certify` of the
    post-deletion models -> optionally :meth:`retrain`.
    """

    def __init__(
        self,
        unlearner: Unlearner,
        n_calib_parts: int = 10,
        confidence_level: float = 0.9,
        quantile: QuantileMode = "exact",
        softmax: bool = True,
    ) -> None:
        self.voter = ShardVoter(unlearner)
        self.unlearner = unlearner
        self._template = ReliableConformalClassifier(
            n_train_parts=unlearner.shards,
            n_calib_parts=n_calib_parts,
            confidence_level=confidence_level,
            quantile=quantile,
            softmax=softmax,
        )
        check_settings(self._template.get_params(deep=False))
        self._rps: ReliableConformalClassifier | None = None
        self._calibration: _Calibration | None = None

    @property
    def rps(self) -> ReliableConformalClassifier:
        """RPS on the unlearner's shards (built by :meth:`conformalize`)."""
        if self._rps is None:
            raise NotFittedError(
                "ReliableUnlearner is not conformalized: call fit, then conformalize"
            )
        return self._rps

    # ------------------------------------------------------------------ train
    def fit(
        self,
        X: npt.ArrayLike,
        y: npt.ArrayLike,
        ids: npt.ArrayLike,
        groups: npt.ArrayLike | None = None,
    ) -> ReliableUnlearner:
        """Train the shards with the unlearner (see :meth:`Unlearner.fit`).

        If conformalization data were given before, the thresholds are recomputed.
        """
        self.unlearner.fit(X, y, ids, groups)
        self._reconformalize()
        return self

    def conformalize(
        self, X: npt.ArrayLike, y: npt.ArrayLike, max_train_radius: int | None = None
    ) -> ReliableUnlearner:
        """Conformalize RPS on (X, y), kept to conformalize again after deletions.

        ``max_train_radius`` caps the training radius certified (default ``k_t``);
        smaller is faster.
        """
        try:
            features = np.array(check_inputs(X), dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise ValueError(f"X must be numeric for the shards: {error}") from error
        labels = np.array(y)
        rps = ReliableConformalClassifier.from_voter(
            self.voter,
            self.unlearner.classes_,
            features.shape[1],
            n_calib_parts=self._template.n_calib_parts,
            confidence_level=self._template.confidence_level,
            quantile=self._template.quantile,
            softmax=self._template.softmax,
        )
        self._rps = rps.conformalize(features, labels, max_train_radius)
        self._calibration = _Calibration(features, labels, max_train_radius)
        return self

    def _reconformalize(self) -> None:
        if self._calibration is not None:
            c = self._calibration
            self.rps.conformalize(c.X, c.y, c.max_train_radius)

    # ------------------------------------------------------------------ serve
    def predict_set(
        self, X: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.generic], BoolArray]:
        """RPS point predictions and majority sets, boolean (n, K, 1) (as MAPIE)."""
        return self.rps.predict_set(X)

    def certify(
        self, X: npt.ArrayLike, max_train_radius: int | None = None
    ) -> Certificate:
        """RPS certificate (sets and radii) of the current, post-deletion models."""
        return self.rps.certify(X, max_train_radius)

    def part_votes(self, X: npt.ArrayLike) -> IntArray:
        """Each shard's vote, shape (k_t, n); -1 where a shard is dead."""
        return self.voter.part_votes(check_inputs(X))

    def predict(self, X: npt.ArrayLike) -> npt.NDArray[np.generic]:
        """The unlearner's own point prediction (shard probabilities averaged)."""
        return self.unlearner.predict(X)

    @property
    def dead_shards(self) -> tuple[int, ...]:
        """Shards with no model left (they abstain)."""
        return tuple(s for s, p in enumerate(self.unlearner.served()) if not p)

    # ------------------------------------------------------------------ unlearn
    def delete(self, ids: npt.ArrayLike) -> DeletionReceipt:
        """Forget ``ids`` through the unlearner (no retraining), then conformalize.

        The sets and certificates served afterwards are those of the post-deletion
        shards; a shard left without a model abstains.
        """
        receipt = self.unlearner.delete(ids)
        self._reconformalize()
        return receipt

    def deactivate(self, slots: Iterable[Slot]) -> DeletionReceipt:
        """Switch off the stages of the given (shard, slice) cells; conformalize.

        The exactness twin's operator: a model trained without some ids and
        deactivated at their cells serves exactly what deleting them serves.
        """
        receipt = self.unlearner.deactivate(slots)
        self._reconformalize()
        return receipt

    def retrain(self, only_dead: bool = False) -> RetrainReceipt:
        """Retrain the switched-off stages (bit for bit a fresh fit), conformalize."""
        receipt = self.unlearner.retrain(only_dead)
        self._reconformalize()
        return receipt
