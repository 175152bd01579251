"""Bring your own VAE: any nn.Module with encode/decode is certified and trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from defenses.civet import TrainConfig, certify, train_vae
from defenses.civet.attacks import JointPGD, VAEView, mc_check
from defenses.civet.model import init_parameters, sse
from defenses.civet.protocol import as_vae
from defenses.civet.support import halfwidth
from defenses.civet.tasks import ConvVAE, ResidualMLPVAE, user_vae
from tests.defenses.civet.helpers import generator


class TutorialVAE(nn.Module):
    """Images in, images out; methods named as in many tutorials; BN and Dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(4 * 4 * 4, 6)
        self.fc_z = nn.Linear(3, 4 * 4 * 4)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.out = nn.Conv2d(4, 1, 3, padding=1)

    def encoder(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(F.silu(self.bn(self.conv(x))))
        stats = self.fc(h.flatten(1))
        return stats[:, :3], stats[:, 3:]

    def decoder(self, z: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc_z(z)).view(-1, 4, 4, 4)
        return torch.sigmoid(self.out(self.up(h)))


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8))


def _tutorial(seed: int = 0) -> TutorialVAE:
    model = init_parameters(TutorialVAE(), generator(seed))
    return model  # type: ignore[return-value]


def test_a_tutorial_vae_is_certified_and_the_bound_holds() -> None:
    model, x = _tutorial(), _images(4)
    log = train_vae(
        model,
        _images(64, 1),
        "civet",
        TrainConfig(epochs=2, batch_size=32, warmup=0),
        rng=generator(1),
        progress=False,
        encode="encoder",
        decode="decoder",
    )
    assert len(log.losses) == 2
    assert not model.training
    cert = certify(model, x, 0.05, 0.9, encode="encoder", decode="decoder")
    assert cert.latent_lower.shape == (4, 3)
    assert np.all(np.isfinite(cert.bound))
    assert np.all(cert.bound <= cert.ceiling + 1e-12)  # sigmoid output: ceiling 64
    assert cert.ceiling[0] == pytest.approx(np.sum(np.maximum(x[0], 1 - x[0]) ** 2))
    vae = as_vae(model, x, "encoder", "decoder").copy(torch.float64)
    g = generator(2)
    x_t = torch.as_tensor(x)
    k = halfwidth(0.9, 3)
    for _ in range(20):  # random (input, noise) pairs of the certified set
        x_adv = (
            x_t + 0.05 * (2 * torch.rand(x_t.shape, generator=g, dtype=x_t.dtype) - 1)
        ).clamp(0, 1)
        nu = k * (2 * torch.rand((4, 3), generator=g, dtype=x_t.dtype) - 1)
        with torch.no_grad():
            loss = sse(vae.reconstruct(x_adv, nu), x_t).numpy()
        assert np.all(loss <= cert.bound + 1e-9)
    view = VAEView(as_vae(model, x, "encoder", "decoder"), x, eps=0.05, k=k, p=0.9)
    guess = JointPGD(steps=10).run(view, np.random.default_rng(0))
    with torch.no_grad():
        worst = sse(
            vae.reconstruct(torch.as_tensor(guess.x_adv), torch.as_tensor(guess.nu)),
            x_t,
        ).numpy()
    assert np.all(worst <= cert.bound + 1e-9)
    check = mc_check(view.model, x, guess.x_adv, cert.bound, 0.9, samples=64, rng=g)
    assert not check.violated.any()


@pytest.mark.parametrize("arch", ["user-conv", "user-resmlp"])
def test_user_style_models_train_and_tighten_the_bound(arch: str) -> None:
    x = np.random.default_rng(0).random((96, 64))
    bounds = {}
    for method in ("standard", "civet"):
        model = user_vae(arch, 64, 2, (16,), generator(0))
        config = TrainConfig(epochs=3, batch_size=32, warmup=0, lr=0.01, ramp=0.3)
        train_vae(model, x, method, config, rng=generator(1), progress=False)
        bounds[method] = float(np.mean(certify(model, x[:8], 0.1, 0.9).bound))
    assert bounds["civet"] < bounds["standard"]


def test_user_models_are_built_from_the_generator_only() -> None:
    torch.manual_seed(123)
    a = user_vae("user-conv", 64, 4, (32,), generator(5))
    torch.manual_seed(456)
    b = user_vae("user-conv", 64, 4, (32,), generator(5))
    for (name, p), q in zip(
        a.state_dict().items(), b.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    assert isinstance(a, ConvVAE)
    assert isinstance(
        user_vae("user-resmlp", 64, 4, (8, 8), generator(0)), ResidualMLPVAE
    )
    with pytest.raises(ValueError, match="square images"):
        user_vae("user-conv", 60, 4, (8,), generator(0))


class NoEncode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x))


class OneHead(NoEncode):
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z


class WrongShape(NoEncode):
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h[:, :2], h[:, 2:]

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z


def test_models_breaking_the_protocol_get_errors_naming_what_is_wrong() -> None:
    x = np.full((2, 4), 0.5)
    with pytest.raises(TypeError, match=r"\(NoEncode\) has no encode method 'encode'"):
        certify(NoEncode(), x, 0.1)
    with pytest.raises(TypeError, match=r"no decode method 'run'"):
        certify(OneHead(), x, 0.1, decode="run")
    with pytest.raises(
        TypeError, match=r"model\.encode\(x\) must return \(mu, logvar\)"
    ):
        certify(OneHead(), x, 0.1)
    with pytest.raises(
        TypeError, match=r"model\.decode\(z\) must return x_hat with the shape of x"
    ):
        train_vae(WrongShape(), x, progress=False)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        certify(lambda v: v, x, 0.1)  # type: ignore[arg-type]


def test_domain_is_the_models_or_the_argument() -> None:
    model = ResidualMLPVAE(4, 2, 8)
    x = np.full((2, 4), 0.5)
    with pytest.raises(ValueError, match=r"input domain \[0.0, 1.0\]"):
        certify(model, x + 1.0, 0.1)
    wide = certify(model, x + 1.0, 0.1, domain=(-2.0, 2.0))
    assert np.all(np.isfinite(wide.bound))
    with pytest.raises(ValueError, match=r"domain\[1\] must be a finite number"):
        certify(model, x, 0.1, domain=(1.0, 0.0))


@pytest.mark.parametrize("arch", ["user-conv", "user-resmlp"])
def test_user_style_certificates_hold_against_the_joint_attack(arch: str) -> None:
    x = np.random.default_rng(3).random((64, 64)) ** 2
    model = user_vae(arch, 64, 3, (16,), generator(2))
    config = TrainConfig(epochs=2, batch_size=32, warmup=0, eps=0.1)
    train_vae(model, x, "civet", config, rng=generator(3), progress=False)
    test = x[:6]
    cert = certify(model, test, 0.1, 0.95)
    k = halfwidth(0.95, 3)
    view = VAEView(model, test, eps=0.1, k=k, p=0.95)
    guess = JointPGD(steps=15, restarts=2).run(view, np.random.default_rng(1))
    vae = as_vae(model, test).copy(torch.float64)
    with torch.no_grad():
        worst = sse(
            vae.reconstruct(torch.as_tensor(guess.x_adv), torch.as_tensor(guess.nu)),
            torch.as_tensor(test),
        ).numpy()
    assert np.all(worst <= cert.bound + 1e-9)
    assert np.all(cert.bound <= cert.ceiling + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "hidden", "kappa"),
    [("user-conv", (64,), 0.5), ("user-resmlp", (32,), 0.5)],
)
def test_user_style_models_reach_the_paper_kind_of_result(
    arch: str, hidden: tuple[int, ...], kappa: float
) -> None:
    """The quick-profile claim on one seed: >= 5x tighter, <= 1.5x the attack, sound."""
    from defenses.civet.arms import CivetTraining
    from defenses.civet.scenario import CivetScenario

    scenario = CivetScenario(
        data="digits",
        arch=arch,
        hidden=hidden,
        beta=0.01,
        epochs=50,
        batch_size=128,
        lr=0.004,
        warmup=10,
        n_eval=60,
        mc_samples=128,
    )
    task = scenario.setup(np.random.default_rng(0))
    numbers = {}
    for name, learner in (
        ("standard", scenario.learner()),
        ("civet", CivetTraining(kappa=kappa).wrap(scenario.learner())),
    ):
        system = learner.fit(task, np.random.default_rng(1))
        guess = JointPGD(steps=30, restarts=2).run(
            scenario.expose(system, task, None), np.random.default_rng(2)
        )
        numbers[name] = {
            **scenario.utility(system, task),
            **scenario.judge(system, task, guess),
        }
    civet, standard = numbers["civet"], numbers["standard"]
    assert standard["certified_loss"] >= 5 * civet["certified_loss"]
    assert civet["certified_loss"] <= 1.5 * civet["attack_loss"]
    assert civet["violation_rate"] == 0.0
    assert standard["violation_rate"] == 0.0
    assert civet["mc_violation_rate"] == 0.0
