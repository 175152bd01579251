"""Input-hash seeding: the compiled BLAKE2b is hashlib's, and the uniforms unchanged."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest
import scipy.sparse
import torch

from defenses.ssd import seeding
from defenses.ssd.kernels.blake2b import IV, blake2b_rows
from defenses.ssd.seeding import hash_uniforms, input_keys, input_uniforms


def _hashlib_uniform(message: bytes, key: np.uint64) -> float:
    digest = hashlib.blake2b(message, key=key.tobytes(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


@pytest.mark.parametrize(
    "length", [0, 1, 7, 8, 9, 90, 127, 128, 129, 255, 256, 257, 383, 1000]
)
def test_compiled_blake2b_is_hashlibs(length):
    rng = np.random.default_rng(length)
    n = 4
    blocks = max(1, -(-length // 128))
    buffer = np.zeros((n, blocks * 128), dtype=np.uint8)
    buffer[:, :length] = rng.integers(0, 256, (n, length), dtype=np.uint8)
    key = np.uint64(rng.integers(0, 2**63)) * np.uint64(2) + np.uint64(1)
    got = blake2b_rows(buffer.view(np.uint64), length, key, IV)
    want = [_hashlib_uniform(row[:length].tobytes(), key) for row in buffer]
    np.testing.assert_array_equal(got, want)


def _inputs():
    rng = np.random.default_rng(0)
    odd = rng.normal(size=(6, 3))
    odd[0, 0] = np.nan
    odd[1, 1] = -np.inf
    odd[2, 2] = -0.0
    odd[3, 0] = 1e300
    return [
        (rng.normal(size=(50, 10)), None),
        (rng.normal(size=(50, 10)), 0.25),
        (odd, None),
        (odd, 1e-3),
        (rng.integers(0, 5, size=(20, 2, 3, 4)), None),
        (np.empty((5, 0)), None),
        (torch.randn(7, 20, dtype=torch.float32), 0.1),
        (scipy.sparse.random(9, 30, density=0.2, random_state=1, format="csr"), None),
    ]


@pytest.mark.parametrize(("inputs", "resolution"), _inputs())
def test_input_uniforms_are_the_hash_of_the_input_keys(inputs, resolution):
    key = np.uint64(0x0123456789ABCDEF)
    n = inputs.shape[0]
    expected = hash_uniforms(input_keys(inputs, n, resolution), key.tobytes())
    np.testing.assert_array_equal(input_uniforms(inputs, n, resolution, key), expected)


def test_input_uniforms_check_the_row_count():
    with pytest.raises(ValueError, match="one row per row"):
        input_uniforms(np.zeros((3, 2)), 4, None, np.uint64(1))


@pytest.mark.parametrize("resolution", [None, 0.25])
def test_input_uniforms_in_small_buffers_are_the_same(monkeypatch, resolution):
    """Rows hashed in buffers of a few rows give the one-buffer uniforms."""
    rng = np.random.default_rng(3)
    inputs = rng.normal(size=(23, 10))
    key = np.uint64(12345)
    want = hash_uniforms(input_keys(inputs, 23, resolution), key.tobytes())
    monkeypatch.setattr(seeding, "HASH_BUFFER_BYTES", 3 * 128)
    np.testing.assert_array_equal(input_uniforms(inputs, 23, resolution, key), want)


def test_input_uniforms_memory_does_not_grow_with_the_batch(monkeypatch):
    monkeypatch.setenv("DEFENSE_SUITE_JIT", "inline")  # the kernel's, not the twin's
    inputs = np.random.default_rng(4).random((20_000, 100))  # 16 MB
    input_uniforms(inputs[:10], 10, None, np.uint64(1))  # compile outside the trace
    tracemalloc.start()
    input_uniforms(inputs, 20_000, None, np.uint64(1))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * seeding.HASH_BUFFER_BYTES + 8 * 20_000 < inputs.nbytes / 8
