import numpy as np
import pytest

from defenses import data


@pytest.mark.parametrize(
    ("name", "n", "k"),
    [("digits", 1797, 10), ("breast_cancer", 569, 2), ("wine", 178, 3)],
)
def test_bundled_sets_load_offline(name, n, k):
    dataset = data.load(name)
    assert dataset.X.shape[0] == n
    assert dataset.n_classes == k
    assert np.isfinite(dataset.X).all()


def test_digits_are_scaled_images():
    digits = data.load_digits()
    assert digits.image_shape == (8, 8)
    assert digits.X.min() == 0.0
    assert digits.X.max() == 1.0


def test_unknown_set_is_refused():
    with pytest.raises(ValueError, match="available"):
        data.load("mnist")


def test_identities_are_seeded_and_shaped():
    a, protos = data.make_identities(np.random.default_rng(1), n_classes=5, dim=4)
    b, _ = data.make_identities(np.random.default_rng(1), n_classes=5, dim=4)
    np.testing.assert_array_equal(a.X, b.X)
    assert protos.shape == (5, 4)
    assert np.bincount(a.y).tolist() == [40] * 5
    centroid = a.X[a.y == 2].mean(axis=0)
    assert np.linalg.norm(centroid - protos[2]) < np.linalg.norm(centroid - protos[3])


def test_coarse_to_fine_structure():
    d = data.make_coarse_to_fine(
        np.random.default_rng(0), n_coarse=3, fine_per_coarse=2
    )
    assert d.n_classes == 6
    assert d.coarse is not None
    for fine in range(6):
        assert np.unique(d.coarse[d.y == fine]).tolist() == [fine // 2]


def test_stratified_split_is_deterministic_disjoint_and_stratified():
    y = np.repeat(np.arange(4), 50)
    parts = data.stratified_split(y, [0.5, 0.3, 0.2], np.random.default_rng(0))
    again = data.stratified_split(y, [0.5, 0.3, 0.2], np.random.default_rng(0))
    for a, b in zip(parts, again, strict=True):
        np.testing.assert_array_equal(a, b)
    joined = np.concatenate(parts)
    assert np.unique(joined).size == joined.size == y.size
    assert np.bincount(y[parts[1]]).tolist() == [15] * 4


@pytest.mark.parametrize("fractions", [[0.1, 0.1, 0.8], [0.45, 0.33, 0.22], [0.5, 0.5]])
@pytest.mark.parametrize("name", ["digits", "wine"])
def test_stratified_split_sizes_and_class_shares(name, fractions):
    y = data.load(name).y
    parts = data.stratified_split(y, fractions, np.random.default_rng(1))
    bounds = np.round(np.cumsum(fractions) * y.size).astype(int)
    assert [p.size for p in parts] == np.diff(np.r_[0, bounds]).tolist()
    classes = np.bincount(y)
    for part, share in zip(parts, fractions, strict=True):
        counts = np.bincount(y[part], minlength=classes.size)
        assert np.all(np.abs(counts - share * classes) <= 1.0 + 1e-9)


def test_a_part_too_small_for_every_class_is_refused():
    y = np.repeat(np.arange(10), 5)
    with pytest.raises(ValueError, match="fractions"):
        data.stratified_split(y, [0.1, 0.9], np.random.default_rng(0))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: data.stratified_split([0, 1], [0.5, 0.6], np.random.default_rng()),
            "sum to 1",
        ),
        (
            lambda: data.stratified_split([], [1.0], np.random.default_rng()),
            "non-empty",
        ),
        (
            lambda: data.make_identities(np.random.default_rng(), n_classes=0),
            "n_classes",
        ),
        (lambda: data.make_coarse_to_fine(np.random.default_rng(), noise=0), "noise"),
        (
            lambda: data.Dataset(np.array([[np.nan]]), np.array([0]), "x", 1),
            "NaN",
        ),
        (lambda: data.Dataset(np.ones((2, 1)), np.array([0, 3]), "x", 2), "labels"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
