"""The model adapters: torch modules, predict_proba objects and callables."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from defenses.audit.target import as_audited
from defenses.audit.threats import describe, threat_model

RNG = np.random.default_rng(0)
X = RNG.normal(size=(30, 4))
Y = (X[:, 0] > 0).astype(int)


def test_torch_logits_become_probabilities_in_the_input_shape():
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    model = as_audited(net, (1, 2, 2), batch_size=7)
    probs = model.predict_proba(X)
    with torch.no_grad():
        logits = net(torch.as_tensor(X.reshape(-1, 1, 2, 2), dtype=torch.float32))
    assert np.allclose(probs, torch.softmax(logits.double(), 1).numpy())
    assert np.allclose(probs.sum(axis=1), 1.0)
    soft = torch.nn.Sequential(net, torch.nn.Softmax(dim=1))
    assert np.allclose(as_audited(soft, (1, 2, 2), "probs").predict_proba(X), probs)


def test_predict_proba_models_keep_their_classes():
    clf = LogisticRegression().fit(X, np.array(["a", "b"])[Y])
    model = as_audited(clf, (4,))
    assert model.classes.tolist() == ["a", "b"]
    assert np.allclose(model.predict_proba(X), clf.predict_proba(X))
    with pytest.raises(ValueError, match="logits"):
        as_audited(clf, (4,), "logits")
    with pytest.raises(ValueError, match=r"shape \(n, 4\)"):
        model.predict_proba(X[:, :3])


def test_callables_and_their_checks():
    logits = as_audited(lambda x: x[:, :3], (4,), "logits")
    assert np.allclose(logits.predict_proba(X).sum(axis=1), 1.0)
    bad = as_audited(lambda x: x[:, :3], (4,))
    with pytest.raises(ValueError, match="model"):
        bad.predict_proba(X)
    with pytest.raises(TypeError, match="model"):
        as_audited(3, (4,))
    with pytest.raises(ValueError, match="outputs"):
        as_audited(lambda x: x, (4,), "scores")


def test_threat_model_in_words():
    assert "predicted labels only" in describe(threat_model("labels"))
    words = describe(threat_model(queries=100, aux_data=False, adaptive=True))
    assert "at most 100 queries" in words
    assert "holds no auxiliary data" in words
    assert "knows the defense" in words
