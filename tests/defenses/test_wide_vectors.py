"""Wide kernels: the attribute reaches LLVM, for those kernels only; no bit moves."""

from __future__ import annotations

import numba
import numpy as np

from defenses.jit import KernelCache, vectorizable
from defenses.wide_vectors import ATTRIBUTE, PIPELINE


def _ordered_sums(x: np.ndarray, out: np.ndarray) -> None:
    # a loop the vectorizer widens (rows as lanes) and an ordered sum it must not
    # reorder
    n, k = x.shape
    for c in range(k):
        for r in range(n):
            out[r] = out[r] * 0.5 + np.sqrt(x[r, c]) / (1.0 + x[r, c])
    total = 0.0
    for r in range(n):
        total += out[r]
    out[0] = total


def test_the_pipeline_is_available_with_the_installed_numba():
    assert PIPELINE is not None


def test_a_wide_kernel_carries_the_attribute_and_a_plain_one_does_not():
    x = np.random.default_rng(0).random((257, 7))
    wide = numba.njit(pipeline_class=PIPELINE, error_model="numpy")(_ordered_sums)
    plain = numba.njit(error_model="numpy")(_ordered_sums)
    out_wide, out_plain = np.zeros(257), np.zeros(257)
    wide(x, out_wide)
    plain(x, out_plain)
    assert ATTRIBUTE in wide.inspect_llvm(wide.signatures[0])
    assert ATTRIBUTE not in plain.inspect_llvm(plain.signatures[0])
    np.testing.assert_array_equal(out_wide, out_plain)


def test_the_width_is_part_of_the_cache_stamp():
    wide = vectorizable(_ordered_sums, wide=True)
    plain = vectorizable(_ordered_sums)
    assert wide._compiler.pipeline_class is PIPELINE
    assert plain._compiler.pipeline_class is not PIPELINE
    wide_cache, plain_cache = wide._cache, plain._cache
    assert isinstance(wide_cache, KernelCache)
    assert isinstance(plain_cache, KernelCache)
    assert wide_cache._tag == "wide"
    assert plain_cache._tag == ""
