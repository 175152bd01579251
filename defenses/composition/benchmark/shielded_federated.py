"""SSD wrapping a model trained with time-adaptive DP federated learning.

The global model is trained by :class:`federated.methods.TimeAdaptiveDP` on the
federated membership task; the :class:`defenses.ssd.StealthyShield` is fitted on half
of the held-out test set and wraps the trained model. By the post-processing property
of differential privacy (Dwork and Roth, 2014, Prop. 2.1) the shielded outputs keep
every client's (epsilon, delta) guarantee, which the certificate re-states. The
benchmark measures, side by side on the other half of the test set and on the
membership candidates: accuracy, the shield's L1 distortion, arg-max agreement, and a
loss-threshold membership attack on the deployed outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from defense_suite.federated.arms import TimeAdaptiveDP
from defense_suite.federated.scenario import FederatedMembership
from defenses.checks import check_keys
from defenses.harness import game_streams, measurement
from defenses.metrics import accuracy, membership_metrics
from defenses.oracle import QueryOracle
from defenses.reference.attacks import LossThresholdAttack, MembershipView
from defenses.results import Result
from defenses.ssd import StealthyShield

BENCHMARK = "composition-ssd-federated"
SCENARIO_KEYS = ("dataset", "rounds", "n_clients", "local_steps", "lr")


def shielded_federated(
    params: Mapping[str, Any], seeds: Sequence[int]
) -> Iterator[Result]:
    """Yield the DP model's and the shielded model's records, seed by seed.

    Parameters
    ----------
    params : mapping
        ``epsilons`` (SSD budgets, one shield each, default [0.05, 0.2, 1.0]),
        ``sigma`` (DP-SGD noise, default
        2.0) and any of ``dataset``, ``rounds``, ``n_clients``, ``local_steps``,
        ``lr`` for the federated task.
    seeds : sequence of int
        One run per seed; the shield and the DP model share the seed's streams.
    """
    check_keys(BENCHMARK, params, {"epsilons", "sigma", *SCENARIO_KEYS})
    scenario = FederatedMembership(
        **{k: params[k] for k in SCENARIO_KEYS if k in params}
    )
    method = TimeAdaptiveDP(sigma=float(params.get("sigma", 2.0)))
    epsilons = [float(e) for e in params.get("epsilons", [0.05, 0.2, 1.0])]
    for seed in seeds:
        r_setup, r_fit, r_attack = game_streams(seed)
        task = scenario.setup(r_setup)
        model = method.wrap(scenario.learner()).fit(task, r_fit)
        certificate = method.certify(model, task)
        X, y = task.data.test_X, task.data.test_y
        half = X.shape[0] // 2
        plain = model.predict_proba(X[half:])
        arms = [("none", model.predict_proba)]
        for epsilon in epsilons:
            shield = StealthyShield(epsilon=epsilon, seed=seed).fit(
                model.predict_proba(X[:half]), y[:half]
            )
            arms.append((f"ssd(epsilon={epsilon})", shield.wrap(model).predict_proba))
        for variant, predict in arms:
            scores = predict(X[half:])
            view = MembershipView(
                QueryOracle(predict), task.candidates, task.candidate_labels
            )
            guess = LossThresholdAttack().run(view, r_attack)
            yield measurement(
                BENCHMARK,
                variant,
                seed,
                utility={
                    "accuracy": accuracy(np.argmax(scores, axis=1), y[half:]),
                    "l1_distortion": float(np.abs(scores - plain).sum(axis=1).mean()),
                    "argmax_agreement": float(
                        np.mean(np.argmax(scores, axis=1) == np.argmax(plain, axis=1))
                    ),
                },
                success=membership_metrics(guess, task.is_member),
                certificate=certificate,
                params=dict(params),
                threat=scenario.threat,
            )
