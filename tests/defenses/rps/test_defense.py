import numpy as np
import pytest
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.linear_model import LogisticRegression

from defenses.metrics import coverage
from defenses.rps import (
    PartTrainingError,
    ReliableConformalClassifier,
    TorchPartClassifier,
)
from defenses.rps.baselines import SplitConformalClassifier
from defenses.rps.defense import NotFittedError


def lr():
    return LogisticRegression(max_iter=1000)


@pytest.fixture(scope="module")
def fitted(digits_split):
    (Xt, yt), (Xc, yc), _ = digits_split
    return (
        ReliableConformalClassifier(
            lr(), n_train_parts=10, n_calib_parts=5, confidence_level=0.9
        )
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )


def test_one_part_each_is_split_conformal(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    rps = (
        ReliableConformalClassifier(
            lr(), n_train_parts=1, n_calib_parts=1, confidence_level=0.9
        )
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    plain = SplitConformalClassifier(lr(), 0.9).fit(Xt, yt).conformalize(Xc, yc)
    assert np.array_equal(
        rps.predict_set(Xs)[1][:, :, 0], plain.predict_set(Xs)[1][:, :, 0]
    )


def test_sets_certificate_and_coverage(fitted, digits_split):
    _, _, (Xs, ys) = digits_split
    sets = fitted.predict_set(Xs)[1][:, :, 0]
    cert = fitted.certify(Xs)
    assert sets.dtype == bool
    assert sets.shape == (len(ys), 10)
    assert np.array_equal(cert.sets, sets)
    assert coverage(sets, ys) >= 0.85
    assert np.all(cert.training >= 0)
    assert np.all(cert.calibration >= 0)
    assert np.all(cert.joint <= np.minimum(cert.training, cert.calibration))
    assert cert.robust(1, 0).mean() > 0.5
    for r in range(4):
        assert np.array_equal(cert.certified(r, 0), cert.training >= r)
        assert np.array_equal(cert.calibration_radius(r) >= 0, cert.training >= r)
    assert np.array_equal(cert.certified(0, 1), cert.calibration >= 1)
    assert np.array_equal(cert.certified(2, 2), cert.joint >= 2)
    assert fitted.miscoverage_bound_ <= 0.1


def test_compiled_search_equals_the_radius_by_radius_check(fitted, digits_split):
    cert = fitted.certify(digits_split[2][0])
    assert cert.training.max() >= 2
    for r in range(cert.max_train_radius + 1):
        assert np.array_equal(cert.certified(r, 0), cert.training >= r), r
        assert np.array_equal(cert.certified(r, r), cert.joint >= r), r


def test_calibration_radius_is_capped_by_majority_margin(fitted, digits_split):
    cert = fitted.certify(digits_split[2][0])
    tau_hat = fitted.tau_hat_
    inside = cert.calibration[cert.sets]
    outside = cert.calibration[~cert.sets]
    assert inside.max() <= fitted.n_calib_parts - tau_hat - 1
    assert outside.max() <= tau_hat


def test_labels_are_encoded(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    names = np.array([f"digit-{c}" for c in range(10)])
    rps = ReliableConformalClassifier(
        lr(), n_train_parts=5, n_calib_parts=3, confidence_level=0.9
    ).fit(Xt, names[yt])
    rps.conformalize(Xc, names[yc])
    ref = (
        ReliableConformalClassifier(
            lr(), n_train_parts=5, n_calib_parts=3, confidence_level=0.9
        )
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    assert rps.classes_.tolist() == names.tolist()
    assert np.array_equal(
        rps.predict_set(Xs)[1][:, :, 0], ref.predict_set(Xs)[1][:, :, 0]
    )


def test_deterministic_and_order_free(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    a = (
        ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=3)
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    perm = np.random.default_rng(0).permutation(len(yt))
    c = (
        ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=3)
        .fit(Xt[perm], yt[perm])
        .conformalize(Xc, yc)
    )
    assert np.array_equal(a.predict_scores(Xs), c.predict_scores(Xs))
    assert np.array_equal(a.thresholds_, c.thresholds_)


@pytest.mark.slow
def test_parallel_training_equals_sequential(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    a = (
        ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=3, n_jobs=1)
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    b = (
        ReliableConformalClassifier(lr(), n_train_parts=4, n_calib_parts=3, n_jobs=2)
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    assert np.array_equal(a.predict_scores(Xs), b.predict_scores(Xs))


def test_modes_order_thresholds(digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    sizes = {}
    for mode in ("exact", "official", "markov"):
        model = ReliableConformalClassifier(
            lr(), n_train_parts=5, n_calib_parts=5, confidence_level=0.8, quantile=mode
        ).fit(Xt, yt)
        sizes[mode] = model.conformalize(Xc, yc).predict_set(Xs)[1][:, :, 0].sum()
    assert sizes["markov"] >= sizes["exact"]


def test_torch_factory(digits_split):
    (Xt, yt), (Xc, yc), (Xs, ys) = digits_split

    def factory(d, k):
        return torch.nn.Sequential(
            torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Linear(16, k)
        )

    trainer = TorchPartClassifier(factory, epochs=60, lr=0.05)
    a = (
        ReliableConformalClassifier(
            trainer, n_train_parts=3, n_calib_parts=2, confidence_level=0.9
        )
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    b = ReliableConformalClassifier(
        factory, n_train_parts=2, n_calib_parts=2, confidence_level=0.8
    ).fit(Xt[:100], yt[:100])
    assert b.conformalize(Xc, yc).predict_set(Xs)[1][:, :, 0].shape == (len(ys), 10)
    b = (
        ReliableConformalClassifier(
            trainer, n_train_parts=3, n_calib_parts=2, confidence_level=0.9
        )
        .fit(Xt, yt)
        .conformalize(Xc, yc)
    )
    assert np.array_equal(a.predict_scores(Xs), b.predict_scores(Xs))
    assert coverage(a.predict_set(Xs)[1][:, :, 0], ys) > 0.8


class Broken(ClassifierMixin, BaseEstimator):
    def fit(self, X, y):
        raise FloatingPointError("diverged")

    def predict(self, X):
        return np.zeros(len(X), dtype=int)


def rcc(**params):
    return ReliableConformalClassifier(lr(), **{"n_train_parts": 2, **params})


def test_bad_input(fitted, digits_split):
    (Xt, yt), (Xc, yc), (Xs, _) = digits_split
    with pytest.raises(NotFittedError, match="not fitted"):
        rcc(n_calib_parts=2).predict_set(Xs)
    with pytest.raises(NotFittedError, match="not conformalized"):
        rcc(n_calib_parts=2).fit(Xt, yt).predict_set(Xs)
    with pytest.raises(NotFittedError, match="not conformalized"):
        rcc(n_calib_parts=2).fit(Xt, yt).certify(Xs)
    for level in (0.0, 1.0, -1.0, 2.0, np.nan):
        with pytest.raises(ValueError, match="confidence_level"):
            rcc(confidence_level=level).fit(Xt, yt)
    with pytest.raises(ValueError, match="n_train_parts"):
        rcc(n_train_parts=0).fit(Xt, yt)
    with pytest.raises(ValueError, match="quantile"):
        rcc(quantile="median").fit(Xt, yt)
    with pytest.raises(ValueError, match="exceeds the number of training samples"):
        rcc(n_train_parts=50).fit(Xt[:20], yt[:20])
    with pytest.raises(ValueError, match="exceeds the number of calibration samples"):
        rcc(n_calib_parts=30).fit(Xt, yt).conformalize(Xc[:20], yc[:20])
    with pytest.raises(ValueError, match="needs at least"):
        rcc(n_calib_parts=40).fit(Xt, yt).conformalize(Xc, yc)
    with pytest.raises(ValueError, match="not seen at fit time"):
        fitted.conformalize(Xc, np.where(yc == 3, 11, yc))
    bad = Xs.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="Input X contains NaN"):
        fitted.predict_set(bad)
    with pytest.raises(ValueError, match="Input X contains NaN") as info:
        rcc().fit(bad, ys_like(bad))
    assert "RPS part" in " ".join(getattr(info.value, "__notes__", []))
    with pytest.raises(ValueError, match="features"):
        fitted.predict_set(Xs[:, :5])
    with pytest.raises(ValueError, match="at least 2 classes"):
        rcc().fit(Xt, np.zeros(len(Xt)))
    with pytest.raises(TypeError, match="estimator"):
        ReliableConformalClassifier(object()).fit(Xt, yt)
    with pytest.raises(PartTrainingError, match="part 0"):
        ReliableConformalClassifier(Broken(), n_train_parts=2).fit(Xt, yt)
    with pytest.raises(ValueError, match="max_train_radius"):
        fitted.certify(Xs, max_train_radius=-1)


def ys_like(X):
    return np.arange(len(X)) % 2


def test_single_class_part_is_constant(digits_split):
    (Xt, yt), _, (Xs, _) = digits_split
    keep = (yt == 0) | (yt == 1)
    X, y = Xt[keep][:6], yt[keep][:6]
    model = ReliableConformalClassifier(lr(), n_train_parts=3, n_calib_parts=1).fit(
        X, y
    )
    assert model.predict_votes(Xs).sum(axis=1).tolist() == [3] * len(Xs)


def test_memo_reuses_votes_only_for_the_same_batch(fitted, digits_split):
    _, _, (Xs, _) = digits_split
    first = fitted.predict_set(Xs)[1][:, :, 0]
    assert np.array_equal(fitted.certify(Xs).sets, first)
    other = Xs[::-1].copy()
    assert np.array_equal(fitted.predict_set(other)[1][:, :, 0], first[::-1])
    changed = Xs.copy()
    changed[0] = 0.0
    assert (
        fitted.predict_scores(changed)[1:].tolist()
        == fitted.predict_scores(Xs)[1:].tolist()
    )


def test_memo_buffer_reused_across_batches_never_serves_a_stale_batch(
    fitted, digits_split
):
    """The kept copy lives in one buffer reused for batches of one shape: a batch
    changed in place, another batch of that shape, or one that came after
    ``forget`` is compared with the buffer's current content, never an old one;
    threads that alternate two batches each get their own batch's sets."""
    import threading

    _, _, (Xs, _) = digits_split
    X = np.array(Xs, dtype=np.float64)
    Y = X[::-1].copy()
    want_x = fitted.certify(X).sets
    want_y = fitted.certify(Y).sets
    fitted.predict_set(X)
    X[:] = Y  # in place: the same object now holds Y's points
    assert np.array_equal(fitted.certify(X).sets, want_y)
    X[:] = Xs
    fitted.predict_set(Y)
    fitted._parts.forget()
    assert np.array_equal(fitted.certify(X).sets, want_x)
    assert np.array_equal(fitted.predict_set(Y)[1][:, :, 0], want_y)
    wrong = []

    def alternate(first, second, want_first, want_second):
        for _ in range(6):
            for batch, want in ((first, want_first), (second, want_second)):
                if not np.array_equal(fitted.certify(batch).sets, want):
                    wrong.append(1)

    threads = [
        threading.Thread(target=alternate, args=(X, Y, want_x, want_y)),
        threading.Thread(target=alternate, args=(Y, X, want_y, want_x)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong


def test_settings_read_the_same_parameters_as_get_params(fitted):
    """The parameter names are read once per class; the values on every call."""
    from defenses.rps.settings import shallow_params

    model = ReliableConformalClassifier(lr(), n_train_parts=4, softmax=False)
    assert shallow_params(model) == model.get_params(deep=False)
    model.set_params(n_calib_parts=7)
    assert shallow_params(model)["n_calib_parts"] == 7
    assert shallow_params(fitted) == fitted.get_params(deep=False)
