r"""CKKS parameters checked against the HE standard, and the TenSEAL backend.

Security: the Homomorphic Encryption Standard (Albrecht et al., 2018, Table 1;
also enforced by Microsoft SEAL) bounds the total coefficient-modulus size
:math:`\\log_2 Q` for 128-bit classical security with a ternary secret:

=====  ======
N      log Q
=====  ======
1024   27
2048   54
4096   109
8192   218
16384  438
32768  881
=====  ======

:class:`CKKSParams` refuses anything above the bound ("insecure") and chains whose
middle primes differ from the scale ("inconsistent": the scale would drift after
every rescale). TenSEAL is imported lazily.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from defenses.checks import check_int

HE_STANDARD_128 = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}


class InsecureParameters(ValueError):
    """The CKKS parameters give less than 128-bit security."""


@dataclass(frozen=True)
class CKKSParams:
    r"""A CKKS modulus chain.

    Parameters
    ----------
    poly_modulus_degree : int
        Ring dimension N (a power of two in the HE-standard table); N/2 slots.
    coeff_mod_bit_sizes : tuple of int
        Prime sizes: a first (decryption) prime, ``levels`` middle primes equal to
        ``scale_bits``, a last (special) prime.
    scale_bits : int
        :math:`\\log_2` of the CKKS scale :math:`\\Delta`.
    """

    poly_modulus_degree: int = 16384
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 40, 40, 40, 40, 40, 60)
    scale_bits: int = 40

    def __post_init__(self) -> None:
        n = check_int("CKKSParams.poly_modulus_degree", self.poly_modulus_degree, 1)
        if n not in HE_STANDARD_128:
            raise ValueError(
                "CKKSParams.poly_modulus_degree must be one of "
                f"{sorted(HE_STANDARD_128)}, got {n!r}"
            )
        object.__setattr__(self, "poly_modulus_degree", n)
        raw = self.coeff_mod_bit_sizes
        if not isinstance(raw, tuple | list) or len(raw) < 3:
            raise ValueError(
                "CKKSParams.coeff_mod_bit_sizes must hold >= 3 ints in [20, 60], "
                f"got {raw!r}"
            )
        bits = tuple(
            check_int("CKKSParams.coeff_mod_bit_sizes", b, 20, 60) for b in raw
        )
        object.__setattr__(self, "coeff_mod_bit_sizes", bits)
        scale = check_int("CKKSParams.scale_bits", self.scale_bits, 20, 59)
        object.__setattr__(self, "scale_bits", scale)
        if any(b != self.scale_bits for b in bits[1:-1]):
            raise ValueError(
                "CKKSParams is inconsistent: middle primes "
                f"{bits[1:-1]} must all equal "
                f"scale_bits={self.scale_bits} (otherwise the "
                "scale drifts at each rescale)"
            )
        if (
            bits[0] <= self.scale_bits
            or bits[-1] < bits[0] - 20
            or bits[-1] < self.scale_bits
        ):
            raise ValueError(
                "CKKSParams is inconsistent: the first prime "
                f"({bits[0]} bits) must exceed "
                f"the scale ({self.scale_bits} bits) and the "
                "last prime must be at least "
                f"as large as the scale, got {bits!r}"
            )
        if self.log_q > HE_STANDARD_128[n]:
            raise InsecureParameters(
                f"CKKSParams are insecure: log2 Q = {self.log_q} bits exceeds the "
                f"128-bit HE-standard bound of {HE_STANDARD_128[n]} bits for N = {n}"
            )

    @property
    def log_q(self) -> int:
        """Total coefficient-modulus bits."""
        return int(sum(self.coeff_mod_bit_sizes))

    @property
    def levels(self) -> int:
        """Multiplicative levels (rescales) before the chain is exhausted."""
        return len(self.coeff_mod_bit_sizes) - 2

    @property
    def slots(self) -> int:
        """Number of CKKS slots, N / 2."""
        return self.poly_modulus_degree // 2

    @property
    def security_bits(self) -> int:
        """128 (the bound checked at construction)."""
        return 128

    @classmethod
    def with_levels(
        cls, poly_modulus_degree: int, levels: int, scale_bits: int = 40
    ) -> CKKSParams:
        """A chain ``[scale+20, scale x levels, scale+20]`` (ends capped at 60)."""
        edge = min(scale_bits + 20, 60)
        return cls(
            poly_modulus_degree, (edge, *([scale_bits] * levels), edge), scale_bits
        )


INTERACTIVE = CKKSParams(8192, (38, 30, 30, 30, 30, 30, 30), 30)
"""N = 8192, 5 levels of 30 bits (218 bits): fast, refreshes every few stages."""
INTERACTIVE_WIDE = CKKSParams.with_levels(16384, 7)
"""N = 16384, 7 levels of 40 bits: more precision, fewer refreshes."""
NON_INTERACTIVE = CKKSParams(32768, (50, *([30] * 26), 50), 30)
"""N = 32768, 26 levels of 30 bits (880 bits): the whole layer without refreshes."""


def _ts() -> Any:
    import tenseal

    return tenseal


def make_context(params: CKKSParams, galois: bool = False) -> Any:
    """A private TenSEAL CKKS context (secret key inside) for ``params``."""
    ts = _ts()
    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS,
        params.poly_modulus_degree,
        coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
    )
    ctx.global_scale = 2.0**params.scale_bits
    if galois:
        ctx.generate_galois_keys()
    return ctx


def local_key_owner(
    params: CKKSParams, galois: bool = True
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """Encrypt and decrypt of a key owner in this process (a fresh private context).

    The function-call paths of the encrypted steps use it in place of a client
    over a channel: ``encrypt(values)`` encodes float64 values at the context's
    scale, ``decrypt(vector)`` returns them as a float64 array.
    """
    import numpy as np

    ts = _ts()
    ctx = make_context(params, galois=galois)

    def encrypt(values: Any) -> Any:
        return ts.ckks_vector(ctx, list(np.asarray(values, dtype=np.float64)))

    def decrypt(vector: Any) -> Any:
        return np.asarray(vector.decrypt(), dtype=np.float64)

    return encrypt, decrypt


def public_bytes(ctx: Any) -> bytes:
    """Serialise the context without its secret key (what the server receives)."""
    out: bytes = ctx.serialize(
        save_public_key=True,
        save_secret_key=False,
        save_galois_keys=True,
        save_relin_keys=True,
    )
    return out


def load_public(data: bytes) -> Any:
    """Deserialise a context and refuse one that holds a secret key.

    Raises
    ------
    TypeError
        If ``data`` is not bytes.
    ValueError
        If it is not a serialised TenSEAL context, or the context is private.
    """
    if not isinstance(data, bytes):
        raise TypeError(f"context must be bytes, got {type(data).__name__}")
    try:
        ctx = _ts().context_from(data)
    except (ValueError, RuntimeError) as err:  # TenSEAL's parse errors
        raise ValueError(f"context: not a serialised TenSEAL context ({err})") from None
    if ctx.is_private() or ctx.has_secret_key():
        raise ValueError(
            "the server must be given a public context: this one holds the secret key"
        )
    return ctx


def load_ciphertext(ctx: Any, data: bytes, what: str, size: int | None = None) -> Any:
    """Deserialise one CKKS vector under ``ctx``, checking it is a whole ciphertext.

    TenSEAL parses some garbage (an empty or short stream) into an empty vector, so
    the vector must hold one ciphertext and, when ``size`` is given, that many slots.

    Raises
    ------
    ValueError
        Naming ``what`` when the bytes are not such a ciphertext.
    """
    if not isinstance(data, bytes):
        raise TypeError(f"{what} must be bytes, got {type(data).__name__}")
    try:
        vec = _ts().ckks_vector_from(ctx, data)
    except (ValueError, RuntimeError) as err:  # TenSEAL's parse errors
        raise ValueError(f"{what}: not a CKKS ciphertext ({err})") from None
    if len(vec.data.ciphertext()) != 1 or (size is not None and vec.size() != size):
        raise ValueError(
            f"{what}: not a whole CKKS ciphertext"
            + (f" of {size} slots" if size is not None else "")
            + " (truncated or malformed)"
        )
    return vec


def fingerprint(ctx: Any) -> str:
    """Hash of the public key: tags ciphertexts so another key's are refused."""
    blob = ctx.serialize(
        save_public_key=True,
        save_secret_key=False,
        save_galois_keys=False,
        save_relin_keys=False,
    )
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class TenSEALBackend:
    """The :class:`~crypto.he.evaluator.Backend` on TenSEAL ``CKKSVector`` ciphertexts.

    TenSEAL's automatic modulus switching lowers the *right* operand of a binary
    operation in place when it sits at a higher level (measured on 0.3.18): a
    weight ciphertext used once against a deep value would be left deep for its
    next use. Binary operations therefore put the operand with more primes on the
    left (``copy()`` would clone the whole context and costs ~1 s).
    """

    @staticmethod
    def _primes(a: Any) -> int:
        return int(a.data.ciphertext()[0].coeff_modulus_size())

    def add(self, a: Any, b: Any) -> Any:
        """A + b."""
        return a + b if self._primes(a) >= self._primes(b) else b + a

    def sub(self, a: Any, b: Any) -> Any:
        """A - b."""
        return a - b if self._primes(a) >= self._primes(b) else -b + a

    def mul(self, a: Any, b: Any) -> Any:
        """A * b (relinearised and rescaled by TenSEAL)."""
        return a * b if self._primes(a) >= self._primes(b) else b * a

    def square(self, a: Any) -> Any:
        """a^2."""
        return a.square()

    def mul_scalar(self, a: Any, c: float) -> Any:
        """A * c."""
        return a * c

    def add_scalar(self, a: Any, c: float) -> Any:
        """A + c."""
        return a + c

    def polyval(self, a: Any, coefficients: Sequence[float]) -> Any:
        """TenSEAL polyval (depth ceil(log2(deg + 1)))."""
        return a.polyval(list(coefficients))

    def neg(self, a: Any) -> Any:
        """-a."""
        return -a

    def mul_plain(self, a: Any, mask: Any) -> Any:
        """A * mask, slot-wise with a public vector."""
        return a * [float(m) for m in mask]

    def sum_slots(self, a: Any) -> Any:
        """Slot sum by rotate-and-add (needs Galois keys); TenSEAL replicates it."""
        return a.sum()
