"""Importing the HE package and its protocol pulls no heavy library (issue 20)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "sklearn", "tenseal", "scipy.stats", "matplotlib")


@pytest.mark.parametrize(
    "module",
    [
        "defense_suite.crypto",
        "defense_suite.crypto.protocol",
        "defense_suite.crypto.protocol.client",
        "defense_suite.crypto.protocol.transport",
    ],
)
def test_import_pulls_no_heavy_library(module: str) -> None:
    code = (
        f"import sys, {module}; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()} eagerly"


def test_every_public_name_of_the_package_and_its_protocol_imports() -> None:
    """The names the docs teach stay importable where the docs import them."""
    import defense_suite.crypto as crypto
    from defense_suite.crypto import protocol

    for package in (crypto, protocol):
        table = package._LAZY
        assert table, package.__name__
        for name in table:
            value = getattr(package, name)
            assert getattr(value, "__name__", name) == name, (package.__name__, name)
        with pytest.raises(AttributeError, match="no attribute"):
            package.__getattr__("not_a_public_name")


def test_the_lazy_names_are_the_defining_modules_objects() -> None:
    from defense_suite.crypto import BertClient, Client, Loopback, Server, convert
    from defense_suite.crypto.conversion.bert import convert as defined
    from defense_suite.crypto.protocol import Client as protocol_client
    from defense_suite.crypto.protocol.client import Client as defining
    from defense_suite.crypto.protocol.encoder_client import BertClient as bert
    from defense_suite.crypto.protocol.server import Server as server
    from defense_suite.crypto.protocol.transport import Loopback as loopback

    assert Client is protocol_client is defining
    assert (BertClient, Server, Loopback, convert) == (bert, server, loopback, defined)
