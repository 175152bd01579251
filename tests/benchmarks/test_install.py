"""The suite installs only import names it owns (docs/suite.md, "Installed names")."""

import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ABSOLUTE = re.compile(r"^\s*(from|import)\s+(crypto|federated)\b", re.M)


def _sources():
    skip = {".venv", ".git", "results", "__pycache__", ".mypy_cache", ".ruff_cache"}
    for folder, subfolders, files in os.walk(REPO):
        here = Path(folder)
        subfolders[:] = [
            name
            for name in subfolders
            if name not in skip and not (here / name).is_symlink()  # the two links
        ]
        for name in files:
            if name.endswith((".py", ".md")):
                yield here / name


def test_no_module_imports_crypto_or_federated_by_their_top_level_names():
    offenders = [
        f"{path.relative_to(REPO)}: {match.group(0).strip()}"
        for path in _sources()
        for match in ABSOLUTE.finditer(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], (
        "import defense_suite.crypto / defense_suite.federated (relative imports "
        "inside the two packages):\n" + "\n".join(offenders)
    )


def test_the_links_point_at_the_required_folders():
    for name in ("crypto", "federated"):
        link = REPO / "defense_suite" / name
        assert link.is_symlink()
        assert link.resolve() == (REPO / name).resolve()


def test_specs_are_found_in_the_checkout():
    from defense_suite.locations import checkout_root, spec_dir

    assert checkout_root() == REPO
    assert spec_dir() == REPO / "benchmarks" / "specs"


@pytest.mark.slow
def test_a_fresh_install_works_beside_stray_packages_of_those_names(tmp_path):
    """Build the wheel, install it into a new venv, run the CLI outside the checkout.

    The new environment sees this environment's libraries (torch, flwr, ...) through
    a path file, but not the checkout; it also holds stray top-level ``crypto``,
    ``federated`` and ``benchmarks`` packages, as PyPI's crypto 1.4.1 and opacus's
    wheel install them.
    """
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), "."],
        cwd=REPO,
        check=True,
    )
    (wheel,) = dist.glob("defense_suite-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [
                str(python),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = [
        Path(p) for p in (*site.getsitepackages(), sysconfig.get_paths()["purelib"])
    ]
    (purelib / "_suite_libraries.pth").write_text(
        "\n".join(sorted({str(p) for p in ours if p.is_dir()})) + "\n"
    )
    for stray in ("crypto", "federated", "benchmarks"):
        (purelib / stray).mkdir()
        (purelib / stray / "__init__.py").write_text(f"STRAY = {stray!r}\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = venv / "bin" / "defense-suite"

    def run(*argv):
        return subprocess.run(
            argv, cwd=outside, capture_output=True, text=True, check=True, timeout=600
        ).stdout

    assert "defense-suite run SPEC --out FILE" in run(str(script), "--help")
    listing = run(str(script), "list")
    for name in (
        "digits-membership",
        "federated-membership",
        "crypto-private-inference",
    ):
        assert f"  {name}" in listing
    probe = run(
        str(python),
        "-c",
        "import crypto, federated, benchmarks, defense_suite, defenses; "
        "import defense_suite.crypto.protocol, defense_suite.federated.schedule; "
        "from defense_suite.locations import checkout_root, spec_dir; "
        "print(crypto.STRAY, federated.STRAY, benchmarks.STRAY); "
        "print(defense_suite.__file__); print(defenses.__file__); "
        "print(checkout_root(), (spec_dir() / 'reference-quick.toml').is_file())",
    ).splitlines()
    assert probe[0] == "crypto federated benchmarks"  # the strays are untouched
    for line in probe[1:3]:
        assert str(purelib) in line
        assert str(REPO) not in line
    assert probe[3] == "None True"
    assert not (purelib / "crypto" / "protocol.py").exists()
    assert not (purelib / "federated" / "schedule.py").exists()
