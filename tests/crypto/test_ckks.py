from __future__ import annotations

import pytest

from defense_suite.crypto.he.ckks import (
    INTERACTIVE,
    INTERACTIVE_WIDE,
    NON_INTERACTIVE,
    CKKSParams,
    InsecureParameters,
    fingerprint,
    load_public,
    make_context,
    public_bytes,
)


def test_presets_are_secure() -> None:
    for p in (INTERACTIVE, INTERACTIVE_WIDE, NON_INTERACTIVE):
        assert p.security_bits == 128
    assert INTERACTIVE.log_q == 218
    assert INTERACTIVE.levels == 5
    assert INTERACTIVE.slots == 4096
    assert NON_INTERACTIVE.levels == 26
    assert NON_INTERACTIVE.log_q <= 881


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"poly_modulus_degree": 8192, "coeff_mod_bit_sizes": (60, 40, 40, 40, 60)},
            InsecureParameters,
            "insecure",
        ),
        (
            {"poly_modulus_degree": 4096, "coeff_mod_bit_sizes": (60, 40, 60)},
            InsecureParameters,
            "109",
        ),
        (
            {"poly_modulus_degree": 8192, "coeff_mod_bit_sizes": (60, 40, 30, 60)},
            ValueError,
            "inconsistent",
        ),
        (
            {"poly_modulus_degree": 8192, "coeff_mod_bit_sizes": (40, 40, 60)},
            ValueError,
            "first prime",
        ),
        ({"poly_modulus_degree": 5000}, ValueError, "poly_modulus_degree"),
        ({"coeff_mod_bit_sizes": (60, 40)}, ValueError, "coeff_mod_bit_sizes"),
    ],
)
def test_bad_parameters(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        CKKSParams(**kwargs)  # type: ignore[arg-type]


def test_public_context_has_no_secret() -> None:
    ctx = make_context(INTERACTIVE)
    public = load_public(public_bytes(ctx))
    assert not public.is_private()
    assert fingerprint(public) == fingerprint(ctx)
    with pytest.raises(ValueError, match="public context"):
        load_public(ctx.serialize(save_secret_key=True))
