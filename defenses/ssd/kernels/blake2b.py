r"""Keyed BLAKE2b-64 of many equal-length rows in one compiled loop (RFC 7693).

Input-hash seeding draws a query's pseudo-label from a keyed hash of the query's
bytes. Called row by row through :mod:`hashlib`, each row costs a Python call, a
keyed construction and a bytes object, about 1 µs for a short row: ten times the
whole SSD call at K = 10. This is the same function, BLAKE2b with an 8-byte key and
an 8-byte digest (RFC 7693; equal to ``hashlib.blake2b(row, key=key,
digest_size=8)``, tested), over the rows of one contiguous buffer:

* the parameter block sets :math:`h_0 \mathrel{\oplus}= \texttt{0x01010000} \oplus
  (\text{key length} \ll 8) \oplus \text{digest length}`;
* a keyed hash compresses the key, zero-padded to one 128-byte block, first; that
  block is the same for every row, so its state is computed once per call;
* each row's message follows in 128-byte blocks, the last one zero-padded, flagged
  final and counted with the total bytes (the key block's 128 included);
* the digest is the first 8 bytes of :math:`h_0` little-endian, i.e. :math:`h_0`.

The compression function is RFC 7693's :math:`F`: twelve rounds of eight
:math:`G` mixes with rotations by 32, 24, 16 and 63 and the message schedule
:data:`SIGMA`.
"""

from __future__ import annotations

import numpy as np

from defenses.arrays import FloatArray
from defenses.ssd.kernels import simd, simd_inlined

IV = np.array(
    [
        0x6A09E667F3BCC908,
        0xBB67AE8584CAA73B,
        0x3C6EF372FE94F82B,
        0xA54FF53A5F1D36F1,
        0x510E527FADE682D1,
        0x9B05688C2B3E6C1F,
        0x1F83D9ABFB41BD6B,
        0x5BE0CD19137E2179,
    ],
    dtype=np.uint64,
)
"""BLAKE2b's initial chaining value (SHA-512's)."""
SIGMA = np.array(
    [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
        [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
        [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
        [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
        [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
        [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
        [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
        [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
        [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
    ],
    dtype=np.int64,
)
"""The message schedule; rounds 10 and 11 reuse rows 0 and 1."""
BLOCK_WORDS = 16
"""64-bit words per 128-byte block."""


@simd_inlined
def _rotr(x: np.uint64, n: int) -> np.uint64:
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


@simd
def _mix(
    a: np.uint64, b: np.uint64, c: np.uint64, d: np.uint64, x: np.uint64, y: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """RFC 7693's ``G``: mix four state words with two message words.

    Compiled once and inlined by LLVM, not by numba (scalars only, so the call
    passes no reference-counted array): numba's inlining of its 96 call sites made
    :func:`blake2b_rows` take 154 s to compile against 26 s (load average 12 on 2
    cores), at the same speed (122-127 ns a 1-block row either way, side by side)
    and with the same digests.
    """
    a = a + b + x
    d = _rotr(d ^ a, 32)
    c = c + d
    b = _rotr(b ^ c, 24)
    a = a + b + y
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 63)
    return a, b, c, d


@simd_inlined
def _compress(
    h: np.ndarray,
    m: np.ndarray,
    counter: int,
    last: bool,
    iv: np.ndarray,
) -> None:
    """RFC 7693's ``F``: fold one 16-word block ``m`` into the state ``h`` in place.

    The sixteen working words and the message are locals (registers), not arrays,
    and the twelve rounds are written out with :data:`SIGMA`'s indices.
    """
    m0, m1, m2, m3, m4, m5, m6, m7 = m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]
    m8, m9, m10, m11 = m[8], m[9], m[10], m[11]
    m12, m13, m14, m15 = m[12], m[13], m[14], m[15]
    v0, v1, v2, v3, v4, v5, v6, v7 = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    v8, v9, v10, v11 = iv[0], iv[1], iv[2], iv[3]
    v12 = iv[4] ^ np.uint64(counter)
    v13 = iv[5]
    v14 = ~iv[6] if last else iv[6]
    v15 = iv[7]
    # round 0: SIGMA[0]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m14, m15)
    # round 1: SIGMA[1]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m14, m10)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m4, m8)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m9, m15)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m13, m6)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m1, m12)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m0, m2)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m11, m7)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m5, m3)
    # round 2: SIGMA[2]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m11, m8)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m12, m0)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m5, m2)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m15, m13)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m10, m14)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m3, m6)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m7, m1)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m9, m4)
    # round 3: SIGMA[3]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m7, m9)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m3, m1)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m13, m12)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m11, m14)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m2, m6)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m5, m10)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m4, m0)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m15, m8)
    # round 4: SIGMA[4]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m9, m0)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m5, m7)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m2, m4)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m10, m15)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m14, m1)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m11, m12)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m6, m8)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m3, m13)
    # round 5: SIGMA[5]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m2, m12)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m6, m10)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m0, m11)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m8, m3)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m4, m13)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m7, m5)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m15, m14)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m1, m9)
    # round 6: SIGMA[6]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m12, m5)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m1, m15)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m14, m13)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m4, m10)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m0, m7)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m6, m3)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m9, m2)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m8, m11)
    # round 7: SIGMA[7]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m13, m11)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m7, m14)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m12, m1)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m3, m9)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m5, m0)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m15, m4)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m8, m6)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m2, m10)
    # round 8: SIGMA[8]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m6, m15)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m14, m9)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m11, m3)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m0, m8)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m12, m2)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m13, m7)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m1, m4)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m10, m5)
    # round 9: SIGMA[9]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m10, m2)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m8, m4)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m7, m6)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m1, m5)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m15, m11)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m9, m14)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m3, m12)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m13, m0)
    # round 10: SIGMA[0]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m0, m1)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m2, m3)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m4, m5)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m6, m7)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m8, m9)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m10, m11)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m12, m13)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m14, m15)
    # round 11: SIGMA[1]
    v0, v4, v8, v12 = _mix(v0, v4, v8, v12, m14, m10)
    v1, v5, v9, v13 = _mix(v1, v5, v9, v13, m4, m8)
    v2, v6, v10, v14 = _mix(v2, v6, v10, v14, m9, m15)
    v3, v7, v11, v15 = _mix(v3, v7, v11, v15, m13, m6)
    v0, v5, v10, v15 = _mix(v0, v5, v10, v15, m1, m12)
    v1, v6, v11, v12 = _mix(v1, v6, v11, v12, m0, m2)
    v2, v7, v8, v13 = _mix(v2, v7, v8, v13, m11, m7)
    v3, v4, v9, v14 = _mix(v3, v4, v9, v14, m5, m3)
    h[0] ^= v0 ^ v8
    h[1] ^= v1 ^ v9
    h[2] ^= v2 ^ v10
    h[3] ^= v3 ^ v11
    h[4] ^= v4 ^ v12
    h[5] ^= v5 ^ v13
    h[6] ^= v6 ^ v14
    h[7] ^= v7 ^ v15


@simd
def blake2b_rows(
    words: np.ndarray,
    length: int,
    key: np.uint64,
    iv: np.ndarray,
) -> FloatArray:
    """Uniforms in [0, 1): the top 53 bits of each row's keyed BLAKE2b-64 digest.

    ``words`` (N x 16 B, uint64) holds each row's ``length`` message bytes
    little-endian, zero-padded to whole 128-byte blocks (B >= 1); ``key`` is the
    8-byte key as a little-endian integer.
    """
    n = words.shape[0]
    blocks = max(1, (length + 127) // 128)
    start = np.empty(8, dtype=np.uint64)
    for i in range(8):
        start[i] = iv[i]
    start[0] ^= np.uint64(0x01010000 | (8 << 8) | 8)
    key_block = np.zeros(BLOCK_WORDS, dtype=np.uint64)
    key_block[0] = key
    _compress(start, key_block, 128, length == 0, iv)
    out = np.empty(n)
    h = np.empty(8, dtype=np.uint64)
    for row in range(n):
        for i in range(8):
            h[i] = start[i]
        if length > 0:
            for b in range(blocks):
                last = b == blocks - 1
                counter = 128 + (length if last else 128 * (b + 1))
                block = words[row, b * BLOCK_WORDS : (b + 1) * BLOCK_WORDS]
                _compress(h, block, counter, last, iv)
        out[row] = float(h[0] >> np.uint64(11)) * 2.0**-53
    return out
