"""S3T's soundness suite: user models that keep state a step can move (issue 39).

Every model of :mod:`tests.defenses.s3t.soundness_modules` is either refused at
``fit`` by cause, naming the state, before any stage is trained, or fitted and then
proven exact: after a deletion, ``retrain()`` is bit-identical to a fresh fit on the
remaining data. The bypass tests switch the verdict off and show that the refused
models do break exactness, so the refusals guard real failures.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from defenses.s3t import S3T, lineage_audit
from defenses.s3t.conformance import Conformance
from defenses.s3t.defense import Unlearner
from tests.defenses.s3t.soundness_modules import ACCEPTED, REFUSED, TOKENS
from tests.defenses.s3t.user_modules import SETTINGS, UserMLP, data

X, Y, IDS = data()
X[:, 0] = np.clip(X[:, 0], -2.0, 2.0)
X[40, 0] = 3.0  # the only row RareInputs writes state for (not among the first 8)
TOKEN_X = np.random.default_rng(1).integers(0, 20, (X.shape[0], 5))


def _make(module: nn.Module) -> S3T:
    return S3T(module, 2, 2, rank=2, epochs=1, batch_size=16, **SETTINGS)


def _inputs(name: str) -> np.ndarray:
    return TOKEN_X if name in TOKENS else X


def _no_training(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a stage was trained before the refusal")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_at_fit_by_cause_before_any_training(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, phrase = REFUSED[name]
    monkeypatch.setattr(Unlearner, "_train", _no_training)
    with pytest.raises(ValueError, match=r"^model: ") as error:
        _make(make()).fit(_inputs(name), Y, IDS)
    assert phrase in str(error.value)


def _exact(
    make: Any, inputs: np.ndarray, forget: np.ndarray, audit: bool = True
) -> bool:
    model = _make(make()).fit(inputs, Y, IDS)
    model.delete(forget)
    assert lineage_audit(model, forget.tolist()).clean or not audit
    model.retrain()
    keep = ~np.isin(IDS, forget)
    fresh = _make(make()).fit(inputs[keep], Y[keep], IDS[keep])
    return bool(
        np.array_equal(model.predict_proba(inputs), fresh.predict_proba(inputs))
    )


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_models_fit_and_retrain_bit_identical_to_a_fresh_fit(
    name: str,
) -> None:
    assert _exact(ACCEPTED[name], _inputs(name), IDS[[0, 9]])


@pytest.mark.parametrize("name", ["list-counter", "float-ema", "actnorm", "dict-cache"])
def test_without_the_verdict_the_refused_models_break_exactness(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the power of the refusals: with the check switched off, retrain != fresh fit
    monkeypatch.setattr(Conformance, "verdict", lambda self: None)
    monkeypatch.setattr(Conformance, "run", lambda self, *args: None)
    make, _ = REFUSED[name]
    # retrain() checks the copy again: the second line of defense
    with pytest.raises(ValueError, match=r"changed since S3T copied it"):
        _exact(make, _inputs(name), IDS[[0, 9]], audit=False)
    monkeypatch.setattr(
        "defenses.s3t.defense.unlearner.check_unchanged", lambda *args: None
    )
    assert not _exact(make, _inputs(name), IDS[[0, 9]], audit=False)


class _Rescale(UserMLP):
    """Writes its own parameter in place without changing it (``mul_(1)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc1.weight.mul_(1.0)
        return self.out(self.hidden(x))


def test_an_in_place_write_is_refused_even_when_the_value_does_not_change() -> None:
    with pytest.raises(ValueError, match=r"parameter 'fc1\.weight'.*aten\.mul_"):
        _make(_Rescale()).fit(X, Y, IDS)


class _NumpyDraw(UserMLP):
    """Draws from numpy's global generator and discards it (outputs unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        np.random.rand()  # noqa: NPY002
        return self.out(self.hidden(x))


class _PythonDraw(UserMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        random.random()
        return self.out(self.hidden(x))


def test_a_global_forward_hook_with_state_is_refused() -> None:
    seen: list[int] = []

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        seen.append(1)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        with pytest.raises(ValueError, match=r"closure variable .*<closure seen>"):
            _make(UserMLP()).fit(X, Y, IDS)
    finally:
        handle.remove()


def test_state_changed_before_fit_through_the_copy_is_refused() -> None:
    # tampering with the copy between construction and fit is a moved state too
    model = _make(_with_counter())
    model.backbone.counter = 5
    with pytest.raises(ValueError, match="attribute 'counter'"):
        model.fit(X, Y, IDS)


def _with_counter() -> UserMLP:
    module = UserMLP()
    module.counter = 0
    return module


def test_a_refused_model_leaves_no_state_and_an_accepted_one_fits_twice() -> None:
    model = _make(ACCEPTED["constants"]())
    first = model.fit(X, Y, IDS).predict_proba(X)
    np.testing.assert_array_equal(model.fit(X, Y, IDS).predict_proba(X), first)
    with pytest.raises(ValueError, match="attribute 'calls"):
        _make(REFUSED["list-counter"][0]()).fit(X, Y, IDS)


class _WithTanh(UserMLP):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.hidden(x)))


def test_a_stateful_class_level_patch_of_a_library_module_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = [0]

    def patched(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.tanh(x)

    monkeypatch.setattr(nn.Tanh, "forward", patched)
    with pytest.raises(ValueError, match=r"closure variable .*<closure calls>\[0\]"):
        _make(_WithTanh()).fit(X, Y, IDS)


class _Ticker(UserMLP):
    """An ``itertools.count`` (a C iterator) advanced in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = itertools.count()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        next(self.ticks)
        return self.out(self.hidden(x))


@functools.cache
def _memo(rows: int) -> float:
    return 1.0 + 0.0 * rows


class _Memoised(UserMLP):
    """A module-level ``lru_cache`` memo that grows with the batch sizes seen."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x)) * _memo(x.shape[0])


@pytest.mark.parametrize(
    ("module", "phrase"),
    [
        (_NumpyDraw, "random generator '<numpy global generator>'"),
        (_PythonDraw, "random generator '<python random>'"),
        (_Ticker, "attribute 'ticks'"),
        (_Memoised, "global 'tests.defenses.s3t"),
    ],
    ids=["numpy-draw", "python-draw", "c-iterator", "memo-cache"],
)
def test_draws_outside_torch_and_state_in_iterators_or_caches_are_refused(
    module: type[UserMLP], phrase: str
) -> None:
    _memo.cache_clear()
    with pytest.raises(ValueError, match=re.escape(phrase)):
        _make(module()).fit(X, Y, IDS)


def test_retrain_refuses_a_backbone_moved_after_fit() -> None:
    model = _make(_with_counter()).fit(X, Y, IDS)
    model.delete(IDS[[0]])
    model.backbone.counter = 1  # written after fit, e.g. through model.backbone
    with pytest.raises(ValueError, match=r"attribute 'counter'.*retrain\(\)"):
        model.retrain()
    model.backbone.counter = 0
    assert model.retrain().stages  # restored: retrains


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_old_style_parametrizations_are_refused_by_name(kind: str) -> None:
    module = UserMLP()
    getattr(torch.nn.utils, kind)(module.fc2)
    with pytest.raises(ValueError, match=rf"fc2 carries an old-style .*{kind}"):
        _make(module)
    new = UserMLP()
    getattr(torch.nn.utils.parametrizations, kind)(new.fc2)
    new.eval()
    assert _make(new).fit(X, Y, IDS).predict(X[:2]).shape == (2,)
