"""The installed wheel is the whole product, and owns only its import names.

The slow tests build the wheel, install it into a fresh venv and, from a folder
outside the checkout, run one quick spec of each package by name and every docs
example (docs/suite.md, "Installed names").
"""

import importlib.metadata
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Install:
    """A wheel installed into a fresh venv, and a folder outside the checkout."""

    venv: Path
    purelib: Path
    outside: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def script(self) -> Path:
        return self.venv / "bin" / "defense-suite"

    def run(self, *argv, check=True, timeout=600):
        env = {**os.environ, "PATH": f"{self.venv / 'bin'}:{os.environ['PATH']}"}
        env.pop("PYTHONPATH", None)
        return subprocess.run(
            [str(a) for a in argv],
            cwd=self.outside,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env=env,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build the wheel, install it into a new venv; run everything outside the checkout.

    The new environment sees this environment's libraries (torch, flwr, ...) through
    a path file, but not the checkout; it also holds stray top-level ``crypto``,
    ``federated`` and ``benchmarks`` packages, as PyPI's crypto 1.4.1 and opacus's
    wheel install them.
    """
    tmp_path = tmp_path_factory.mktemp("install")
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
    return Install(venv, purelib, outside)


@pytest.mark.slow
def test_a_fresh_install_works_beside_stray_packages_of_those_names(installed):
    assert (
        "defense-suite run SPEC --out FILE"
        in installed.run(installed.script, "--help").stdout
    )
    version = installed.run(installed.script, "--version").stdout.split()[-1]
    assert version == importlib.metadata.version("defense-suite")
    specs = installed.run(installed.script, "list").stdout
    assert "  ssd-quick " in specs  # the shipped specs, by name, with their titles
    listing = installed.run(installed.script, "list", "--components").stdout
    for name in (
        "digits-membership",
        "federated-membership",
        "crypto-private-inference",
        "ssd-art-rounded",
    ):
        assert f"  {name}\n" in listing  # [all]: nothing marked "not installed"
    assert "not installed" not in listing
    probe = installed.run(
        installed.python,
        "-c",
        "import crypto, federated, benchmarks, defense_suite, defenses; "
        "import defense_suite.crypto.protocol.client,defense_suite.federated.schedule; "
        "from defense_suite.locations import audit_dir, checkout_root, spec_dir; "
        "print(crypto.STRAY, federated.STRAY, benchmarks.STRAY); "
        "print(defense_suite.__file__); print(defenses.__file__); "
        "print(checkout_root(), (spec_dir() / 'reference-quick.toml').is_file(), "
        "(audit_dir() / 'digits-cnn.toml').is_file())",
    ).stdout.splitlines()
    assert probe[0] == "crypto federated benchmarks"  # the strays are untouched
    for line in probe[1:3]:
        assert str(installed.purelib) in line
        assert str(REPO) not in line
    assert probe[3] == "None True True"
    assert not (installed.purelib / "crypto" / "protocol.py").exists()
    assert not (installed.purelib / "federated" / "schedule.py").exists()


QUICK = {
    "reference": "reference-quick",
    "ssd": "ssd-quick",
    "rps": "rps-quick",
    "s3t": "s3t-quick",
    "civet": "civet-quick",
    "federated": "federated-quick",
    "crypto": "crypto-quick",
    "composition": "composition-quick",
}
"""One quick spec of each package, run by name from the wheel (seed 0 only)."""


@pytest.mark.slow
@pytest.mark.parametrize("spec", QUICK.values())
def test_one_quick_spec_of_each_package_runs_by_name_from_the_wheel(installed, spec):
    from defense_suite.spec import load_spec

    out = installed.outside / f"{spec}.jsonl"
    done = installed.run(
        installed.script, "-q", "run", spec, "--out", out, "--seeds", "0", check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records
    assert {r["meta"]["spec"] for r in records} == {spec}
    shipped = load_spec(REPO / "benchmarks" / "specs" / f"{spec}.toml")
    if shipped.defenses:  # a game: every arm of the spec ran
        ran = {r["defense"].split("(")[0] for r in records}
        assert ran == set(shipped.defenses)


def _docs_blocks():
    from tests.test_docs import blocks

    return list(blocks())


@pytest.mark.slow
@pytest.mark.parametrize("code", _docs_blocks())
def test_every_docs_example_runs_against_the_installed_wheel(installed, code):
    script = installed.outside / "example.py"
    script.write_text(code)
    done = installed.run(installed.python, script, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_installs_from_a_checkout_or_a_wheel_and_sizes_every_extra():
    """The package is not on PyPI: no install line may fetch it from there."""
    import tomllib

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    commands = [
        line.split("#")[0].strip()
        for block in section.split("```bash")[1:]
        for line in block.split("```")[0].splitlines()
        if line.startswith("pip install")
    ]
    assert commands[0].startswith("pip install torch==2.13.0 --index-url")
    for command in commands[1:]:
        target = command.split()[-1].strip("'")
        assert target.startswith((".[", "dist/")), command
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in set(extras) - {"dev"}:
        row = next(
            (x for x in section.splitlines() if x.startswith(f"| `'.[{extra}]'`")),
            None,
        )
        assert row is not None, extra
        assert re.search(r"\d+(\.\d+)? (MB|GB)", row), row
