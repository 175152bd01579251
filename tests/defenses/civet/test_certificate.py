from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from defenses.civet.certificate import certify
from defenses.civet.model import sse
from defenses.civet.support import halfwidth
from tests.defenses.civet.helpers import generator, inputs, small_vae


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), eps=st.floats(0.0, 0.3), p=st.floats(0.3, 0.99))
def test_sampled_inputs_and_noise_in_the_support_stay_under_the_bound(
    seed: int, eps: float, p: float
) -> None:
    model = small_vae(seed).double()
    x = inputs(seed, 4)
    cert = certify(model, x, eps, p)
    k = halfwidth(p, 2)
    g = generator(seed)
    xt = torch.as_tensor(x)
    for _ in range(5):
        x_adv = (
            xt + eps * (2 * torch.rand(xt.shape, generator=g, dtype=torch.float64) - 1)
        ).clamp(0, 1)
        nu = k * (2 * torch.rand((4, 2), generator=g, dtype=torch.float64) - 1)
        with torch.no_grad():
            loss = sse(model(x_adv, nu), xt).numpy()
        assert np.all(loss <= cert.bound + 1e-9)


def test_bound_grows_with_eps_and_p() -> None:
    model, x = small_vae(1), inputs(1)
    small = certify(model, x, 0.01, 0.9).bound
    wider = certify(model, x, 0.1, 0.9).bound
    likelier = certify(model, x, 0.01, 0.99).bound
    assert np.all(wider >= small - 1e-12)
    assert np.all(likelier >= small - 1e-12)
    assert wider.mean() > small.mean()


def test_certificate_fields_are_consistent() -> None:
    model, x = small_vae(2), inputs(2)
    cert = certify(model, x, 0.05, 0.95)
    assert cert.bound.shape == (6,)
    assert cert.latent_lower.shape == (6, 2)
    assert np.all(cert.bound <= cert.ceiling + 1e-12)
    assert np.all(cert.expected_bound <= cert.ceiling + 1e-12)
    assert np.all(cert.latent_lower <= cert.latent_upper)
    assert cert.k == pytest.approx(halfwidth(0.95, 2))
    assert 0.95 in cert.levels
    # ceiling: sum over pixels of max(x^2, (1-x)^2) for sigmoid outputs
    assert cert.ceiling == pytest.approx(np.maximum(x**2, (1 - x) ** 2).sum(axis=1))


def test_certify_leaves_the_model_unchanged() -> None:
    model, x = small_vae(3), inputs(3)
    before = copy.deepcopy(model.state_dict())
    certify(model, x, 0.1, 0.9)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert next(model.parameters()).dtype == torch.float32


def test_certify_accepts_tensors_and_arrays_alike() -> None:
    model, x = small_vae(4), inputs(4)
    a = certify(model, x, 0.1).bound
    b = certify(model, torch.as_tensor(x), 0.1).bound
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"eps": -0.1}, ValueError, "eps must be a finite number >= 0"),
        ({"eps": float("inf")}, ValueError, "eps must be a finite number"),
        ({"eps": "0.1"}, ValueError, "eps must be a finite number"),
        ({"eps": True}, ValueError, "eps must be a finite number"),
        ({"p": 0.0}, ValueError, r"p must be a finite number in \(0.0, 1.0\)"),
        ({"p": 1.0}, ValueError, r"p must be a finite number in \(0.0, 1.0\)"),
        ({"p": 1.2}, ValueError, r"p must be a finite number in"),
        ({"levels": (0.9, 0.5)}, ValueError, "increasing"),
    ],
)
def test_certify_rejects_bad_parameters(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {"eps": 0.1, "p": 0.9}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        certify(small_vae(), inputs(), **args)  # type: ignore[arg-type]


def test_certify_rejects_bad_inputs() -> None:
    model, x = small_vae(), inputs()
    nan = x.copy()
    nan[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        certify(model, nan, 0.1)
    with pytest.raises(ValueError, match=r"input domain \[0.0, 1.0\]"):
        certify(model, x + 1.0, 0.1)
    with pytest.raises(ValueError, match=r"input domain"):
        certify(model, x - 0.5, 0.1)
    with pytest.raises(ValueError, match=r"x of shape \(1, 8\).*does not fit"):
        certify(model, x[:, :8], 0.1)
    with pytest.raises(ValueError, match=r"x must have shape \(n, \.\.\.\)"):
        certify(model, np.zeros((0, 16)), 0.1)


def test_unsupported_layer_in_a_model_is_refused() -> None:
    from torch import nn

    from defenses.civet.bounds import UnsupportedLayerError
    from defenses.civet.model import VAE

    with pytest.raises(UnsupportedLayerError, match="LayerNorm"):
        VAE(
            nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)),
            nn.Linear(3, 2),
            nn.Linear(3, 2),
            nn.Sequential(nn.Linear(2, 4), nn.Sigmoid()),
            n_features=4,
            latent_dim=2,
        )
    model = small_vae()
    model.decoder.append(nn.Hardswish())
    with pytest.raises(UnsupportedLayerError, match="Hardswish"):
        certify(model, inputs(), 0.1)


def test_exact_support_is_tighter_and_holds_by_sampling() -> None:
    model = small_vae(6).double()
    x = inputs(6, 3)
    eps, p = 0.2, 0.9
    uniform = certify(model, x, eps, p)
    exact = certify(model, x, eps, p, support="exact")
    assert np.all(exact.bound <= uniform.bound + 1e-12)
    assert np.all(
        exact.latent_upper - exact.latent_lower
        <= uniform.latent_upper - uniform.latent_lower + 1e-12
    )
    g = generator(1)
    xt = torch.as_tensor(x)
    for _ in range(4):
        x_adv = (
            xt + eps * (2 * torch.rand(xt.shape, generator=g, dtype=torch.float64) - 1)
        ).clamp(0, 1)
        nu = torch.randn((4000, 3, 2), generator=g, dtype=torch.float64)
        with torch.no_grad():
            mu, logvar = model.encode(x_adv)
            z = mu + torch.exp(0.5 * logvar) * nu
            loss = (
                (model.decode(z.reshape(-1, 2)).reshape(4000, 3, 16) - xt) ** 2
            ).sum(2)
        inside = (
            (z >= torch.as_tensor(exact.latent_lower))
            & (z <= torch.as_tensor(exact.latent_upper))
        ).all(2)
        assert bool((inside.double().mean(0) >= p - 0.02).all())
        assert bool(
            ((loss <= torch.as_tensor(exact.bound)).double().mean(0) >= p - 0.02).all()
        )


def test_certify_rejects_an_unknown_support() -> None:
    with pytest.raises(ValueError, match="support must be one of"):
        certify(small_vae(), inputs(), 0.1, support="ellipsoid")


def test_numpy_scalars_are_accepted_as_eps_and_p() -> None:
    # issue 19: np.int64(0) as eps was refused
    model, x = small_vae(), inputs()
    zero = certify(model, x, np.int64(0), np.float32(0.9))  # type: ignore[arg-type]
    same = certify(model, x, 0.0, float(np.float32(0.9)))
    assert np.array_equal(zero.bound, same.bound)
    assert np.all(np.isfinite(zero.bound))


def test_p_within_rounding_of_one_gives_finite_bounds() -> None:
    # issue 19: certify(p=0.9999999999999999) returned NaN bounds
    model, x = small_vae(), inputs()
    cert = certify(model, x, 0.1, 0.9999999999999999)
    assert np.isfinite(cert.k)
    assert cert.k > halfwidth(1 - 1e-12, 2)
    for values in (cert.bound, cert.expected_bound, cert.latent_upper):
        assert np.all(np.isfinite(values))
    assert np.all(cert.bound >= certify(model, x, 0.1, 0.999).bound)
    assert np.all(cert.bound <= cert.ceiling)
    exact = certify(model, x, 0.1, 0.9999999999999999, support="exact")
    assert np.all(np.isfinite(exact.bound))
    assert np.all(exact.bound <= cert.bound)
