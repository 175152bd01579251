from __future__ import annotations

import numpy as np
import pytest
import torch

from defenses.civet.certificate import certify
from defenses.civet.defense import TrainConfig, epoch_ratio, schedule, train_vae
from defenses.civet.protocol import as_vae
from tests.defenses.civet.helpers import generator, inputs, small_vae

FAST = TrainConfig(epochs=3, batch_size=32, warmup=0, pgd_steps=2)


@pytest.mark.parametrize("method", ["standard", "pgd", "civet"])
def test_same_seed_gives_the_same_model(method: str) -> None:
    X = inputs(0, 64)
    a, b = small_vae(0), small_vae(0)
    log_a = train_vae(a, X, method, FAST, generator(7), progress=False)
    log_b = train_vae(b, X, method, FAST, generator(7), progress=False)
    assert log_a.losses == log_b.losses
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert len(log_a.epoch_seconds) == 3
    assert np.isfinite(log_a.losses).all()


def test_numpy_generator_is_accepted_and_seeds_matter() -> None:
    X = inputs(0, 64)
    a, b = small_vae(0), small_vae(0)
    train_vae(a, X, "standard", FAST, np.random.default_rng(1), progress=False)
    train_vae(b, X, "standard", FAST, np.random.default_rng(2), progress=False)
    assert not torch.equal(a.decoder[0].weight, b.decoder[0].weight)


def test_training_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    train_vae(small_vae(), inputs(0, 32), "civet", FAST, generator(0), progress=False)
    assert torch.get_num_threads() == before


def test_schedule_golden_vector() -> None:
    cfg = TrainConfig(epochs=10, warmup=2, ramp=0.5)
    # 10 steps per epoch: warm-up for 20 steps, then a ramp of 50 steps
    assert schedule(0, 10, cfg) == 0.0
    assert schedule(20, 10, cfg) == 0.0
    assert schedule(45, 10, cfg) == pytest.approx(0.5)
    assert schedule(70, 10, cfg) == 1.0
    assert schedule(99, 10, cfg) == 1.0


def test_civet_training_tightens_the_certificate() -> None:
    X = inputs(0, 256)
    cfg = TrainConfig(epochs=12, batch_size=32, warmup=1, eps=0.1, kappa=0.5, lr=5e-3)
    standard, civet = small_vae(0), small_vae(0)
    train_vae(standard, X, "standard", cfg, generator(0), progress=False)
    train_vae(civet, X, "civet", cfg, generator(0), progress=False)
    loose = certify(standard, X[:20], 0.1, 0.95).bound.mean()
    tight = certify(civet, X[:20], 0.1, 0.95).bound.mean()
    assert tight < 0.8 * loose


def test_train_rejects_bad_method_and_data() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        train_vae(small_vae(), inputs(), "lipschitz", FAST)  # type: ignore[arg-type]
    bad = inputs()
    bad[1, 1] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        train_vae(small_vae(), bad, "standard", FAST)
    with pytest.raises(ValueError, match="input domain"):
        train_vae(small_vae(), inputs() * 3, "standard", FAST)
    with pytest.raises(TypeError, match=r"numpy\.random\.Generator or a torch"):
        train_vae(small_vae(), inputs(), "standard", FAST, rng=42)  # type: ignore[arg-type]


def test_double_precision_models_train() -> None:
    model = small_vae(0).double()
    log = train_vae(model, inputs(0, 32), "civet", FAST, generator(0), progress=False)
    assert np.isfinite(log.losses).all()
    assert next(model.parameters()).dtype == torch.float64


@pytest.mark.parametrize("method", ["pgd", "civet"])
def test_epoch_ratio_times_copies_and_leaves_the_model(method: str) -> None:
    model = small_vae(3)
    before = [p.detach().clone() for p in model.parameters()]
    vae = as_vae(model, inputs(0, 48))
    wall, cpu = epoch_ratio(vae, inputs(0, 48), method, FAST, rounds=2)  # type: ignore[arg-type]
    assert np.isfinite(wall)
    assert wall > 0
    assert np.isfinite(cpu)
    assert cpu > 0
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="method"):
        epoch_ratio(vae, inputs(0, 48), "sgd", FAST)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounds"):
        epoch_ratio(vae, inputs(0, 48), "civet", FAST, rounds=0)
