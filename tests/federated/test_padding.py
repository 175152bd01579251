"""Constant-work Opacus steps (issue 37): the padded batches release what Opacus did."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus import GradSampleModule
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from defense_suite.federated import private_optimizer
from defense_suite.federated.client import LocalData, StepPlan, local_train
from defense_suite.federated.flower.client import PrivateRound
from defense_suite.federated.ledger import ClientPrivacy, Grant, PrivacyLedger
from defense_suite.federated.padding import (
    ETA,
    PaddedPoissonSampler,
    RowMasks,
    padded,
    padded_rows,
    tail,
)
from defense_suite.federated.private_optimizer import SanitizingDPOptimizer
from tests.federated import redteam_timing as timing


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(1e-4, 1.0, allow_nan=False),
    count=st.integers(1, 100_000),
)
def test_padded_rows_is_the_least_row_count_past_the_public_tail(rate, count):
    rows = padded_rows(rate, count)
    assert 1 <= rows <= count
    assert tail(rows, rate, count) <= ETA
    assert rows == 1 or tail(rows - 1, rate, count) > ETA
    assert padded_rows(rate, count + 1) >= rows  # more records, never fewer rows


def test_padded_rows_takes_only_public_values_and_checks_them():
    assert padded_rows(1.0, 445) == 445  # every record is sampled at rate 1
    assert padded_rows(0.3, 445) == padded_rows(0.3, 445)
    for bad in ({"rate": 0.0}, {"rate": 1.5}, {"public_count": 0}, {"eta": 1.0}):
        args = {"rate": 0.3, "public_count": 445, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            padded_rows(**args)


def test_a_padded_batch_puts_the_sample_first_and_masks_the_rest():
    index, mask = padded([4, 9], 5, 3)
    assert index == [4, 9, 0, 1, 2]
    assert mask.tolist() == [True, True, False, False, False]
    index, mask = padded([0, 1, 2], 2, 3)  # a sample above the rows is kept whole
    assert index == [0, 1, 2]
    assert mask.all()


def test_the_sampler_draws_opacus_sample_on_the_same_generator():
    ours = PaddedPoissonSampler(50, 0.2, 30, torch.Generator().manual_seed(3))
    theirs = UniformWithReplacementSampler(
        num_samples=50, sample_rate=0.2, generator=torch.Generator().manual_seed(3)
    )
    assert len(ours) == len(theirs) == 5
    for index, sample in zip(ours, theirs, strict=True):
        mask = ours.pending.popleft()
        assert len(index) == 30
        assert index[: len(sample)] == sample
        assert int(mask.sum()) == len(sample)


def _opacus_update(dataset, seed, q, steps, public):
    """Opacus's own mechanism: DPDataLoader, DPOptimizer, normalized by q N."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
    ).double()
    generator = torch.Generator().manual_seed(seed)
    loader = DPDataLoader(dataset, sample_rate=q, generator=generator)
    model = GradSampleModule(net, loss_reduction="mean")
    optimizer = DPOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.5), noise_multiplier=1.0,
        max_grad_norm=1.0, expected_batch_size=round(q * public),
        loss_reduction="mean", generator=generator,
    )  # fmt: skip
    taken = 0
    while taken < steps:
        for xb, yb in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            taken += 1
            if taken == steps:
                break
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("n", [40, 445])
def test_make_private_releases_opacus_noised_update_with_padded_batches(n):
    """Same generator seed: the padded round's update is Opacus's to 1e-12."""
    dataset = timing.records(n, d=6)
    rng = np.random.default_rng(n)
    seed = int(np.random.default_rng(n).integers(2**63 - 1))  # make_private's draw
    optimizer, net = timing.opacus_round(dataset, rng, public=445, rate=0.2, steps=6)
    expected = _opacus_update(dataset, seed, 0.2, 6, 445)
    rows = padded_rows(0.2, 445)
    assert optimizer.rows == [rows] * 6
    for got, want in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, atol=1e-12, rtol=0)


def test_the_mlp_backend_pads_every_step_and_releases_the_same_update(monkeypatch):
    made = []

    class Recording(SanitizingDPOptimizer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(private_optimizer, "SanitizingDPOptimizer", Recording)
    rng = np.random.default_rng(0)
    params = [rng.normal(size=(5, 4)), np.zeros(4), rng.normal(size=(4, 3)),
              np.zeros(3)]  # fmt: skip
    out = {}
    for n in (30, 400):
        data = LocalData(rng.normal(size=(n, 5)), rng.integers(0, 3, n), 3)
        for constant in (True, False):
            out[n, constant] = local_train(
                params, data, StepPlan(0.1, 3, 1.0), lr=0.5, clip=1.0,
                rng=np.random.default_rng(n), public_count=400,
                constant_work=constant,
            )  # fmt: skip
    rows = padded_rows(0.1, 400)
    assert [o.rows for o in made[::2]] == [[rows] * 3, [rows] * 3]  # padded
    assert [o.rows for o in made[1::2]] == [o.sampled for o in made[1::2]]
    for n in (30, 400):
        for a, b in zip(out[n, True], out[n, False], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-12, rtol=0)


def _clipped(rows, labels, mask):
    torch.manual_seed(0)
    net = GradSampleModule(torch.nn.Linear(3, 2).double(), loss_reduction="sum")
    X = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(labels)
    torch.nn.functional.cross_entropy(net(X), y, reduction="sum").backward()
    masks = None
    if mask is not None:
        masks = RowMasks()
        masks.push(torch.tensor(mask))
    optimizer = SanitizingDPOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), noise_multiplier=1.0,
        max_grad_norm=1.0, expected_batch_size=3, loss_reduction="sum", masks=masks,
    )  # fmt: skip
    optimizer.clip_and_accumulate()
    return [p.summed_grad.clone() for p in optimizer.params], optimizer


def test_masked_rows_leave_the_clipped_sum_of_the_sample_even_when_not_finite():
    rows = [[1.0, 2.0, 0.5], [np.inf, 0.0, 1.0], [0.3, -1.0, 2.0], [9.0, 1.0, 1.0]]
    masked, optimizer = _clipped(rows, [0, 1, 1, 0], [True, False, True, False])
    sample, _ = _clipped([rows[0], rows[2]], [0, 1], None)
    for a, b in zip(masked, sample, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert optimizer.sanitized == 0  # the non-finite row was padding
    assert optimizer.rows == [4]
    assert optimizer.sampled == [2]
    _, sampled_inf = _clipped(rows, [0, 1, 1, 0], [True, True, True, False])
    assert sampled_inf.sanitized == 1


def test_a_step_needs_exactly_one_batch_from_the_loader():
    dataset = timing.records(50, d=6)
    for misuse in ("two batches, one step", "one batch, two steps"):
        privacy = ClientPrivacy(epsilon=50.0, delta=1e-5, rounds=1, steps=4, sigma=1.0)
        rnd = PrivateRound(
            Grant(1, 0.2, 1.0, 4), PrivacyLedger(privacy),
            np.random.default_rng(0), 0, 50,
        )  # fmt: skip
        net = torch.nn.Linear(6, 3).double()
        model, optimizer, loader = rnd.make_private(
            net, torch.optim.SGD(net.parameters(), lr=0.1), dataset, max_grad_norm=1.0
        )
        batches = iter(loader)
        xb, yb = next(batches)
        if misuse == "two batches, one step":
            next(batches)
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        if misuse == "one batch, two steps":
            optimizer.step()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
        with pytest.raises(RuntimeError, match="step once per batch"):
            optimizer.step()


def test_the_fingerprints_hash_the_public_count_of_rows(monkeypatch):
    """The ledger's fingerprints of n training records take the time of
    max(n, N) hashes (N public) and are the same digests as unpadded."""
    import hashlib

    from defense_suite.federated import store

    rows = np.random.default_rng(0).normal(size=(12, 4))
    plain = store.fingerprints(rows[:3])
    calls = []
    real = hashlib.sha256

    def counting(data=b""):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(store.hashlib, "sha256", counting)
    for n, pad, hashed in ((3, 10, 10), (10, 10, 10), (12, 10, 12), (3, 0, 3)):
        calls.clear()
        got = store.fingerprints(rows[:n], pad)
        assert len(got) == n
        assert calls == [4 * 8] * hashed  # every hash over one row's bytes
    assert store.fingerprints(rows[:3], 10) == plain
