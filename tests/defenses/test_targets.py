import numpy as np
import pandas as pd
import pytest
from sklearn.exceptions import DataConversionWarning

from defenses.targets import check_labels, missing_labels


@pytest.mark.parametrize(
    "labels",
    [
        np.array([1.0, np.nan, 2.0]),
        np.array(["a", None, "b"], dtype=object),
        np.array([1, pd.NA, 2], dtype=object),
        np.array([pd.Timestamp(0), pd.NaT, pd.Timestamp(1)], dtype=object),
        np.array(["2020-01-01", "NaT", "2020-01-02"], dtype="datetime64[D]"),
    ],
)
def test_each_kind_of_missing_label_is_found_and_refused(labels):
    assert missing_labels(labels).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="y contains NaN: 1 missing label"):
        check_labels(labels, "Est")


def test_labels_of_any_type_pass_and_a_column_is_flattened_with_a_warning():
    assert check_labels(["b", "a", "b"], "Est", 3).tolist() == ["b", "a", "b"]
    assert missing_labels(np.array([True, False])).tolist() == [False, False]
    with pytest.warns(DataConversionWarning):
        assert check_labels(np.array([[1], [2]]), "Est").tolist() == [1, 2]


@pytest.mark.parametrize(
    ("y", "error", "message"),
    [
        (None, ValueError, "Est requires y to be passed, but the target y is None"),
        (np.ones((2, 2)), ValueError, "y: y should be a 1d array"),
        (np.array([1 + 1j, 2]), ValueError, "y: Complex data not supported"),
        (np.array([0.5, 1.5]), ValueError, "y: Unknown label type: continuous"),
        (np.array([1, "a"], dtype=object), ValueError, "y: Unknown label type"),
        ([1, 2, 3], ValueError, "y has 3 labels for 2 samples of X"),
    ],
)
def test_what_is_no_classification_target_raises_naming_y(y, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        check_labels(y, "Est", 2)
