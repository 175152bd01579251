"""Measurement benchmark: certificate and attack across radii, and training cost.

For every seed, the three trainings (standard, PGD, CIVET) run one after the other
on the same split and initialisation seed, and each epoch is timed (median over
epochs, so the ratio of CIVET's to standard training's epoch time is measured side
by side in one run). Each trained VAE is then certified and attacked with
:class:`~defenses.civet.attacks.JointPGD` at every evaluation radius, and judged by
:meth:`~defenses.civet.scenario.CivetScenario.judge`; MLP models are certified with
both interval propagation (``certificate.bound``) and the CROWN-IBP relaxation
(``certificate.bound_crown``), and every model also with the exact per-dimension
support (``certificate.bound_exact``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from defenses.checks import check_keys
from defenses.civet.arms import (
    CivetTraining,
    PGDTraining,
    TrainedVAE,
    VAELearner,
    certificate_metrics,
)
from defenses.civet.attacks import JointPGD, VAEGuess, VAEView
from defenses.civet.certificate import certify
from defenses.civet.tasks import VAETask
from defenses.harness import game_streams, measurement
from defenses.results import Result

logger = logging.getLogger(__name__)

VARIANTS = {"standard": "none", "pgd": "pgd", "civet": "civet"}
SCENARIO_KEYS = (
    "data",
    "arch",
    "latent_dim",
    "eps",
    "p",
    "n_eval",
    "epochs",
    "batch_size",
    "lr",
    "beta",
    "warmup",
    "mc_samples",
)


class Game(Protocol):
    """What the sweep needs of the scenario (``CivetScenario``)."""

    @property
    def arch(self) -> str:
        """VAE architecture name."""
        ...

    def setup(self, rng: np.random.Generator) -> VAETask:
        """Split the data and pick the inputs under attack."""
        ...

    def learner(self) -> VAELearner:
        """The undefended learner."""
        ...

    def utility(self, system: TrainedVAE, task: VAETask) -> dict[str, float]:
        """Clean error and the certificate of the fitted system."""
        ...

    def expose(
        self, system: TrainedVAE, task: VAETask, known_defense: object | None
    ) -> VAEView:
        """The adversary's view of the fitted system."""
        ...

    def judge(
        self, system: TrainedVAE, task: VAETask, guess: VAEGuess | None
    ) -> dict[str, float]:
        """Damage, violations and the Monte-Carlo check of a guess."""
        ...


def _floats(name: str, values: Any) -> list[float]:
    items = values if isinstance(values, list | tuple) else [values]
    out = [float(v) for v in items]
    if not out or any(not 0 <= v <= 1 for v in out):
        raise ValueError(
            f"{name} must be a non-empty list of radii in [0, 1], got {values!r}"
        )
    return out


def eps_sweep(
    params: Mapping[str, Any],
    seeds: Sequence[int],
    game: Callable[..., Game],
) -> Iterator[Result]:
    """Train standard, PGD and CIVET VAEs; certify and attack them across radii.

    ``game`` builds the scenario from its fields (the scenario module passes
    :class:`~defenses.civet.scenario.CivetScenario`, so this module never imports
    it).

    Parameters (``params``)
    -----------------------
    eval_eps : list of float
        Radii at which each model is certified and attacked.
    methods : list of str
        Subset of ``["standard", "pgd", "civet"]`` (standard is the reference
        variant ``"none"``).
    kappa : float
        Final weight of the robust term of PGD and CIVET training.
    pgd_steps : int
        Inner steps of PGD training.
    attack_steps, attack_restarts : int
        Budget of the joint PGD attack.
    any :class:`~defenses.civet.scenario.CivetScenario` field
        ``eps`` is the training radius.
    """
    known = {
        "eval_eps",
        "methods",
        "kappa",
        "pgd_steps",
        "attack_steps",
        "attack_restarts",
    }
    check_keys("civet-eps", params, known | set(SCENARIO_KEYS))
    radii = _floats("eval_eps", params.get("eval_eps", [0.0, 0.05, 0.1]))
    methods = list(params.get("methods", list(VARIANTS)))
    if not methods or any(m not in VARIANTS for m in methods):
        raise ValueError(
            f"methods must be a subset of {list(VARIANTS)}, got {methods!r}"
        )
    methods = [m for m in VARIANTS if m in methods]
    scenario = game(**{k: params[k] for k in SCENARIO_KEYS if k in params})
    kappa = float(params.get("kappa", 0.5))
    trainers: dict[str, CivetTraining | PGDTraining] = {
        "pgd": PGDTraining(kappa=kappa, steps=int(params.get("pgd_steps", 7))),
        "civet": CivetTraining(kappa=kappa),
    }
    attack = JointPGD(
        steps=int(params.get("attack_steps", 50)),
        restarts=int(params.get("attack_restarts", 2)),
    )
    for seed in tqdm(seeds, disable=None, desc="civet-eps", leave=False):
        r_setup, r_fit, r_attack = game_streams(seed)
        task = scenario.setup(r_setup)
        fit_state = r_fit.bit_generator.state
        reference_epoch: float | None = None
        for method in methods:
            # epoch_ratio below is epoch_s over standard's from this sweep
            learner = dataclasses.replace(scenario.learner(), ratio_rounds=0)
            if method in trainers:
                learner = trainers[method].wrap(learner)
            r_fit.bit_generator.state = fit_state
            system = learner.fit(task, r_fit)
            epoch_s = system.log.seconds_per_epoch
            logger.info("civet-eps seed=%s %s: %.4f s/epoch", seed, method, epoch_s)
            if method == "standard":
                reference_epoch = epoch_s
            utility = scenario.utility(system, task)
            for radius in radii:
                at = dataclasses.replace(task, eps=radius)
                view = scenario.expose(system, at, None)
                guess = attack.run(view, r_attack)
                success = scenario.judge(system, at, guess)
                cert = certify(system.model, at.x_eval, radius, at.p)
                certificate = certificate_metrics(cert, at.reference_loss)
                refined = certify(
                    system.model, at.x_eval, radius, at.p, support="exact"
                )
                certificate["bound_exact"] = float(np.mean(refined.bound))
                if scenario.arch == "mlp":
                    tight = certify(
                        system.model, at.x_eval, radius, at.p, relaxation="crown"
                    )
                    certificate["bound_crown"] = float(np.mean(tight.bound))
                cost = {
                    "epoch_s": epoch_s,
                    "train_s": float(sum(system.log.epoch_seconds)),
                }
                if reference_epoch is not None:
                    cost["epoch_ratio"] = epoch_s / reference_epoch
                yield measurement(
                    "civet-eps",
                    VARIANTS[method],
                    seed,
                    utility={
                        "clean_loss": utility["clean_loss"],
                        "mean_image_loss": utility["mean_image_loss"],
                    },
                    success=success,
                    cost=cost,
                    certificate=certificate,
                    params={
                        **{k: v for k, v in params.items() if k != "eval_eps"},
                        "eval_eps": radius,
                        "method": method,
                    },
                )
