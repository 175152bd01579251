r"""Black-box model-inversion attacks, scaled down, all through a :class:`QueryOracle`.

The adversary wants a representative input of each target class (a private
identity) and holds unlabelled public data of *other* classes, from which it learns
a prior :class:`~defenses.ssd.prior.PCAPrior` (the GAN of the original attacks).

* :class:`BoundaryRepulsion`: label-only, in the style of BREP-MI (Kahla et al.,
  CVPR 2022). From a latent the target labels :math:`t`, probe a sphere of radius
  :math:`R`; step away from the probes labelled otherwise (a zeroth-order estimate of
  the direction away from the decision boundary), accept the step only if it is still
  labelled :math:`t`, and grow :math:`R` when most of the sphere is inside the class.
* :class:`GeneticInversion`: soft-label, in the style of Mirror's black-box genetic
  search (An et al., NDSS 2022): initial population = the prior samples with the
  highest target score, fitness :math:`\log p_t`, proportional selection, uniform
  crossover, Gaussian mutation, elitism.
* :class:`VotingBoundaryRepulsion`: the adaptive attack on SSD. It knows the defense
  randomizes labels, so every label query is repeated and decided by majority vote;
  when the defense seeds its sampling with a hash of the input, each repeat is
  jittered so that it hashes differently.

Chains for all reconstructions run side by side, so each iteration is one batched
oracle call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_int, check_real
from defenses.oracle import QueryOracle
from defenses.ssd.prior import PCAPrior
from defenses.threads import single_thread
from defenses.threat import Capability

LOG_FLOOR = 1e-12
"""Scores are floored here before the log (one-hot or zeroed outputs)."""


@dataclass(frozen=True)
class InversionView:
    """What an inversion adversary gets.

    Attributes
    ----------
    oracle : QueryOracle
        Black-box access to the deployed (possibly defended) model.
    public : ndarray of shape (n, d)
        Unlabelled public data of classes disjoint from the private ones.
    targets : ndarray of shape (r,)
        The class of each reconstruction to produce.
    bounds : tuple of (float, float) or None
        Valid input range.
    known_defense : object or None
        The deployed defense, for an adaptive adversary (Kerckhoffs).
    """

    oracle: QueryOracle
    public: FloatArray
    targets: IntArray
    bounds: tuple[float, float] | None
    known_defense: object | None = None


def _labels(answers: npt.NDArray[np.generic]) -> IntArray:
    """Hard labels from an oracle answer (labels already, or score rows)."""
    arr = np.asarray(answers)
    return (arr if arr.ndim == 1 else np.argmax(arr, axis=1)).astype(np.int64)


@dataclass(frozen=True)
class PriorSearch:
    """What the inversions here share: chains of latents in a PCA prior.

    The prior is fitted on the adversary's public data; every chain searches its
    latent space, clipped to a box, and decodes its last latent as the
    reconstruction. Subclasses write :meth:`_search`.

    Parameters
    ----------
    n_components : int
        Latent dimension of the PCA prior (at most the public data's shape allows).
    n_init : int
        Prior samples queried once to start the chains.
    clamp : float
        Latents are clipped to ``[-clamp, clamp]``, > 0.
    """

    n_components: int = 16
    n_init: int = 512
    clamp: float = 3.0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("n_components", "n_init"):
            check_int(f"{owner}.{name}", getattr(self, name), minimum=1)
        check_real(f"{owner}.clamp", self.clamp, 0.0, open_low=True)

    def run(self, view: InversionView, rng: np.random.Generator) -> FloatArray:
        """Reconstructions, one row per entry of ``view.targets``."""
        with single_thread():
            prior = PCAPrior.fit(
                view.public, min(self.n_components, *view.public.shape), view.bounds
            )
            return self._search(view, prior, rng)

    def _search(
        self, view: InversionView, prior: PCAPrior, rng: np.random.Generator
    ) -> FloatArray:
        raise NotImplementedError


@dataclass(frozen=True)
class BoundaryRepulsion(PriorSearch):
    """Label-only inversion by boundary repulsion (BREP-MI style).

    The ``n_init`` prior samples are labelled once, to find a starting latent of
    each target (:class:`PriorSearch` holds ``n_components``, ``n_init``, ``clamp``).

    Parameters
    ----------
    n_dirs : int
        Probes on the sphere per iteration.
    iterations : int
        Boundary-repulsion steps.
    radius : float
        Initial sphere radius, in latent standard deviations.
    growth : float
        Factor applied to the radius when ``inside`` of the probes keep the label.
    inside : float
        Fraction of probes inside the class that triggers growth, in (0, 1].
    step : float
        Step length as a multiple of the radius.
    """

    name: ClassVar[str] = "ssd-brep"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.QUERY_LABEL})
    n_dirs: int = 32
    iterations: int = 30
    radius: float = 0.5
    growth: float = 1.3
    inside: float = 0.75
    step: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        for name in ("n_dirs", "iterations"):
            check_int(f"{owner}.{name}", getattr(self, name), minimum=1)
        for name in ("radius", "step"):
            check_real(f"{owner}.{name}", getattr(self, name), 0.0, open_low=True)
        if not (isinstance(self.growth, int | float) and self.growth >= 1):
            raise ValueError(f"{owner}.growth must be >= 1, got {self.growth!r}")
        if not (isinstance(self.inside, int | float) and 0 < self.inside <= 1):
            raise ValueError(f"{owner}.inside must lie in (0, 1], got {self.inside!r}")

    def query_labels(
        self, view: InversionView, x: FloatArray, rng: np.random.Generator
    ) -> IntArray:
        """One hard label per row of ``x`` (one query each)."""
        return _labels(view.oracle(x))

    def _start(
        self, view: InversionView, prior: PCAPrior, rng: np.random.Generator
    ) -> FloatArray:
        """Per chain, a prior latent the oracle labels with the chain's target."""
        pool = prior.sample(self.n_init, rng)
        labels = self.query_labels(view, prior.decode(pool), rng)
        start = prior.sample(view.targets.size, rng)
        for target in np.unique(view.targets):
            chains = np.flatnonzero(view.targets == target)
            hits = np.flatnonzero(labels == target)
            if hits.size:
                start[chains] = pool[hits[np.arange(chains.size) % hits.size]]
        return start

    def _search(
        self, view: InversionView, prior: PCAPrior, rng: np.random.Generator
    ) -> FloatArray:
        targets = view.targets
        z = self._start(view, prior, rng)
        chains, dim = z.shape
        radius = np.full(chains, float(self.radius))
        for _ in range(self.iterations):
            u = rng.standard_normal((chains, self.n_dirs, dim))
            u /= np.linalg.norm(u, axis=2, keepdims=True)
            probes = z[:, None, :] + radius[:, None, None] * u
            answers = self.query_labels(
                view, prior.decode(probes.reshape(-1, dim)), rng
            )
            outside = answers.reshape(chains, self.n_dirs) != targets[:, None]
            away = -(outside[:, :, None] * u).mean(axis=1)
            norm = np.linalg.norm(away, axis=1)
            moves = norm > 0
            direction = away / np.where(moves, norm, 1.0)[:, None]
            candidate = np.clip(
                z + self.step * radius[:, None] * direction, -self.clamp, self.clamp
            )
            keep = self.query_labels(view, prior.decode(candidate), rng) == targets
            z = np.where((keep & moves)[:, None], candidate, z)
            grow = 1.0 - outside.mean(axis=1) >= self.inside
            radius = np.where(grow, radius * self.growth, radius)
        return prior.decode(z)


@dataclass(frozen=True)
class VotingBoundaryRepulsion(BoundaryRepulsion):
    """Adaptive BREP: every label is the majority vote of ``repeats`` queries.

    Against random seeding the vote recovers the label the defense randomizes. Against
    input-hash seeding repeats of the same query return the same answer, so when the
    known defense hashes its inputs each repeat is perturbed by uniform noise of
    amplitude ``jitter`` (in input units) to obtain fresh pseudo-labels.

    Parameters
    ----------
    repeats : int
        Queries per label (odd avoids ties; ties go to the smallest label).
    jitter : float
        Noise amplitude used against input-hash seeding, >= 0.
    """

    name: ClassVar[str] = "ssd-brep-vote"
    repeats: int = 9
    jitter: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.repeats", self.repeats, minimum=1)
        check_real("VotingBoundaryRepulsion.jitter", self.jitter, 0.0)

    def query_labels(
        self, view: InversionView, x: FloatArray, rng: np.random.Generator
    ) -> IntArray:
        """Majority vote over ``repeats`` (jittered, if the defense hashes) queries."""
        batch = np.repeat(x[None], self.repeats, axis=0)
        if (
            getattr(view.known_defense, "seeding", None) == "input-hash"
            and self.jitter > 0
        ):
            batch = batch + rng.uniform(-self.jitter, self.jitter, batch.shape)
            if view.bounds is not None:
                np.clip(batch, view.bounds[0], view.bounds[1], out=batch)
        votes = _labels(view.oracle(batch.reshape(-1, x.shape[1]))).reshape(
            self.repeats, -1
        )
        n_labels = int(votes.max()) + 1
        counts = np.zeros((x.shape[0], n_labels), dtype=np.int64)
        np.add.at(
            counts, (np.tile(np.arange(x.shape[0]), self.repeats), votes.ravel()), 1
        )
        voted: IntArray = np.argmax(counts, axis=1).astype(np.int64)
        return voted


@dataclass(frozen=True)
class GeneticInversion(PriorSearch):
    """Soft-label inversion by a genetic search in the prior (Mirror style).

    The ``n_init`` prior samples are scored once; each chain starts from the best
    ``population`` (:class:`PriorSearch` holds ``n_components``, ``n_init``,
    ``clamp``).

    Parameters
    ----------
    population : int
        Individuals per chain.
    generations : int
        Generations of selection, crossover and mutation.
    elite : int
        Best individuals kept unchanged each generation (< ``population``).
    sigma : float
        Standard deviation of the Gaussian mutation, in latent units.
    mutation_rate : float
        Probability that a coordinate of a child mutates, in (0, 1].
    """

    name: ClassVar[str] = "ssd-mirror"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.QUERY_SCORES})
    population: int = 32
    generations: int = 25
    elite: int = 8
    sigma: float = 0.3
    mutation_rate: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        for name in ("population", "generations", "elite"):
            check_int(f"{owner}.{name}", getattr(self, name), minimum=1)
        check_real(f"{owner}.sigma", self.sigma, 0.0, open_low=True)
        if self.elite >= self.population:
            raise ValueError(
                f"{owner}.elite must be < population={self.population}, "
                f"got {self.elite}"
            )
        if self.population > self.n_init:
            raise ValueError(
                f"{owner}.population must be <= n_init={self.n_init}, "
                f"got {self.population}"
            )
        if not (
            isinstance(self.mutation_rate, int | float) and 0 < self.mutation_rate <= 1
        ):
            raise ValueError(
                f"{owner}.mutation_rate must lie in (0, 1], got {self.mutation_rate!r}"
            )

    @staticmethod
    def _fitness(scores: npt.NDArray[np.generic], targets: IntArray) -> FloatArray:
        s = np.asarray(scores, dtype=np.float64)
        if s.ndim != 2:
            raise ValueError("the genetic search needs score vectors, got labels only")
        picked = s[np.arange(s.shape[0]), targets]
        return np.log(np.maximum(picked, LOG_FLOOR))

    def _search(
        self, view: InversionView, prior: PCAPrior, rng: np.random.Generator
    ) -> FloatArray:
        targets = view.targets
        chains, size = targets.size, self.population
        pool = prior.sample(self.n_init, rng)
        scores = np.asarray(view.oracle(prior.decode(pool)), dtype=np.float64)
        if scores.ndim != 2:
            raise ValueError("the genetic search needs score vectors, got labels only")
        pool_fit = np.log(np.maximum(scores[:, targets].T, LOG_FLOOR))
        best = np.argsort(-pool_fit, axis=1, kind="stable")[:, :size]
        pop = pool[best]
        fit = np.take_along_axis(pool_fit, best, axis=1)
        dim = prior.dim
        n_child = size - self.elite
        child_targets = np.repeat(targets, n_child)
        for _ in range(self.generations):
            order = np.argsort(-fit, axis=1, kind="stable")
            pop = np.take_along_axis(pop, order[:, :, None], axis=1)
            fit = np.take_along_axis(fit, order, axis=1)
            weights = np.exp(fit - fit.max(axis=1, keepdims=True))
            cdf = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
            draws = rng.random((chains, 2 * n_child))
            parents = np.minimum(
                (cdf[:, None, :] <= draws[:, :, None]).sum(axis=2), size - 1
            )
            rows = np.arange(chains)[:, None]
            mother = pop[rows, parents[:, :n_child]]
            father = pop[rows, parents[:, n_child:]]
            children = np.where(rng.random(mother.shape) < 0.5, mother, father)
            mutate = rng.random(children.shape) < self.mutation_rate
            children = children + mutate * rng.normal(0.0, self.sigma, children.shape)
            np.clip(children, -self.clamp, self.clamp, out=children)
            answers = view.oracle(prior.decode(children.reshape(-1, dim)))
            child_fit = self._fitness(answers, child_targets).reshape(chains, n_child)
            pop = np.concatenate([pop[:, : self.elite], children], axis=1)
            fit = np.concatenate([fit[:, : self.elite], child_fit], axis=1)
        winner = np.argmax(fit, axis=1)
        return prior.decode(pop[np.arange(chains), winner])


ATTACKS = (BoundaryRepulsion, GeneticInversion, VotingBoundaryRepulsion)
"""The package's attacks (registered by :mod:`defenses.ssd.scenario`)."""
