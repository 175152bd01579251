"""The bad-input rule on every public entry point of CIVET (issue 19).

Each call either returns a valid result (finite; bounds of shape (n,) between 0 and
the loss ceiling; a finite training log) or raises ValueError/TypeError naming the
parameter (:func:`defenses.testing.assert_rule`). Few examples by default, ten
times more with ``--runslow``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

from defenses.civet import Box, TrainConfig, certify, ibp, train_vae
from defenses.civet.arms import CivetTraining, PGDTraining
from defenses.civet.attacks import EOTPGD, JointPGD, LatentAttack, MaxDamage, mc_check
from defenses.civet.certificate import Certificate
from defenses.civet.protocol import as_vae
from defenses.civet.scenario import CivetScenario
from defenses.civet.support import halfwidth
from defenses.testing import assert_rule, bad_arrays, bad_reals, rule_settings
from tests.defenses.civet.helpers import inputs, small_vae
from tests.defenses.civet.user_modules import ACCEPTED, REFUSED

N, F = 6, 16
MODEL = small_vae()
X0 = inputs(0, N)


def in_domain(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Arrays inside [0, 1] (the valid inputs) in every float width."""
    return st.sampled_from([np.float64, np.float32, np.float16]).flatmap(
        lambda dtype: hnp.arrays(dtype, shape, elements=st.floats(0, 1, width=16))
    )


def inputs_of(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    return st.one_of(bad_arrays(shape), in_domain(shape))


def valid_certificate(n: int):  # type: ignore[no-untyped-def]
    def check(cert: Certificate) -> None:
        assert cert.bound.shape == (n,)
        assert np.all(cert.bound >= 0)
        assert np.all(cert.bound <= cert.ceiling + 1e-9)
        assert np.all(cert.expected_bound <= cert.ceiling + 1e-9)

    return check


@rule_settings()
@given(x=inputs_of((N, F)))
def test_certify_inputs(x: np.ndarray) -> None:
    n = x.shape[0] if x.ndim else 0
    assert_rule(lambda: certify(MODEL, x, 0.1, 0.9), ["x"], valid_certificate(n))


@rule_settings()
@given(eps=bad_reals(), p=bad_reals())
def test_certify_eps_and_p(eps: object, p: object) -> None:
    assert_rule(lambda: certify(MODEL, X0, eps, p), ["eps", "p"], valid_certificate(N))  # type: ignore[arg-type]


@rule_settings(10)
@given(level=bad_reals(), name=st.sampled_from(["ibp", "crown", "lp", None, 3]))
def test_certify_levels_relaxation_support(level: object, name: object) -> None:
    assert_rule(
        lambda: certify(MODEL, X0, 0.1, 0.9, levels=(0.5, level)),  # type: ignore[arg-type]
        ["levels"],
        valid_certificate(N),
    )
    assert_rule(
        lambda: certify(MODEL, X0, 0.1, 0.9, relaxation=name),  # type: ignore[arg-type]
        ["relaxation"],
        valid_certificate(N),
    )
    assert_rule(
        lambda: certify(MODEL, X0, 0.1, 0.9, support=name),  # type: ignore[arg-type]
        ["support"],
        valid_certificate(N),
    )


@rule_settings(10)
@given(low=bad_reals(), high=bad_reals())
def test_domain(low: object, high: object) -> None:
    assert_rule(
        lambda: certify(MODEL, X0, 0.1, 0.9, domain=(low, high)),  # type: ignore[arg-type]
        ["domain", "x"],
        valid_certificate(N),
    )


@rule_settings(8)
@given(X=inputs_of((12, F)), method=st.sampled_from(["civet", "pgd", "standard", "x"]))
def test_train_vae_inputs(X: np.ndarray, method: str) -> None:
    model = small_vae(1)
    config = TrainConfig(epochs=1, batch_size=8, warmup=0, pgd_steps=1)
    log = assert_rule(
        lambda: train_vae(model, X, method, config, progress=False),  # type: ignore[arg-type]
        ["X", "method"],
    )
    if log is not None:
        assert len(log.losses) == 1


FIELDS = ("lr", "beta", "eps", "kappa", "ramp", "epochs", "batch_size", "warmup")


@rule_settings()
@given(field=st.sampled_from(FIELDS), value=bad_reals())
def test_train_config_fields(field: str, value: object) -> None:
    assert_rule(lambda: TrainConfig(**{field: value}), [f"TrainConfig.{field}"])


@rule_settings()
@given(bound=bad_arrays((N,)), p=bad_reals(), samples=bad_reals())
def test_mc_check(bound: np.ndarray, p: object, samples: object) -> None:
    def valid(check: object) -> None:
        assert check.under.shape == (N,)  # type: ignore[attr-defined]
        assert np.all((check.under >= 0) & (check.under <= 1))  # type: ignore[attr-defined]

    assert_rule(
        lambda: mc_check(MODEL, X0, X0, bound, p, samples=samples),  # type: ignore[arg-type]
        ["bound", "p", "samples"],
        valid,
    )


@rule_settings()
@given(p=bad_reals(), d=bad_reals())
def test_halfwidth(p: object, d: object) -> None:
    def valid(k: float) -> None:
        assert k >= 0

    assert_rule(lambda: halfwidth(p, d), ["p", "latent_dim"], valid)  # type: ignore[arg-type]


@rule_settings()
@given(lower=bad_arrays((2, 3)), width=st.floats(0, 2))
def test_ibp_boxes(lower: np.ndarray, width: float) -> None:
    layer = nn.Sequential(nn.Linear(3, 2), nn.SiLU())

    def call() -> Box:
        low = torch.as_tensor(lower)
        return ibp(layer, Box(low, low + width))

    assert_rule(call, ["Box", "box", "dtype", "shape"])


CONFIGS = {
    "CivetScenario": (
        CivetScenario,
        ("eps", "p", "n_eval", "latent_dim", "lr", "epochs"),
    ),
    "CivetTraining": (CivetTraining, ("eps", "kappa")),
    "PGDTraining": (PGDTraining, ("eps", "kappa", "steps")),
    "JointPGD": (JointPGD, ("steps", "restarts", "threads")),
    "EOTPGD": (EOTPGD, ("steps", "samples")),
    "LatentAttack": (LatentAttack, ("steps",)),
    "MaxDamage": (MaxDamage, ("steps",)),
}


@pytest.mark.parametrize("owner", sorted(CONFIGS))
@rule_settings(10)
@given(data=st.data(), value=bad_reals())
def test_configuration_fields(owner: str, data: st.DataObject, value: object) -> None:
    cls, fields = CONFIGS[owner]
    field = data.draw(st.sampled_from(fields))
    assert_rule(lambda: cls(**{field: value}), [f"{owner}.{field}", owner])


def test_as_vae_refuses_what_is_not_a_vae() -> None:
    assert_rule(lambda: as_vae(nn.Linear(16, 16), X0), ["model"])
    assert_rule(lambda: as_vae("vae", X0), ["model"])  # type: ignore[arg-type]
    assert_rule(lambda: as_vae(MODEL, X0, encode=3), ["model"])  # type: ignore[arg-type]


def test_regressions_of_issue_19() -> None:
    # p within rounding of 1 gave NaN bounds; np.int64(0) as eps was refused
    for p in (0.9999999999999999, np.float64(1 - 1e-15)):
        assert_rule(lambda p=p: certify(MODEL, X0, 0.1, p), ["p"], valid_certificate(N))
    assert certify(MODEL, X0, np.int64(0), 0.9).eps == 0.0  # type: ignore[arg-type]
    assert certify(MODEL, X0, np.float32(0.1), np.float32(0.9)).p == pytest.approx(0.9)  # type: ignore[arg-type]
    huge = X0.copy()
    huge[0, 0] = 1e39  # finite in float64, inf in the model's float32
    with pytest.raises(ValueError, match="x holds NaN or inf"):
        certify(MODEL, huge, 0.1)


USER_MODULES = {**{k: make for k, (make, _) in REFUSED.items()}, **ACCEPTED}
"""The family of user modules of issue 27 (in-place views, functional dropout,
buffers updated in forward, frozen state and noise, NaN, float64, compiled)."""


@pytest.mark.parametrize("name", sorted(USER_MODULES))
@rule_settings(4)
@given(x=in_domain((N, F)), eps=st.floats(0, 0.3), p=st.floats(0.3, 0.99))
def test_user_modules(name: str, x: np.ndarray, eps: float, p: float) -> None:
    assert_rule(
        lambda: certify(USER_MODULES[name](), x, eps, p),
        ["model", "layer", "function"],
        valid_certificate(N),
    )
