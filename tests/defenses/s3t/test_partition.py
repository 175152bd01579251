from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from defenses.s3t import partition


@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=30, unique=True))
def test_a_points_cell_does_not_depend_on_the_others(ids: list[int]) -> None:
    together = partition.keys(ids, "salt")
    alone = np.array([partition.keys([v], "salt")[0] for v in ids], dtype=np.uint64)
    assert np.array_equal(together, alone)
    shard, slc = partition.assign(together, 3, 4)
    assert np.all(shard < 3)
    assert np.all(slc < 4)


def test_salt_and_type_change_the_key() -> None:
    assert partition.keys([7], "a")[0] != partition.keys([7], "b")[0]
    assert partition.keys([7], "a")[0] != partition.keys(["7"], "a")[0]


def test_assignment_is_roughly_uniform() -> None:
    shard, slc = partition.assign(partition.keys(list(range(6000)), "s"), 3, 2)
    counts = np.bincount((shard * 2 + slc).astype(int), minlength=6)
    assert counts.min() > 850
    assert counts.max() < 1150


@pytest.mark.parametrize(
    ("ids", "match"),
    [([[1, 2]], "must be 1-D"), ([1.5, 2.5], "integers or strings")],
)
def test_bad_ids(ids: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition.check_ids(ids)  # type: ignore[arg-type]


def test_bad_id_token() -> None:
    with pytest.raises(ValueError, match="integers or strings"):
        partition.id_token(1.5)
