"""An audit given a benchmark scenario's model, data and seed reproduces its numbers."""

import numpy as np
import pytest

from defenses.audit import AuditConfig, audit
from defenses.audit.inversion import judge
from defenses.audit.preflight import AuditInputWarning
from defenses.harness import label, run_once
from defenses.reference.attacks import LabelOnlyAttack, LossThresholdAttack
from defenses.reference.defense import LabelOnly, Rounding
from defenses.reference.scenario import DigitsMembership
from defenses.ssd.scenario import DigitsInversion


def test_membership_numbers_equal_the_reference_scenario():
    seed = 3
    scenario = DigitsMembership()
    r_setup, r_fit, _ = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    task = scenario.setup(r_setup)
    model = scenario.learner().fit(task, r_fit)
    out = ~task.is_member
    defenses = [Rounding(), LabelOnly()]
    # the scenario's arms fit on nothing: validation = the test records keeps the
    # candidates and the utility records whole (and is warned about)
    with pytest.warns(AuditInputWarning, match="validation rows are also test rows"):
        report = audit(
            model,
            task.train,
            (task.candidates[out], task.labels[out]),
            test=task.test,
            validation=task.test,
            threat=scenario.threat,
            defenses=defenses,
            config=AuditConfig(seeds=(seed,), progress=False),
        )
    compared = 0
    for attack in (LossThresholdAttack(), LabelOnlyAttack()):
        for arm in (None, *defenses):
            expected = run_once(scenario, attack, arm, seed)
            got = report.result(attack.name, label(arm), seed)
            for key, value in expected.success.items():
                assert got.success[key] == value, (attack.name, label(arm), key)
            assert got.utility["accuracy"] == expected.utility["accuracy"]
            compared += 1
    assert compared == 6
    # the scenario grants no auxiliary data: the shadow attack is refused by name
    assert "lira-offline" in report.refused
    assert "aux-data" in report.refused["lira-offline"]


def test_inversion_judge_equals_the_ssd_scenario_judge():
    scenario = DigitsInversion(per_target=3)
    r_setup, r_fit, _ = (
        np.random.default_rng(s) for s in np.random.SeedSequence(1).spawn(3)
    )
    task = scenario.setup(r_setup)
    system = scenario.learner().fit(task, r_fit)
    rng = np.random.default_rng(2)
    for guess in (
        task.public[rng.integers(task.public.shape[0], size=task.targets.size)],
        task.train.X[rng.integers(len(task.train), size=task.targets.size)],
    ):
        expected = scenario.judge(system, task, guess)
        got = judge(task.evaluator, guess, task.targets, task.n_classes)
        assert got == expected
