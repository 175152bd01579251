"""The certificate's cross-check against the module (issue 27, part 1).

Every module of :mod:`tests.defenses.civet.user_modules` either gets a certificate
that the module itself confirms at sampled and attacked points, or a refusal naming
the cause; an unsound interval rule (planted here) is caught by the check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from defenses.civet import (
    CheckConfig,
    CrossCheckError,
    certify,
    mlp_vae,
    operations,
    train_vae,
)
from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.defense import TrainConfig
from defenses.civet.model import sse
from tests.defenses.civet.helpers import generator, inputs
from tests.defenses.civet.user_modules import ACCEPTED, REFUSED, UserVAE, scripted

X = inputs(0, 6)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_modules_that_break_an_assumption_are_refused_by_cause(name: str) -> None:
    make, phrase = REFUSED[name]
    with pytest.raises((ValueError, TypeError)) as error:
        certify(make(), X, 0.0)  # eps = 0: a wrong bound shows at the centre
    assert phrase.lower() in str(error.value).lower()


def test_the_issue_in_place_view_model_no_longer_gets_a_wrong_bound() -> None:
    make, _ = REFUSED["in-place-view"]
    model = make()
    xt = torch.as_tensor(X, dtype=torch.float32)
    with torch.no_grad():  # what the module computes at the centre
        mu, _ = model.encode(xt)
        actual = sse(model.decode(mu), xt)
        unseen = sse(torch.sigmoid(model.out(model.dec(mu))), xt)
    assert not torch.allclose(actual, unseen)  # out of place, the ReLU would be lost
    with pytest.raises(UnsupportedLayerError, match=r"layer 'act'.*layer 'dec'"):
        certify(model, X, 0.0)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_legitimate_variants_get_a_checked_certificate(name: str) -> None:
    model = ACCEPTED[name]()
    cert = certify(model, X, 0.1, 0.9)
    reference = certify(UserVAE(), X, 0.1, 0.9)
    assert np.allclose(cert.bound, reference.bound, rtol=1e-9)
    assert cert.check.points == 6 * (1 + 16 + 1)
    assert 0 < cert.check.worst_ratio <= 1 + 1e-9
    assert np.all(cert.check.attack_loss <= cert.bound * (1 + 1e-9))
    assert cert.check.seconds > 0
    assert cert.seconds > 0


def test_a_scripted_module_is_refused_saying_what_is_missing() -> None:
    with pytest.raises(TypeError, match="RecursiveScriptModule"):
        certify(scripted(), X, 0.1)


@pytest.mark.parametrize(
    ("kept", "config", "where"),
    [
        (0.5, CheckConfig(steps=0), "at a sampled point of row"),
        (
            0.3,
            CheckConfig(samples=0, steps=5),
            "at the short joint attack.s point of row",
        ),
        (0.03, CheckConfig(samples=0, steps=0), "at the centre of row"),
    ],
)
def test_an_unsound_rule_is_caught_by_the_check(
    monkeypatch: pytest.MonkeyPatch, kept: float, config: CheckConfig, where: str
) -> None:
    def shrunk(box: Box) -> Box:  # planted bug: a fraction of sigmoid's true width
        low, high = torch.sigmoid(box.lower), torch.sigmoid(box.upper)
        mid, half = (low + high) / 2, (high - low) * kept / 2
        return Box(mid - half, mid + half)

    monkeypatch.setitem(operations.FUNCTIONS, torch.sigmoid, shrunk)
    with pytest.raises(CrossCheckError, match=where):
        certify(UserVAE(), X, 0.1, 0.9, check=config)


def test_the_check_is_deterministic_and_sized_by_its_config() -> None:
    model = UserVAE(3)
    a = certify(model, X, 0.1, check=CheckConfig(samples=4, steps=2, seed=5))
    b = certify(model, X, 0.1, check=CheckConfig(samples=4, steps=2, seed=5))
    assert a.check.points == 6 * (1 + 4 + 1)
    assert a.check.worst_ratio == b.check.worst_ratio
    assert np.array_equal(a.check.attack_loss, b.check.attack_loss)
    bare = certify(model, X, 0.1, check=CheckConfig(samples=0, steps=0))
    assert bare.check.points == 6
    assert np.array_equal(bare.bound, a.bound)


@pytest.mark.parametrize(
    ("field", "value"),
    [("samples", -1), ("steps", 1.5), ("tolerance", 0.1), ("seed", -2)],
)
def test_check_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"CheckConfig.{field}"):
        CheckConfig(**{field: value})
    with pytest.raises(TypeError, match="check must be a CheckConfig"):
        certify(UserVAE(), X, 0.1, check={"samples": 2})  # type: ignore[arg-type]


class BatchNormVAE(nn.Module):
    def __init__(self, track: bool = True) -> None:
        super().__init__()
        self.enc = nn.Sequential(
            nn.Linear(16, 12), nn.BatchNorm1d(12, track_running_stats=track), nn.ReLU()
        )
        self.heads = nn.Linear(12, 4)
        self.dec = nn.Sequential(nn.Linear(2, 16), nn.Sigmoid())

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.heads(self.enc(x)).chunk(2, dim=1)
        return mu, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dec(z)
        return out


def test_batch_norm_train_mode_certifies_the_eval_mode_function() -> None:
    model = BatchNormVAE()
    train_vae(model, inputs(1, 64), "standard", TrainConfig(epochs=2), progress=False)
    model.eval()
    reference = certify(model, X, 0.05).bound
    model.train()  # the whole model in train mode: its eval-mode function
    assert np.array_equal(certify(model, X, 0.05).bound, reference)
    assert model.training  # modes are restored
    assert model.enc[1].training
    model.enc[1].eval()  # train() model whose BatchNorm is in eval: not refused
    assert np.array_equal(certify(model, X, 0.05).bound, reference)


def test_batch_norm_without_running_statistics_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedLayerError, match=r"layer 'enc\.1'.*running stat"):
        certify(BatchNormVAE(track=False), X[:1], 0.05)


def test_non_finite_buffers_are_refused_by_name() -> None:
    model = BatchNormVAE()
    model.enc[1].running_var[3] = float("inf")
    with pytest.raises(ValueError, match=r"buffer 'enc\.1\.running_var'"):
        certify(model, X, 0.05)


def test_the_builtin_container_passes_its_own_check_after_civet_training() -> None:
    g = generator(0)
    vae = mlp_vae(16, latent_dim=2, hidden=(12,), generator=g)
    config = TrainConfig(epochs=3, batch_size=32, warmup=0, eps=0.1)
    train_vae(vae, inputs(2, 96), "civet", config, rng=g, progress=False)
    for support in ("uniform", "exact"):
        cert = certify(vae, X, 0.1, 0.95, support=support)
        assert cert.check.worst_ratio <= 1 + 1e-9


@pytest.mark.parametrize("name", ["in-place-view", "in-place-slice"])
def test_without_the_alias_rule_the_cross_check_alone_refuses(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from defenses.civet import graph

    monkeypatch.setattr(graph, "check_in_place", lambda g, n: None)
    make, _ = REFUSED[name]
    with pytest.raises(CrossCheckError, match=r"traced graph of model\.decode differs"):
        certify(make(), X, 0.0)


def test_a_batch_coupled_module_is_refused_even_for_one_row() -> None:
    make, _ = REFUSED["batch-coupled"]
    with pytest.raises(CrossCheckError, match="couples the rows of a batch"):
        certify(make(), X[:1], 0.05)


def test_inside_a_run_the_bounds_and_the_check_are_recorded_as_costs() -> None:
    from defenses.cost import recording

    with recording() as costs:
        cert = certify(UserVAE(), X, 0.1)
    assert costs["certify_bounds_s"] == pytest.approx(cert.seconds)
    assert costs["certify_check_s"] >= cert.check.seconds > 0
