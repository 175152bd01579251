from __future__ import annotations

import numpy as np
import pytest
import torch

from defenses.civet.attacks import (
    EOTPGD,
    JointPGD,
    LatentAttack,
    MaxDamage,
    VAEView,
    mc_check,
    projected_ascent,
)
from defenses.civet.certificate import certify
from defenses.civet.defense import TrainConfig, train_vae
from defenses.civet.model import sse
from defenses.civet.support import halfwidth
from tests.defenses.civet.helpers import generator, inputs, small_vae

EPS, P = 0.1, 0.9


def _trained(method: str = "civet"):
    model = small_vae(0)
    cfg = TrainConfig(epochs=6, batch_size=32, warmup=0, eps=EPS, lr=5e-3)
    train_vae(model, inputs(0, 128), method, cfg, generator(0), progress=False)
    return model


def _view(model) -> VAEView:
    return VAEView(model, inputs(5, 10), EPS, halfwidth(P, 2), P)


def test_projected_ascent_finds_a_box_corner() -> None:
    # maximise sum((v - 0.3)^2) over [0, 1]^2: the optimum is the corner (1, 1)
    start = torch.full((1, 2), 0.5)
    box = (torch.zeros(1, 2), torch.ones(1, 2))
    (best,), value = projected_ascent(
        lambda v: ((v[0] - 0.3) ** 2).sum(dim=1), [start], [box], [0.1], 20
    )
    assert torch.allclose(best, torch.ones(1, 2))
    assert value.item() == pytest.approx(0.98)


@pytest.mark.parametrize(
    "attack",
    [
        JointPGD(steps=10),
        EOTPGD(steps=10, samples=2),
        LatentAttack(steps=10),
        MaxDamage(steps=10),
    ],
)
def test_attacks_stay_admissible_and_are_reproducible(attack) -> None:
    view = _view(_trained("standard"))
    guess = attack.run(view, np.random.default_rng(0))
    again = attack.run(view, np.random.default_rng(0))
    assert np.array_equal(guess.x_adv, again.x_adv)
    assert np.max(np.abs(guess.x_adv - view.x)) <= EPS + 1e-6
    assert guess.x_adv.min() >= 0.0
    assert guess.x_adv.max() <= 1.0
    if isinstance(attack, JointPGD):
        assert guess.nu is not None
        assert np.max(np.abs(guess.nu)) <= view.k + 1e-6
    else:
        assert guess.nu is None


@pytest.mark.parametrize("method", ["standard", "civet"])
def test_joint_attack_never_exceeds_the_certificate(method: str) -> None:
    model = _trained(method)
    view = _view(model)
    guess = JointPGD(steps=30, restarts=3).run(view, np.random.default_rng(1))
    cert = certify(model, view.x, EPS, P)
    x = torch.as_tensor(view.x)
    with torch.no_grad():
        attacked = sse(
            model.double()(torch.as_tensor(guess.x_adv), torch.as_tensor(guess.nu)), x
        )
        clean = sse(model(x, torch.zeros(10, 2, dtype=torch.float64)), x)
    assert np.all(attacked.numpy() <= cert.bound + 1e-6)
    assert attacked.mean() > clean.mean()


def test_mc_check_passes_at_attacked_inputs() -> None:
    model = _trained("civet")
    view = _view(model)
    guess = EOTPGD(steps=10, samples=4).run(view, np.random.default_rng(0))
    cert = certify(model, view.x, EPS, P)
    check = mc_check(
        model, view.x, guess.x_adv, cert.bound, P, samples=400, rng=generator(3)
    )
    assert not check.violated.any()
    assert check.under.min() >= P - 0.05
    assert check.losses.shape == (400, 10)


def test_mc_check_flags_a_wrong_bound() -> None:
    model = _trained("civet")
    view = _view(model)
    too_small = np.zeros(10)
    check = mc_check(model, view.x, view.x, too_small, P, samples=100, rng=generator(3))
    assert check.violated.all()
    assert check.under.max() == 0.0


def test_mc_check_rejects_bad_input() -> None:
    model = small_vae()
    x = inputs()
    with pytest.raises(ValueError, match=r"p must be a finite number in \(0.0, 1.0\)"):
        mc_check(model, x, x, np.ones(6), 1.0)
    with pytest.raises(ValueError, match="bound must be finite"):
        mc_check(model, x, x, np.full(6, np.nan), 0.9)
    with pytest.raises(ValueError, match="x_adv must have shape"):
        mc_check(model, x, x[:3], np.ones(6), 0.9)
