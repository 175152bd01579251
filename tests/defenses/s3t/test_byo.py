"""Bring your own model: S3T, SISA and full retraining on user modules.

Each model passes the twin test in both forms (delete + retrain equals a fresh fit
without the ids, bit for bit; and the deactivation twin of
:func:`defenses.s3t.attacks.twin_test`) and the lineage audit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from defenses.data import load_digits
from defenses.s3t import S3T, SISA, FullRetrain, lineage_audit, twin_test
from defenses.s3t.backbone import train_module
from defenses.s3t.tasks import RowTransformer


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _init(model: nn.Module, gen: torch.Generator) -> None:
    """Redraw every weight from ``gen`` (norm layers at one, biases at zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / np.sqrt(p[0].numel()), generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


class SmallCNN(nn.Module):
    """Two convolutions (BatchNorm in eval mode), pooling, a linear head."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 16)
        self.out = nn.Linear(16, n_classes)
        _init(self, torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv1(x)))
        h = self.pool(torch.relu(self.conv2(h)))
        return self.out(torch.relu(self.fc(h.flatten(1))))


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    order = np.random.default_rng(3).permutation(len(data))
    return data, order[:120], order[200:340]


def _pretrained(model: nn.Module, X, y) -> nn.Module:
    train_module(model, X, y, torch.Generator().manual_seed(1), 2, 3e-3, 32)
    return model.eval()


@pytest.fixture(scope="module")
def cnn(digits):
    data, public, _ = digits
    X = data.X.reshape(-1, 1, 8, 8).astype(np.float32)
    return _pretrained(SmallCNN(), X[public], data.y[public]), X


@pytest.fixture(scope="module")
def transformer(digits):
    data, public, _ = digits
    model = RowTransformer(10, 16, 2, 2, 32, torch.Generator().manual_seed(0))
    X = data.X.astype(np.float32)
    return _pretrained(model, X[public], data.y[public]), X


def _retrain_equals_fresh_fit(make, X, y, ids, forget) -> None:
    model = make().fit(X, y, ids)
    receipt = model.delete(forget)
    assert receipt.deactivated
    report = lineage_audit(model, forget.tolist())
    assert report.clean, report
    retrained = model.retrain()
    assert retrained.stages
    keep = ~np.isin(ids, forget)
    fresh = make().fit(X[keep], y[keep], ids[keep])
    assert _same(model.active_state(), fresh.active_state())
    np.testing.assert_array_equal(model.predict_proba(X), fresh.predict_proba(X))
    assert lineage_audit(model, forget.tolist()).clean


def _twin_tests(make, X, y, ids, forget, target) -> None:
    """Both forms of the twin test: retrain after deleting ``forget``; ``target``."""
    _retrain_equals_fresh_fit(make, X, y, ids, forget)
    report = twin_test(make, X, y, ids, target=target)
    assert report.exact
    assert report.switched_off_differed


def _s3t(model: nn.Module, targets: list[str], head: str) -> Callable[[], S3T]:
    """The factory of S3T (2 shards x 2 slices, 2 orders, rank 2) on ``model``."""
    return functools.partial(
        S3T,
        model,
        2,
        2,
        2,
        2,
        target_modules=targets,
        head=head,
        epochs=1,
        batch_size=32,
    )


@pytest.mark.parametrize("kind", ["S3T", "SISA"])
def test_small_cnn_twin_tests_and_lineage(cnn, digits, kind) -> None:
    model, X = cnn
    data, _, pool = digits
    cls = S3T if kind == "S3T" else SISA
    settings = {"target_modules": ["conv1", "conv2", "fc"], "head": "out"}

    def make():
        return cls(model, 2, 3, rank=2, epochs=1, batch_size=32, **settings)

    _twin_tests(make, X[pool], data.y[pool], pool, pool[[3, 50]], pool[7])


def test_transformer_encoder_twin_tests_and_lineage(transformer, digits) -> None:
    model, X = transformer
    data, _, pool = digits

    make = _s3t(model, ["linear1", "linear2"], "head")
    _twin_tests(make, X[pool], data.y[pool], pool, pool[[1, 2, 90]], pool[11])
    fitted = make().fit(X[pool], data.y[pool], pool)
    trained_b = [b for st in fitted.stages().values() for _, b in st.adapters.values()]
    assert all(torch.count_nonzero(b) > 0 for b in trained_b)  # gradients reached B
    assert {n.split("/")[-1] for n in fitted.lineage() if "adapter" in n} == {
        "encoder.layers.0.linear1",
        "encoder.layers.0.linear2",
        "encoder.layers.1.linear1",
        "encoder.layers.1.linear2",
    }


def test_adapters_change_a_transformer_encoder_in_eval_mode(
    transformer, digits
) -> None:
    """The fused fast path of nn.TransformerEncoderLayer must not skip adapters."""
    model, X = transformer
    data, _, pool = digits
    fitted = S3T(
        model, 1, 2, 1, target_modules=["linear1", "linear2"], epochs=2, lr=0.05
    ).fit(X[pool], data.y[pool], pool)
    with torch.no_grad():
        plain = torch.softmax(model(torch.as_tensor(X[pool[:5]])).double(), 1)
    assert not np.allclose(fitted.predict_proba(X[pool[:5]]), plain.numpy())


@pytest.mark.slow
def test_bert_from_a_config_twin_tests_and_lineage(digits) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(config).eval()
    _init(model, torch.Generator().manual_seed(0))
    data, _, pool = digits
    tokens = (data.X.reshape(-1, 8, 8)[:, ::2, ::2].reshape(-1, 16) * 16).round()
    tokens = tokens.astype(np.int64)
    labels = np.array(["low", "mid", "high"])[data.y % 3]

    make = _s3t(model, ["query", "value"], "classifier")
    _twin_tests(make, tokens[pool], labels[pool], pool, pool[[0, 5]], pool[9])
    fitted = make().fit(tokens[pool], labels[pool], pool)
    assert list(fitted.classes_) == ["high", "low", "mid"]
    assert set(fitted.predict(tokens[:20])) <= {"high", "low", "mid"}
    with pytest.raises(ValueError, match="token ids must lie in"):
        fitted.predict(tokens[:3] + 100)


def test_string_labels_binary_two_columns_and_classes(transformer, digits) -> None:
    data, _, pool = digits
    model = RowTransformer(2, 16, 2, 2, 32, torch.Generator().manual_seed(4)).eval()
    X = transformer[1]
    labels = np.where(data.y[pool] < 5, "small", "large")
    fitted = SISA(
        model, 2, 2, target_modules=["linear1", "linear2"], head="head", epochs=1
    ).fit(X[pool], labels, pool)
    assert list(fitted.classes_) == ["large", "small"]
    proba = fitted.predict_proba(X[pool[:7]])
    assert proba.shape == (7, 2)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    assert set(fitted.predict(X[pool[:30]])) <= {"large", "small"}
    with pytest.raises(ValueError, match="logits have shape"):
        SISA(model, 2, 2, target_modules=["linear1"], epochs=1).fit(
            X[pool], data.y[pool], pool
        )


def test_full_retrain_accepts_the_same_model(cnn, digits) -> None:
    model, X = cnn
    data, _, pool = digits
    make = lambda: FullRetrain(  # noqa: E731
        model,
        2,
        target_modules=lambda n, m: isinstance(m, nn.Conv2d),
        head="out",
        epochs=1,
    )
    _retrain_equals_fresh_fit(make, X[pool], data.y[pool], pool, pool[[4]])
    assert make().model.targets == ("conv1", "conv2")


def test_an_emptied_shard_abstains_after_retrain_and_says_so(
    cnn, digits, caplog
) -> None:
    model, X = cnn
    data, _, pool = digits
    fitted = S3T(
        model, 2, 2, target_modules=r"conv\d|fc", head="out", rank=2, epochs=1
    ).fit(X[pool], data.y[pool], pool)
    shard0 = [i for i in pool if fitted.locate([i])[0][0] == 0]
    fitted.delete(shard0)
    with caplog.at_level(logging.WARNING, logger="defenses.s3t.defense.unlearner"):
        receipt = fitted.retrain()
    assert receipt.abstaining == (0,)
    assert {s for s, _ in receipt.empty} == {0}
    assert "empty" in caplog.text
    assert fitted.served()[0] == ()
    votes = fitted.shard_predictions(X[pool[:10]])
    assert (votes[0] == -1).all()
    assert (votes[1] >= 0).all()
    assert not any(s == 0 for s, _ in fitted.stages())
    one_slice = S3T(model, 2, 2, target_modules=r"conv\d|fc", head="out", epochs=1)
    one_slice.fit(X[pool], data.y[pool], pool)
    cell = [i for i in pool if one_slice.locate([i])[0] == (1, 0)]
    one_slice.delete(cell)
    receipt = one_slice.retrain()
    assert receipt.empty == ((1, 0),)
    assert receipt.abstaining == ()
    # the order (0, 1) starts at the emptied slice; (1, 0) serves up to it
    assert one_slice.orders == ((0, 1), (1, 0))
    assert one_slice.served()[1] == (1,)
    assert not any(s == 1 and 0 in p for s, p in one_slice.stages())


@pytest.mark.parametrize(
    ("targets", "match"),
    [
        (["nothing"], "matches no layer"),
        (["bn"], "BatchNorm2d; adapters go on"),
        (42, "target_modules must be"),
    ],
)
def test_bad_targets_name_target_modules(cnn, targets, match) -> None:
    model, _ = cnn
    with pytest.raises((ValueError, TypeError), match=match):
        S3T(model, 2, 2, target_modules=targets)


def test_a_target_whose_forward_never_runs_is_refused(digits) -> None:
    data, _, pool = digits

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.proj = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = self.proj(x.reshape(-1, 8, 8))
            return self.head(self.attn(rows, rows, rows)[0].mean(1))

    model = Attention().eval()
    with pytest.raises(ValueError, match="never runs"):
        S3T(model, 1, 2, target_modules=["out_proj", "proj"], head="head").fit(
            data.X[pool], data.y[pool], pool
        )


def test_the_user_model_is_not_modified(cnn, digits) -> None:
    model, X = cnn
    data, _, pool = digits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    S3T(model, 2, 2, target_modules=["conv2", "fc"], head="out", epochs=1).fit(
        X[pool], data.y[pool], pool
    )
    assert _same(before, model.state_dict())
    assert not model._forward_hooks
    assert all(not m._forward_hooks for m in model.modules())
